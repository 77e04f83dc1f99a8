"""Registries of plain functions selected by name (one per concept, owned by its module).

Adding an estimator or a loss is one function and one decorator, which also declares what it needs::

    @register_advantage("my_estimator", critic="step")
    def my_estimator(table: StepTable, cfg: AdvantageConfig) -> AdvantageOutput: ...

It is then available everywhere by name (``algorithm.advantage: my_estimator``), and the config
validation, the trainer and the Ray learner read its ``Needs`` (here: a step-level critic) instead of
checking names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

__all__ = ["InvalidOption", "Needs", "Registry"]

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Needs:
    """What a registered function needs from the trainer, declared at registration.

    critic: the value model an advantage estimator reads: "token" (``StepTable.token_values``, V before
        every response token), "step" (``StepTable.step_values``, V of each step's start state), or
        None. The trainer builds and trains a critic exactly when the estimator declares one.
    min_group_size: the samples per task (``rollout.n``) a group baseline needs to be nonzero.
    single_update: the loss is correct only on-policy, i.e. with one optimizer step per rollout batch
        (``trainer.ppo_epochs`` x ``trainer.mini_batches`` = 1), like REINFORCE without a ratio.
    role_baseline: the estimator reads ``StepTable.baseline``, a running mean of each role's returns
        that the trainer keeps from step to step and saves in checkpoints (``rae``;
        ``agent_r1.train.role_baseline``).
    """

    critic: Literal["token", "step"] | None = None
    min_group_size: int = 1
    single_update: bool = False
    role_baseline: bool = False


class InvalidOption(ValueError):
    """An options dataclass of ``agent_r1.algos`` refused a value: ``field`` and why (the config names
    the dotted key from it)."""

    def __init__(self, owner: str, field: str, why: str) -> None:
        super().__init__(f"{owner}.{field} {why}")
        self.field = field
        self.why = why


class Registry(Mapping[str, F], Generic[F]):
    """Name -> function, with each entry's ``Needs``; ``kind`` names the concept in error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._functions: dict[str, F] = {}
        self._needs: dict[str, Needs] = {}

    def register(
        self,
        name: str,
        *,
        critic: Literal["token", "step"] | None = None,
        min_group_size: int = 1,
        single_update: bool = False,
        role_baseline: bool = False,
    ) -> Callable[[F], F]:
        """A decorator registering ``fn`` as ``name`` with its needs; a duplicate name is a ValueError."""
        needs = Needs(critic, min_group_size, single_update, role_baseline)

        def decorate(fn: F) -> F:
            if name in self._functions:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._functions[name].__qualname__})"
                )
            self._functions[name] = fn
            self._needs[name] = needs
            return fn

        return decorate

    def lookup(self, name: str) -> F:
        """The function registered as ``name``, or a ValueError that names the available choices."""
        self._check(name)
        return self._functions[name]

    def needs(self, name: str) -> Needs:
        self._check(name)
        return self._needs[name]

    def _check(self, name: str) -> None:
        if name not in self._functions:
            raise ValueError(f"unknown {self.kind} {name!r}; available: {', '.join(sorted(self))}")

    def __getitem__(self, name: str) -> F:
        return self._functions[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._functions)

    def __len__(self) -> int:
        return len(self._functions)
