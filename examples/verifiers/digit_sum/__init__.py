"""A verifiers v1 taskset, written in verifiers' own format (it imports only verifiers): add two
digits. agent-r1 trains it through its verifiers adapter (docs/ecosystem.md); verifiers itself runs
it too (``vf-eval digit_sum`` with this folder on PYTHONPATH).

The 100 pairs (a, b) are split once, with a fixed seed, into 70 ``train`` and 30 ``test`` rows, so
the test rows are held out. The prompt is ``"a+b="``; the reward ``correct`` is 1.0 when the
harness's last reply is the sum, and the metric ``number`` says whether it was a number at all.
"""

import random

import verifiers.v1 as vf

TRAIN_PAIRS = 70


class SumData(vf.TaskData):
    answer: str
    """The sum, as text."""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def number(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip().isdigit())


class SumConfig(vf.TasksetConfig):
    split: str = "train"
    """``train`` (70 pairs) or ``test`` (the other 30)."""


class DigitSumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        if self.config.split not in ("train", "test"):
            raise ValueError(f"digit_sum: split must be 'train' or 'test', got {self.config.split!r}")
        pairs = [(a, b) for a in range(10) for b in range(10)]
        random.Random(0).shuffle(pairs)
        chosen = pairs[:TRAIN_PAIRS] if self.config.split == "train" else pairs[TRAIN_PAIRS:]
        for a, b in chosen:
            data = SumData(id=f"sum-{a}-{b}", prompt=f"{a}+{b}=", answer=str(a + b))
            yield SumTask(data, self.config.task)


__all__ = ["DigitSumTaskset"]
