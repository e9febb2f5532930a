"""The event channel: where CM events arrive, and the nursery CM work runs in.

``async with EventChannel() as channel`` (``rdma_create_event_channel``)
owns a nursery for address resolution, listeners and connection setup, and
keeps the device contexts its ids use open while it lives. Events arrive in
order through ``await channel.get_event()`` or ``async for event in channel``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager
from types import TracebackType

import trio

from rdmashim.cm.abc import CMBackend, CMId, Connector
from rdmashim.cm.types import CMEvent, CMEventType, ConnParam, PortSpace
from rdmashim.verbs.abc import Context
from rdmashim.verbs.backend import chosen_backend, load_backend
from rdmashim.verbs.errors import BackendUnavailable
from rdmashim.verbs.tasks import leaves, service_nursery

log = logging.getLogger(__name__)


class EventChannel:
    """An rdma_cm event channel (see the module docstring).

    ``contexts`` are already opened device contexts (``rdmashim.open_device``)
    the channel's ids use instead of opening their own. The backend
    (``backend=``, else the contexts', else ``RDMASHIM_BACKEND``) makes the ids
    through its connector (:meth:`CMBackend.cm_connector
    <rdmashim.cm.abc.CMBackend.cm_connector>`), whose background work (the
    rdma-core backend reads librdmacm's events) runs in the channel's nursery.
    """

    def __init__(self, contexts: Iterable[Context] = (), *, backend: str | None = None) -> None:
        self._contexts: dict[str, Context] = {ctx.device.name: ctx for ctx in contexts}
        given = next((ctx.backend for ctx in self._contexts.values()), None)
        self.backend = chosen_backend(backend or given)
        """Name of the backend whose ids this channel makes."""
        self._send, self._recv = trio.open_memory_channel[CMEvent](1 << 16)
        self._nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None
        self.unacked = 0
        self._ids: list[CMId] = []
        self._closed = trio.Event()
        """Set when the channel closes (its devices close then: :meth:`_keep_device`)."""
        self._backend: CMBackend | None = None
        self._connector: Connector | None = None

    async def __aenter__(self) -> EventChannel:
        backend = load_backend(self.backend)
        if not isinstance(backend, CMBackend):
            raise BackendUnavailable(f"backend {self.backend!r} offers no rdma_cm")
        self._backend = backend
        connector = self._connector = backend.cm_connector(self)
        self._nursery_manager = service_nursery()
        self._nursery = await self._nursery_manager.__aenter__()
        self._nursery.start_soon(connector.run)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._closed.set()
        for cm_id in list(self._ids):
            cm_id.destroy()
        self._send.close()
        assert self._nursery_manager is not None and self._connector is not None
        try:
            return await self._nursery_manager.__aexit__(exc_type, exc, tb)
        except BaseException as closing:
            if _hides(closing, exc):
                # Cancelled from outside while the block failed, our tasks raised their
                # Cancelled over the block's error: let the block's error go on as it came.
                return False
            raise
        finally:
            self._connector.close()

    @property
    def nursery(self) -> trio.Nursery:
        """The channel's nursery, where CM work runs while the channel is open."""
        if self._nursery is None:
            raise trio.ClosedResourceError("event channel is not open (use `async with`)")
        return self._nursery

    # ------------------------------------------------------------------ ids
    def create_id(self, context: object = None, ps: PortSpace = PortSpace.TCP) -> CMId:
        """A new CM id in port space ``ps`` (``rdma_create_id``); ``context`` is yours."""
        self._check_open()
        assert self._connector is not None
        cm_id = self._connector.create_id(ps, context)
        self._ids.append(cm_id)
        return cm_id

    def adopt(self, cm_id: CMId) -> None:
        """Count an id the backend's connector made itself (an incoming connection)."""
        self._ids.append(cm_id)

    def forget(self, cm_id: CMId) -> None:
        """A destroyed id leaves the channel (its backend calls this)."""
        if cm_id in self._ids:
            self._ids.remove(cm_id)

    # ------------------------------------------------------------------ devices
    async def device_context(self, name: str) -> Context:
        """The opened context of device ``name``, opening it in this channel if needed."""
        ctx = self._contexts.get(name)
        if ctx is None:
            opened: Context = await self.nursery.start(self._keep_device, name)
            return opened
        return ctx

    async def _keep_device(
        self, name: str, *, task_status: trio.TaskStatus[Context] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Hold device ``name`` open until the channel closes.

        Shielded: a cancellation of the block the channel serves reaches this task
        and the block's own tasks at once, and those may still be tearing down
        connections on the device (a CQ polled before the task sees its
        cancellation); the device closes when the channel does, after the block.
        """
        assert self._backend is not None
        with trio.CancelScope(shield=True):
            async with self._backend.open_device(name) as ctx:
                self._contexts[name] = ctx
                task_status.started(ctx)
                try:
                    await self._closed.wait()
                finally:
                    self._contexts.pop(name, None)

    # ------------------------------------------------------------------ events
    def post(
        self,
        kind: CMEventType,
        cm_id: CMId,
        status: int = 0,
        *,
        private_data: bytes = b"",
        param: ConnParam | None = None,
        listen_id: CMId | None = None,
        detail: str = "",
    ) -> None:
        """Queue an event for the application (its backend calls this); none after close."""
        if self._closed.is_set():
            return
        event = CMEvent(kind, cm_id, status, private_data, param, listen_id, detail, channel=self)
        log.debug("cm event %s", event)
        self.unacked += 1
        self._send.send_nowait(event)

    def ack(self, event: CMEvent) -> None:
        """Acknowledge ``event`` (``rdma_ack_cm_event``; ``event.ack()`` calls this)."""
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
        if self._closed.is_set() or self._nursery is None:
            raise trio.ClosedResourceError("event channel is not open (use `async with`)")


def _hides(closing: BaseException, error: BaseException | None) -> bool:
    """Whether ``closing`` (what closing the channel's nursery raised) is nothing but
    cancellations standing in front of ``error``, a real error of the block."""
    if error is None or closing is error or _only_cancelled(error):
        return False
    return _only_cancelled(closing)


def _only_cancelled(exc: BaseException) -> bool:
    return all(isinstance(leaf, trio.Cancelled) for leaf in leaves(exc))
