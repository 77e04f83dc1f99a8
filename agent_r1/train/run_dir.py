"""The run directory (the layout below, documented in docs/training.md; the report and viewer read it).

```
RUN_DIR/
  config.yaml                      the resolved config
  metrics.jsonl                    {"step": int, "time": unix_seconds, <flat metric keys>} per line
  tb/                              TensorBoard event files
  trajectories/step_000001.jsonl   that step's Trajectory records (agent_r1.types.write_jsonl)
  checkpoints/step_000010/         atomic checkpoints, the last k kept (agent_r1.train.checkpoint)
```

On resume from step s, rows and dumps of later steps (written after that checkpoint by the killed run)
are removed first, so the directory reads as if the run had never stopped.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent_r1.train.config import TrainConfig, config_to_dict, dump_config
from agent_r1.types import Trajectory, write_jsonl

__all__ = ["RunDir"]


def _json_value(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x


class RunDir:
    def __init__(self, path: str | Path, config: TrainConfig, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.config = config
        self.path.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.path / "checkpoints"
        self.trajectories = self.path / "trajectories"
        self.metrics_file = self.path / "metrics.jsonl"
        if resume_step is not None:
            self._forget_after(resume_step)
        else:
            self.metrics_file.unlink(missing_ok=True)
            for old in self.trajectories.glob("step_*.jsonl"):
                old.unlink()
        dump_config(config, self.path / "config.yaml")
        self.tb = None
        if config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(str(self.path / "tb"), purge_step=purge)
        self.wandb = None
        if config.logging.wandb_project:
            self.wandb = self._start_wandb(resume=resume_step is not None)

    def _start_wandb(self, *, resume: bool):
        try:
            import wandb
        except ImportError:
            print("logging.wandb_project is set but wandb is not installed; W&B logging is off")
            return None
        return wandb.init(
            project=self.config.logging.wandb_project,
            name=self.config.logging.wandb_name,
            config=config_to_dict(self.config),
            dir=str(self.path),
            resume="allow" if resume else None,
        )

    def _forget_after(self, step: int) -> None:
        if self.metrics_file.exists():
            kept = [
                line
                for line in self.metrics_file.read_text(encoding="utf-8").splitlines()
                if line.strip() and _row_step(line) <= step
            ]
            self.metrics_file.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        for dump in self.trajectories.glob("step_*.jsonl"):
            if int(dump.stem.split("_")[1]) > step:
                dump.unlink()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, "time": time.time(), **{k: _json_value(v) for k, v in metrics.items()}}
        with open(self.metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)

    def dump_trajectories(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        self.trajectories.mkdir(exist_ok=True)
        target = self.trajectories / f"step_{step:06d}.jsonl"
        target.unlink(missing_ok=True)
        write_jsonl(target, trajectories)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _row_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line from a killed run: drop it
