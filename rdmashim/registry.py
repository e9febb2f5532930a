"""Backends by name, chosen by ``backend=`` or ``RDMASHIM_BACKEND``; the default is softiwarp.

Each entry names the package that implements a backend; the package is
imported on first use and exports its :class:`~rdmashim.verbs.backend.Backend`
as ``BACKEND``. Adding a backend is one line here plus its package.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

from rdmashim.verbs.backend import Backend
from rdmashim.verbs.errors import BackendUnavailable

DEFAULT_BACKEND = "softiwarp"
ENV_VAR = "RDMASHIM_BACKEND"


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """A registered backend: its name and the package that implements it."""

    name: str
    module: str


BACKENDS: dict[str, BackendInfo] = {
    info.name: info
    for info in (
        BackendInfo("softiwarp", "rdmashim.verbs.softiwarp"),
        BackendInfo("rdmacore", "rdmashim.verbs.rdmacore"),
        BackendInfo("ibal", "rdmashim.verbs.ibal"),
    )
}


def chosen_backend(backend: str | None = None) -> str:
    """The backend name a call uses: the argument, else ``RDMASHIM_BACKEND``, else softiwarp."""
    return backend or os.environ.get(ENV_VAR) or DEFAULT_BACKEND


def load_backend(backend: str | None = None) -> Backend:
    """The chosen backend, its package imported; :class:`BackendUnavailable` says why not."""
    name = chosen_backend(backend)
    info = BACKENDS.get(name)
    if info is None:
        known = ", ".join(sorted(BACKENDS))
        raise BackendUnavailable(f"unknown rdmashim backend {name!r} (known: {known})")
    found: Backend = importlib.import_module(info.module).BACKEND
    return found


def backend_status() -> list[tuple[BackendInfo, str | None]]:
    """Every backend with None if usable here, else the reason it is not; never raises."""
    out: list[tuple[BackendInfo, str | None]] = []
    for info in BACKENDS.values():
        try:
            reason = load_backend(info.name).unavailable_reason()
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
        out.append((info, reason))
    return out
