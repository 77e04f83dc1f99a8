"""The training progress bar (``logging.progress``): steps done, reward, success, speed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

__all__ = ["progress_bar"]

Advance = Callable[[int, Mapping[str, float]], None]


@contextmanager
def progress_bar(total: int, start: int, enabled: bool = True) -> Iterator[Advance]:
    """Yields ``advance(step, metrics)``, which moves a rich progress bar to ``step`` and shows the
    step's reward, success, tokens per second and seconds per step (a no-op when not ``enabled``)."""
    if not enabled:
        yield lambda step, metrics: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn(
            "reward {task.fields[reward]}  success {task.fields[success]}  "
            "{task.fields[tps]} tok/s  {task.fields[sps]} s/step"
        ),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as progress:
        task = progress.add_task(
            "train", total=total, completed=start, reward="-", success="-", tps="-", sps="-"
        )

        def advance(step: int, metrics: Mapping[str, float]) -> None:
            progress.update(
                task,
                completed=step,
                reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                success=f"{metrics.get('success/mean', float('nan')):.2f}",
                tps=f"{metrics.get('throughput/tokens_per_s', 0.0):.0f}",
                sps=f"{metrics.get('time/step', 0.0):.2f}",
            )

        yield advance
