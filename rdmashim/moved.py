"""The old import names of the backends, kept working with a warning.

The backends lived inside the portable verbs package (``rdmashim.verbs.softiwarp``,
``rdmashim.verbs.rdmacore``, ``rdmashim.verbs.ibal``); they are now
``rdmashim.providers.<name>``, apart from the portable API. An import of an old
name (or of a module under it) gives the module of the new name, the same object,
with a :class:`DeprecationWarning` that says the new name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

OLD = "rdmashim.verbs."
NEW = "rdmashim.providers."
MOVED = ("softiwarp", "rdmacore", "ibal")


def new_name(name: str) -> str | None:
    """The name ``name`` has now, or None when it did not move."""
    if not name.startswith(OLD):
        return None
    rest = name[len(OLD) :]
    return NEW + rest if rest.split(".", 1)[0] in MOVED else None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The module ran under its new name already."""


class MovedBackends(importlib.abc.MetaPathFinder):
    """Finds an old backend name and hands out the module of its new one."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec whose loader gives the moved module, for an old name; else None."""
        moved = new_name(fullname)
        if moved is None:
            return None
        warnings.warn(
            f"{fullname} is now {moved} (the backends moved out of rdmashim.verbs)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.machinery.ModuleSpec(fullname, _Alias(moved))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once."""
    if not any(isinstance(f, MovedBackends) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedBackends())  # before the path finder: no second copy
