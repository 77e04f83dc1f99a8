"""Adapters that make environments written for other libraries into agent-r1 ``AgentEnv`` s
(docs/ecosystem.md). Each adapter imports its library only when an env is made, through
``require``, so a missing package is one error naming the extra that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingPackageError", "require"]


class MissingPackageError(ImportError):
    """An adapter's package is not installed; the message names the extra to install."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """``import module``, or raise ``MissingPackageError`` saying that ``what`` needs
    ``pip install 'agent-r1[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name is not None and error.name != module and not module.startswith(f"{error.name}."):
            raise  # the package is there but one of its own imports failed: show that error as is
        raise MissingPackageError(
            f"{what} needs the {module.split('.')[0]!r} package: pip install 'agent-r1[{extra}]'"
        ) from error
