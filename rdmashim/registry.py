"""Backends by name, chosen by ``backend=`` or ``RDMASHIM_BACKEND``; the default is softiwarp."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from rdmashim.verbs.errors import BackendUnavailable

DEFAULT_BACKEND = "softiwarp"
ENV_VAR = "RDMASHIM_BACKEND"


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """A registered backend: its name, the module that implements it, what it is."""

    name: str
    module: str
    description: str


BACKENDS: dict[str, BackendInfo] = {
    "softiwarp": BackendInfo(
        "softiwarp", "rdmashim.verbs.softiwarp", "built-in iWARP engine over TCP (pure Python)"
    ),
}


def chosen_backend(backend: str | None = None) -> str:
    """The backend name a call uses: the argument, else ``RDMASHIM_BACKEND``, else softiwarp."""
    return backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND


def load_backend(backend: str | None = None) -> ModuleType:
    """Import a backend's module, or raise :class:`BackendUnavailable` saying why not."""
    name = chosen_backend(backend)
    info = BACKENDS.get(name)
    if info is None:
        known = ", ".join(sorted(BACKENDS))
        raise BackendUnavailable(f"unknown rdmashim backend {name!r} (known: {known})")
    return importlib.import_module(info.module)


def backend_status() -> list[tuple[BackendInfo, str | None]]:
    """Every backend with None if usable here, else the reason it is not."""
    out: list[tuple[BackendInfo, str | None]] = []
    for info in BACKENDS.values():
        try:
            load_backend(info.name)
        except BackendUnavailable as exc:
            out.append((info, str(exc)))
        else:
            out.append((info, None))
    return out


Loader = Callable[[str | None], ModuleType]
