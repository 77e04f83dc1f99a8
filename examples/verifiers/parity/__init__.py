"""A verifiers v1 taskset, written in verifiers' own format (it imports only verifiers): is a
three-digit number even? agent-r1 trains it through its verifiers env (docs/ecosystem.md);
verifiers itself runs it too (``vf-eval parity`` with this folder on PYTHONPATH).

The 1000 numbers "000".."999" are split once, with a fixed seed, into 800 ``train`` and 200 ``test``
rows, so the test rows are held out. The prompt is ``"is 381 even?"``; the reward ``correct`` is 1.0
when the harness's last reply is the answer (``"no"``), and the metric ``yes_no`` says whether the
reply was ``yes`` or ``no`` at all. Why so simple: agent-r1 checks its adapters with a ~1M-parameter
model warm-started on a CPU in a minute; the answer depends on one digit a few tokens back, which such
a model learns (copying digits takes it far longer).
"""

import random

import verifiers.v1 as vf

TRAIN_ROWS = 800


class ParityData(vf.TaskData):
    answer: str
    """``yes`` or ``no``."""


class ParityTask(vf.Task[ParityData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def yes_no(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() in ("yes", "no"))


class ParityConfig(vf.TasksetConfig):
    split: str = "train"
    """``train`` (800 rows) or ``test`` (the other 200)."""


class ParityTaskset(vf.Taskset[ParityTask, ParityConfig]):
    def load(self):
        if self.config.split not in ("train", "test"):
            raise ValueError(f"parity: split must be 'train' or 'test', got {self.config.split!r}")
        numbers = [f"{n:03d}" for n in range(1000)]
        random.Random(0).shuffle(numbers)
        chosen = numbers[:TRAIN_ROWS] if self.config.split == "train" else numbers[TRAIN_ROWS:]
        for number in chosen:
            answer = "yes" if int(number) % 2 == 0 else "no"
            yield ParityTask(
                ParityData(id=f"parity-{number}", prompt=f"is {number} even?", answer=answer),
                self.config.task,
            )


__all__ = ["ParityTaskset"]
