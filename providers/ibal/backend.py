"""IBAL as a :class:`~rdmashim.cm.abc.CMBackend` (``BACKEND``): the portable API over
the IBAL facade, as WinOF's libibverbs and librdmacm ran over IBAL.

Its devices are the CAs of the HCA backend it sits on (``RDMASHIM_IBAL_HCA``,
default softiwarp), named ``ibal_<HCA device>``: the verbs objects are in
:mod:`.port_device` and :mod:`.port_queues`, rdma_cm in :mod:`.port_cm`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from rdmashim.providers.ibal import port_device
from rdmashim.providers.ibal.port_cm import Connector
from rdmashim.verbs.backend import load_backend

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost, CMBackend
    from rdmashim.verbs import abc


class IbalBackend:
    """The portable verbs and rdma_cm over ``ib_*`` calls on the HCA backend's CAs."""

    name = port_device.BACKEND_NAME
    description = "portable API over the IBAL facade (WinOF's access layer)"
    transport_options: frozenset[str] = frozenset()
    """None: IBAL's CM has no MPA knobs (non-default options are NotSupported)."""

    def get_device_list(self) -> list[abc.Device]:
        """One device per CA of the HCA backend (``ibal_siw_lo`` ...)."""
        return [*port_device.get_device_list()]

    def open_device(self, name: str | None = None) -> AbstractAsyncContextManager[abc.Context]:
        """``ib_open_al`` on the HCA backend and ``ib_open_ca`` for the block."""
        return port_device.open_device(name)

    def cm_connector(self, channel: ChannelHost) -> Connector:
        """rdma_cm over ``ib_cm_*`` for ``channel``."""
        return Connector(channel)

    def unavailable_reason(self) -> str | None:
        """The HCA backend's (IBAL needs nothing else)."""
        try:
            hca = port_device.hca_backend()
            return load_backend(hca).unavailable_reason()
        except Exception as exc:
            return str(exc) or type(exc).__name__


BACKEND: CMBackend = IbalBackend()
