"""Tasks for training and evaluation: parquet, JSONL / JSON and Hugging Face ``datasets`` inputs.

``load_tasks`` returns a list of plain dicts (one per row) and checks the fields the environment needs:
a row without one is an error naming the source, the row and the field. ``TaskSampler`` picks each
step's tasks as a pure function of (seed, step), so a resumed run sees exactly the data order of an
uninterrupted one without saving any sampler state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "DataError",
    "TaskSampler",
    "check_fields",
    "check_known_fields",
    "config_tasks",
    "env_required_fields",
    "env_task_fields",
    "load_tasks",
]


class DataError(ValueError):
    """A problem with a dataset, naming the source and the row."""


def load_tasks(
    source: str | Path | Iterable[Mapping[str, Any]] | Any,
    *,
    split: str = "train",
    required_fields: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Read tasks from ``source``:

    - a ``.parquet`` file, a ``.jsonl`` file (one object per line) or a ``.json`` file (a list);
    - a folder written by ``datasets.Dataset.save_to_disk`` (``split`` picks from a DatasetDict);
    - a Hugging Face ``datasets.Dataset`` / ``DatasetDict`` object or a list of dicts;
    - otherwise a Hugging Face dataset name, read with ``datasets.load_dataset(name, split=split)``.
    """
    name = str(source) if isinstance(source, (str, Path)) else type(source).__name__
    if isinstance(source, (str, Path)):
        rows = _read_path(str(source), split)
    else:
        rows = _read_object(source, split, name)
    tasks = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"{name}: row {i} is a {type(row).__name__}, not a mapping of fields")
        tasks.append(dict(row))
    check_fields(tasks, required_fields, name)
    return tasks


def check_fields(
    tasks: Sequence[Mapping[str, Any]], required: Sequence[str], source: str, *, needed_by: str = ""
) -> None:
    """Raise ``DataError`` naming the first row that lacks a required field (``needed_by``: who
    declares the fields, for the message)."""
    for i, task in enumerate(tasks):
        for key in required:
            if key not in task or task[key] is None:
                ident = f" (id {task['id']!r})" if "id" in task else ""
                raise DataError(
                    f"{source}: row {i}{ident} has no field {key!r}, which the environment needs"
                    f"{needed_by}; the row has fields {sorted(task)}"
                )


def check_known_fields(
    tasks: Sequence[Mapping[str, Any]], known: Sequence[str], source: str, env: str
) -> None:
    """Raise ``DataError`` naming the first row with a field outside ``known`` (the env's
    ``task_fields``), the field and the closest known one."""
    from agent_r1.envs.base import unknown_fields_message

    for i, task in enumerate(tasks):
        refused = unknown_fields_message(task, known, env)
        if refused:
            ident = f" (id {task['id']!r})" if "id" in task else ""
            raise DataError(f"{source}: row {i}{ident}: {refused}")


def _env_declared(config, attribute: str, default: Any) -> Any:
    """What ``env.name``'s factory declares as ``attribute`` (a value, or a function of
    ``env.kwargs``); ``default`` for an env that cannot be resolved: building it reports the error."""
    name = config.env.name
    if not name:
        return default
    from agent_r1.envs.registry import get_env_factory

    try:
        declared = getattr(get_env_factory(name), attribute, default)
        if callable(declared):
            declared = declared(**{k: v for k, v in config.env.kwargs.items() if k != "tokenizer"})
    except (ValueError, TypeError):
        return default
    return declared


def env_required_fields(config) -> tuple[str, ...]:
    """The row fields that ``env.name``'s factory declares it needs (its ``required_fields``: a tuple,
    or a function of ``env.kwargs`` when they depend on them, as for ``agent_r1.tasks.prepare:task_env``)."""
    return tuple(_env_declared(config, "required_fields", ()))


def env_task_fields(config) -> tuple[str, ...] | None:
    """Every row field ``env.name``'s factory declares it reads (its ``task_fields``); None: rows
    are free-form."""
    declared = _env_declared(config, "task_fields", None)
    return None if declared is None else tuple(declared)


