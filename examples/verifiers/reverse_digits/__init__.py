"""A verifiers v1 taskset, written in verifiers' own format (it imports only verifiers): reverse three
digits. agent-r1 trains it through its verifiers env (docs/ecosystem.md); verifiers itself runs it
too (``vf-eval reverse_digits`` with this folder on PYTHONPATH).

The 1000 strings "000".."999" are split once, with a fixed seed, into 800 ``train`` and 200 ``test``
rows, so the test rows are held out. The prompt is ``"reverse 381"``; the reward ``correct`` is 1.0
when the harness's last reply is ``"183"``, and the metric ``digits`` is the share of the three
positions it got right.
"""

import random

import verifiers.v1 as vf

TRAIN_ROWS = 800


class ReverseData(vf.TaskData):
    answer: str
    """The digits reversed."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def digits(self, trace: vf.Trace) -> float:
        reply = trace.last_reply.strip()
        return sum(a == b for a, b in zip(reply, self.data.answer, strict=False)) / len(self.data.answer)


class ReverseConfig(vf.TasksetConfig):
    split: str = "train"
    """``train`` (800 rows) or ``test`` (the other 200)."""


class ReverseDigitsTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        if self.config.split not in ("train", "test"):
            raise ValueError(f"reverse_digits: split must be 'train' or 'test', got {self.config.split!r}")
        numbers = [f"{n:03d}" for n in range(1000)]
        random.Random(0).shuffle(numbers)
        chosen = numbers[:TRAIN_ROWS] if self.config.split == "train" else numbers[TRAIN_ROWS:]
        for digits in chosen:
            data = ReverseData(id=f"reverse-{digits}", prompt=f"reverse {digits}", answer=digits[::-1])
            yield ReverseTask(data, self.config.task)


__all__ = ["ReverseDigitsTaskset"]
