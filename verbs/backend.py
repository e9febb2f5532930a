"""What a backend is: the one object each backend package exports as ``BACKEND``.

The registry (:mod:`rdmashim.registry`) imports a backend's package by name
and hands out its :class:`Backend`; :func:`rdmashim.open_device` and the CM's
event channels use nothing else of the backend. Adding a backend is a package
that exports ``BACKEND`` and one line in the registry.
"""

from __future__ import annotations

import errno
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol, TypeVar

from rdmashim.verbs.errors import VerbsError

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost, Connector
    from rdmashim.verbs.abc import Context, Device


class Backend(Protocol):
    """A backend: its devices, opening them, its rdma_cm, and whether it works here."""

    @property
    def name(self) -> str:
        """The name ``backend=`` and ``RDMASHIM_BACKEND`` take."""

    @property
    def description(self) -> str:
        """What it is, in a few words (``rdmashim devices`` shows it)."""

    @property
    def transport_options(self) -> frozenset[str]:
        """The :class:`~rdmashim.cm.types.TransportOptions` fields it honours; it refuses
        other non-default values with ``NotSupported``."""

    def get_device_list(self) -> list[Device]:
        """Its devices on this machine ([] if none)."""

    def open_device(self, name: str | None = None) -> AbstractAsyncContextManager[Context]:
        """Open device ``name`` (its default if None) for the ``async with`` block."""

    def cm_connector(self, channel: ChannelHost) -> Connector:
        """Its rdma_cm for the event channel ``channel`` (raises BackendUnavailable if it
        cannot offer one here)."""

    def unavailable_reason(self) -> str | None:
        """None if a device can be opened here, else why not (libraries, devices)."""


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


__all__ = ["Backend", "own"]
