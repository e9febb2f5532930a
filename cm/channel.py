"""The event channel: where CM events arrive, and the nursery CM work runs in.

``async with EventChannel() as channel`` (``rdma_create_event_channel``)
owns a nursery for address resolution, listeners and connection setup, and
keeps the device contexts its ids use open while it lives. Events arrive in
order through ``await channel.get_event()`` or ``async for event in channel``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from types import TracebackType
from typing import Any

import trio

import rdmashim
from rdmashim.cm.types import CMEvent, PortSpace
from rdmashim.registry import chosen_backend
from rdmashim.verbs.tasks import service_nursery

log = logging.getLogger(__name__)


class EventChannel:
    """An rdma_cm event channel (see the module docstring).

    ``contexts`` are already opened device contexts (``rdmashim.open_device``)
    the channel's ids use instead of opening their own. The backend
    (``backend=``, else the contexts', else ``RDMASHIM_BACKEND``) picks the ids: the built-in
    engine's (:mod:`rdmashim.cm.cmid`) or librdmacm's
    (:mod:`rdmashim.cm.rdmacore_id`, whose events a task reads from the
    librdmacm channel's fd).
    """

    def __init__(self, contexts: Iterable[Any] = (), *, backend: str | None = None) -> None:
        self._contexts: dict[str, Any] = {ctx.device.name: ctx for ctx in contexts}
        given = next((ctx.backend for ctx in self._contexts.values()), None)
        self.backend = chosen_backend(backend or given)
        self._send, self._recv = trio.open_memory_channel[CMEvent](1 << 16)
        self._nursery_manager: Any = None
        self.nursery: trio.Nursery | None = None
        self.unacked = 0
        self._ids: list[Any] = []
        self._closed = False
        self._native: Any = None

    async def __aenter__(self) -> EventChannel:
        if self.backend == "rdmacore":
            from rdmashim.cm.rdmacore_id import NativeChannel

            self._native = NativeChannel(self)
        self._nursery_manager = service_nursery()
        self.nursery = await self._nursery_manager.__aenter__()
        if self._native is not None:
            self.nursery.start_soon(self._native.run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._closed = True
        for cm_id in list(self._ids):
            cm_id.destroy()
        self._send.close()
        try:
            return await self._nursery_manager.__aexit__(exc_type, exc, tb)
        finally:
            if self._native is not None:
                self._native.close()

    # ------------------------------------------------------------------ ids
    def create_id(self, context: Any = None, ps: PortSpace = PortSpace.TCP) -> Any:
        """A new CM id in port space ``ps`` (``rdma_create_id``); ``context`` is yours."""
        self._check_open()
        if self._native is not None:
            cm_id = self._native.create_id(ps, context)
        else:
            from rdmashim.cm.cmid import CMId

            cm_id = CMId(self, ps, context)
        self._ids.append(cm_id)
        return cm_id

    def _forget(self, cm_id: Any) -> None:
        if cm_id in self._ids:
            self._ids.remove(cm_id)

    # ------------------------------------------------------------------ devices
    async def device_context(self, name: str) -> Any:
        """The opened context of device ``name``, opening it in this channel if needed."""
        ctx = self._contexts.get(name)
        if ctx is None:
            assert self.nursery is not None
            ctx = await self.nursery.start(self._keep_device, name)
        return ctx

    async def _keep_device(self, name: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with rdmashim.open_device(name, backend=self.backend) as ctx:
            self._contexts[name] = ctx
            task_status.started(ctx)
            try:
                await trio.sleep_forever()
            finally:
                self._contexts.pop(name, None)

    # ------------------------------------------------------------------ events
    def _post(self, event: CMEvent) -> None:
        if self._closed:
            return
        log.debug("cm event %s", event)
        self.unacked += 1
        self._send.send_nowait(event)

    def _ack(self, event: CMEvent) -> None:
        self.unacked -= 1

    async def get_event(self) -> CMEvent:
        """Wait for the next event (``rdma_get_cm_event``); acknowledge it with ``ack()``."""
        self._check_open()
        return await self._recv.receive()

    def get_event_nowait(self) -> CMEvent:
        """The next event if one is waiting; raises ``trio.WouldBlock`` otherwise."""
        return self._recv.receive_nowait()

    def __aiter__(self) -> AsyncIterator[CMEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CMEvent]:
        while True:
            try:
                yield await self.get_event()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return

    def _check_open(self) -> None:
        if self._closed or self.nursery is None:
            raise trio.ClosedResourceError("event channel is not open (use `async with`)")
