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
    "rdmacore": BackendInfo(
        "rdmacore", "rdmashim.verbs.rdmacore", "Linux rdma-core (libibverbs + librdmacm) via cffi"
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
    """Every backend with None if usable here, else the reason it is not; never raises.

    A backend module may define ``unavailable_reason() -> str | None`` for what
    importing it cannot tell (libraries missing, no device).
    """
    out: list[tuple[BackendInfo, str | None]] = []
    for info in BACKENDS.values():
        try:
            module = load_backend(info.name)
            probe = getattr(module, "unavailable_reason", None)
            reason = probe() if probe is not None else None
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
        out.append((info, reason))
    return out


Loader = Callable[[str | None], ModuleType]
