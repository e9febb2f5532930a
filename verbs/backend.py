"""What a backend is, and which one a call uses: the ``Backend`` protocol and the registry.

Each backend package exports one :class:`Backend` as ``BACKEND``. The registry
(:data:`BACKENDS`) names the packages and imports one on first use, by name, so
this module, at the bottom of the layers, names no backend module it imports:
both :func:`rdmashim.open_device` and the CM's event channels pick their
backend here (``backend=``, else ``RDMASHIM_BACKEND``, else softiwarp). The CM
part of a backend (its connector, the transport options it honours) is
:class:`rdmashim.cm.abc.CMBackend`, since the verbs know nothing of connection
management. :mod:`rdmashim.registry` re-exports the registry for users. Adding
a backend is a package that exports ``BACKEND`` and one line in
:data:`BACKENDS`.
"""

from __future__ import annotations

import errno
import importlib
import os
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from rdmashim.verbs.errors import BackendUnavailable, VerbsError

if TYPE_CHECKING:
    from rdmashim.verbs.abc import Context, Device


class Backend(Protocol):
    """A backend: its devices, opening them, and whether it works here."""

    @property
    def name(self) -> str:
        """The name ``backend=`` and ``RDMASHIM_BACKEND`` take."""

    @property
    def description(self) -> str:
        """What it is, in a few words (``rdmashim devices`` shows it)."""

    def get_device_list(self) -> list[Device]:
        """Its devices on this machine ([] if none)."""

    def open_device(self, name: str | None = None) -> AbstractAsyncContextManager[Context]:
        """Open device ``name`` (its default if None) for the ``async with`` block."""

    def unavailable_reason(self) -> str | None:
        """None if a device can be opened here, else why not (libraries, devices)."""


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
        BackendInfo("softiwarp", "rdmashim.providers.softiwarp"),
        BackendInfo("rdmacore", "rdmashim.providers.rdmacore"),
        BackendInfo("ibal", "rdmashim.providers.ibal"),
    )
}
"""Every backend by name: the package imported when it is first loaded."""


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


_T = TypeVar("_T")


def own(obj: object, kind: type[_T], operation: str) -> _T:
    """``obj`` as this backend's ``kind``; EINVAL if it is another backend's object.

    Backends take the portable protocol types (``create_qp(send_cq=...)``) and
    narrow them with this before using their own internals.
    """
    if not isinstance(obj, kind):
        raise VerbsError(
            errno.EINVAL,
            operation,
            f"{type(obj).__name__} is not a {kind.__name__} of this backend",
        )
    return obj


__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "ENV_VAR",
    "Backend",
    "BackendInfo",
    "backend_status",
    "chosen_backend",
    "load_backend",
    "own",
]
