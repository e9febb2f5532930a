"""rdma-core as a :class:`~rdmashim.cm.abc.CMBackend` (``BACKEND``)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from rdmashim.providers.rdmacore import device
from rdmashim.providers.rdmacore.cm_id import TRANSPORT_OPTIONS, NativeChannel

if TYPE_CHECKING:
    from rdmashim.cm.abc import ChannelHost, CMBackend
    from rdmashim.verbs import abc


class RdmaCoreBackend:
    """libibverbs' devices; librdmacm (and the kernel's rdma_cm) connects."""

    name = device.BACKEND_NAME
    description = "Linux rdma-core (libibverbs + librdmacm) via cffi"
    transport_options = TRANSPORT_OPTIONS

    def get_device_list(self) -> list[abc.Device]:
        """The RDMA devices of this machine; [] if there are none."""
        return [*device.get_device_list()]

    def open_device(self, name: str | None = None) -> AbstractAsyncContextManager[abc.Context]:
        """Open a device (the first one if ``name`` is None)."""
        return device.open_device(name)

    def cm_connector(self, channel: ChannelHost) -> NativeChannel:
        """librdmacm's event channel for ``channel`` (BackendUnavailable without rdma_cm)."""
        return NativeChannel(channel)

    def unavailable_reason(self) -> str | None:
        """None if a device can be opened here, else why not (libraries missing, no device)."""
        return device.unavailable_reason()


BACKEND: CMBackend = RdmaCoreBackend()
