"""The built-in engine as a :class:`~rdmashim.cm.abc.CMBackend` (``BACKEND``)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import fields
from typing import TYPE_CHECKING

from rdmashim.cm.types import TransportOptions
from rdmashim.providers.softiwarp import engines, fastpath, provider
from rdmashim.providers.softiwarp.cm_id import Connector

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost, CMBackend
    from rdmashim.verbs import abc


class SoftiwarpBackend:
    """One device per network interface; MPA over TCP by the engine itself."""

    name = provider.BACKEND_NAME

    @property
    def description(self) -> str:
        """What runs: the engine a device opened now gets, and the Python engine's kernels."""
        return (
            f"built-in iWARP engine over TCP (engine: {engines.describe()}; "
            f"compiled kernels: {fastpath.describe()})"
        )

    transport_options = frozenset(f.name for f in fields(TransportOptions))
    """Every portable transport option: the engine negotiates MPA itself."""

    def get_device_list(self) -> list[abc.Device]:
        """One device per local network interface."""
        return [*provider.get_device_list()]

    def open_device(self, name: str | None = None) -> AbstractAsyncContextManager[abc.Context]:
        """Open a device (``siw_lo`` if ``name`` is None); its QPs run in its nursery."""
        return engines.open_device(name)

    def cm_connector(self, channel: ChannelHost) -> Connector:
        """The engine's rdma_cm for ``channel``."""
        return Connector(channel)

    def unavailable_reason(self) -> str | None:
        """Always None: the engine needs nothing but TCP."""
        return None


BACKEND: CMBackend = SoftiwarpBackend()