def _read_path(path: str, split: str) -> list[Any]:
    p = Path(path)
    if p.suffix in (".parquet", ".jsonl", ".json") and not p.is_file():
        raise DataError(f"{path}: no such file")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix == ".jsonl":
        rows = []
        with open(p, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
        return rows
    if p.suffix == ".json":
        rows = json.loads(p.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json task file must hold a list of objects")
        return rows
    if p.is_dir():
        import datasets

        return _read_object(datasets.load_from_disk(str(p)), split, path)
    if p.suffix:
        raise DataError(f"{path}: no such file, or unsupported extension (use .parquet, .jsonl or .json)")
    import datasets

    try:
        return list(datasets.load_dataset(path, split=split))
    except OSError as error:  # no such hub dataset, or the hub is unreachable (offline)
        raise DataError(
            f"{path}: not a local file or folder, and not loadable as a Hugging Face dataset "
            f"({type(error).__name__}: {error})"
        ) from None


def _read_object(source: Any, split: str, name: str) -> list[Any]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is a dependency
        datasets = None
    if datasets is not None and isinstance(source, datasets.DatasetDict):
        if split not in source:
            raise DataError(f"{name}: no split {split!r}; available: {sorted(source)}")
        source = source[split]
    if datasets is not None and isinstance(source, datasets.Dataset):
        return source.to_list()
    return list(source)


class TaskSampler:
    """Each step's ``batch_size`` tasks: epochs over a seeded permutation, a pure function of the step.

    Task number ``i`` (counting from step 0) comes from epoch ``i // len(tasks)``, whose order is a
    permutation seeded by ``(seed, epoch)`` (or the file order when ``shuffle`` is off).
    """

    def __init__(
        self, tasks: Sequence[Mapping[str, Any]], batch_size: int, *, seed: int = 0, shuffle: bool = True
    ):
        if not tasks:
            raise DataError("no training tasks")
        self.tasks = list(tasks)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.tasks)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def batch(self, step: int) -> list[Mapping[str, Any]]:
        """The tasks of training step ``step`` (1-based)."""
        first = (step - 1) * self.batch_size
        out = []
        for i in range(first, first + self.batch_size):
            epoch, index = divmod(i, len(self.tasks))
            out.append(self.tasks[self._order(epoch)[index]])
        return out

    def extra(self, step: int, round: int, k: int) -> list[Mapping[str, Any]]:
        """``k`` more tasks for step ``step``'s resampling round ``round`` (DAPO over-sampling): drawn
        without replacement by a generator seeded with (seed, step, round), so a resumed run draws the
        same ones."""
        picks = random.Random(f"{self.seed}:extra:{step}:{round}").sample(
            range(len(self.tasks)), min(k, len(self.tasks))
        )
        return [self.tasks[i] for i in picks]


def config_tasks(config, given: Any, key: str) -> list[dict]:
    """The tasks of ``key`` (``data.train`` or ``data.val``) of a ``TrainConfig``: ``given`` (a list of
    task dicts, or any ``load_tasks`` source) or else the configured source, with
    ``data.required_fields`` and the fields the env declares (``env_required_fields``) checked; the
    validation tasks cut to ``data.max_val_tasks``. A data
    error names the key."""
    from agent_r1.train.config import ConfigError

    data = config.data
    split, source = (data.split, data.train) if key == "data.train" else (data.val_split, data.val)
    if isinstance(given, (list, tuple)):
        tasks = [dict(t) for t in given]
        check_fields(tasks, data.required_fields, key)
    elif given is not None:
        tasks = load_tasks(given, split=split, required_fields=data.required_fields)
    elif not source:
        raise ConfigError(key, "no tasks: set it to a .parquet/.jsonl/.json file or dataset (or pass tasks)")
    else:
        try:
            tasks = load_tasks(source, split=split, required_fields=data.required_fields)
        except DataError as error:
            raise DataError(f"{key}: {error}") from None
    declared = [f for f in env_required_fields(config) if f not in data.required_fields]
    where = key if given is not None or not source else f"{key}: {source}"
    check_fields(tasks, declared, where, needed_by=f" (env {config.env.name!r} declares it)")
    known = env_task_fields(config)
    if known is not None:
        check_known_fields(tasks, known, where, config.env.name)
    if key == "data.val" and data.max_val_tasks:
        tasks = tasks[: data.max_val_tasks]
    return tasks
