"""One RPC-over-RDMA connection's queue pair, as both the requester and the responder drive it.

An :class:`Endpoint` owns the connection's Receive buffers (one slot of the
inline receive size per posted Receive), hands each received message to the
transport, and posts Sends, RDMA Reads and RDMA Writes whose completion a
task can wait for. One task (:meth:`Endpoint.run`) polls the completion
queue; a work completion with an error status ends the connection
(:class:`ConnectionLost`) and wakes every waiter with it.

:meth:`Endpoint.send` copies a small message into one of a set of Send
slots registered once (as many as Receives, made at the first use), so a
short call costs no registration; a slot is used again only after its Send
completed.

Work requests go out in batches of at most :data:`BATCH`, only the last of
each signaled: a send queue completes in order, so the last completion says
the whole batch is done (and, for RDMA Writes before a Send, placed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from rdmashim.verbs import Access, RecvWR, SendFlags, SendWR, WCOpcode, WCStatus, WROpcode

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.cm import Connection, ConnectionRequest
    from rdmashim.verbs.abc import MR
    from rdmashim.verbs.wr import WC

log = logging.getLogger(__name__)

BATCH = 16
"""Work requests posted before waiting for their completion."""
SEND_QUEUE_BATCHES = 6
"""Batches in flight at once (send queue depth / :data:`BATCH`, with room to spare)."""
REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE
"""What a requester grants on a buffer the responder writes (Write and Reply chunks)."""


class ConnectionLost(ConnectionError):
    """The connection's queue pair failed or was closed."""


class _Pending:
    __slots__ = ("done", "status")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.status = WCStatus.SUCCESS


class Endpoint:
    """Receives, Sends and RDMA operations of one connection (see the module doc)."""

    def __init__(
        self, conn: Connection | ConnectionRequest, recv_size: int, recv_count: int
    ) -> None:
        self.conn = conn
        self.qp = conn.qp
        self.pd = conn.pd
        self.recv_size = recv_size
        self.recv_count = recv_count
        self.recv_mr = self.pd.reg_mr(bytearray(recv_size * recv_count), Access.LOCAL_WRITE)
        self._pending: dict[int, _Pending] = {}
        self._next_wr = recv_count  # Receive wr_ids are slot numbers below this
        self._batches = trio.Semaphore(SEND_QUEUE_BATCHES)
        self.lost: ConnectionLost | None = None
        self._send_mr: MR | None = None
        self._send_free: list[int] = []
        self.qp.post_recv([self._recv_wr(slot) for slot in range(recv_count)])

    def _recv_wr(self, slot: int) -> RecvWR:
        return RecvWR(slot, [self.recv_mr.sge(slot * self.recv_size, self.recv_size)])

    def slot_view(self, slot: int, length: int) -> memoryview:
        """The first ``length`` received bytes of a Receive slot."""
        base = slot * self.recv_size
        return self.recv_mr.buf[base : base + length]

    def repost(self, slot: int) -> None:
        """Post a Receive slot again (its bytes were copied or are done with)."""
        if self.lost is None:
            self.qp.post_recv(self._recv_wr(slot))

    def register(self, buffer: Buffer, access: Access = Access.NONE) -> MR:
        """Register ``buffer`` on the connection's PD."""
        return self.pd.reg_mr(buffer, access)

    async def send(self, data: bytes) -> None:
        """Send ``data`` and wait until the Send completes (:class:`ConnectionLost` if not).

        From a pre-registered slot when one is free and ``data`` fits the
        inline size, else from a buffer registered for this Send alone.
        """
        if self._send_mr is None:
            self._send_mr = self.register(bytearray(self.recv_size * self.recv_count))
            self._send_free = list(range(self.recv_count))
        if len(data) > self.recv_size or not self._send_free:
            with self.register(bytearray(data)) as mr:
                await self.post([send_wr(mr, len(data))])
            return
        slot = self._send_free.pop()
        base = slot * self.recv_size
        self._send_mr.buf[base : base + len(data)] = data
        await self.post([SendWR(0, sg_list=[self._send_mr.sge(base, len(data))])])
        self._send_free.append(slot)  # not after a failure: the Send may still read it

    async def post(self, wrs: Sequence[SendWR]) -> None:
        """Post ``wrs`` (their wr_ids and flags are set here) and wait until all complete.

        Raises :class:`ConnectionLost` if any fails or the connection ends first.
        """
        for start in range(0, len(wrs), BATCH):
            async with self._batches:
                await self._post_batch(wrs[start : start + BATCH])

    async def _post_batch(self, wrs: Sequence[SendWR]) -> None:
        self._check()
        for wr in wrs:
            wr.wr_id = self._next_wr
            wr.send_flags &= ~SendFlags.SIGNALED
            self._next_wr += 1
        wrs[-1].send_flags |= SendFlags.SIGNALED
        pending = self._pending[wrs[-1].wr_id] = _Pending()
        try:
            self.qp.post_send(list(wrs))
        except OSError as exc:
            del self._pending[wrs[-1].wr_id]
            raise self._lose(f"posting failed: {exc}") from exc
        await pending.done.wait()
        if pending.status != WCStatus.SUCCESS:
            raise self.lost or ConnectionLost(pending.status.name)

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def _lose(self, why: str) -> ConnectionLost:
        if self.lost is None:
            self.lost = ConnectionLost(why)
            for pending in self._pending.values():
                pending.status = WCStatus.WR_FLUSH_ERR
                pending.done.set()
            self._pending.clear()
        return self.lost

    async def run(self, on_receive: Callable[[int, int, WC], None]) -> None:
        """Poll completions until the connection fails; ``on_receive(slot, length, wc)``
        for each received message (the slot stays the caller's until :meth:`repost`).

        Raises :class:`ConnectionLost`.
        """
        cq = self.conn.recv_cq
        if self.conn.send_cq is not cq:
            raise ValueError("an Endpoint needs one completion queue for sends and receives")
        try:
            while True:
                for wc in await cq.poll_wait(64):
                    self._complete(wc, on_receive)
        finally:
            self._lose("the connection closed")

    def _complete(self, wc: WC, on_receive: Callable[[int, int, WC], None]) -> None:
        if wc.status != WCStatus.SUCCESS:
            pending = self._pending.pop(wc.wr_id, None)
            if pending is not None:
                pending.status = wc.status
                pending.done.set()
            raise self._lose(f"work request {wc.wr_id} completed with {wc.status.name}")
        if wc.opcode == WCOpcode.RECV:
            on_receive(wc.wr_id, wc.byte_len, wc)
            return
        pending = self._pending.pop(wc.wr_id, None)
        if pending is not None:
            pending.done.set()

    def close(self) -> None:
        """Deregister the Receive and Send buffers (once the QP is gone or in error)."""
        self.recv_mr.close()
        if self._send_mr is not None:
            self._send_mr.close()


def send_wr(mr: MR, length: int, invalidate_rkey: int = 0) -> SendWR:
    """A Send (with Invalidate of ``invalidate_rkey`` when non-zero) of a region's first bytes."""
    opcode = WROpcode.SEND_WITH_INV if invalidate_rkey else WROpcode.SEND
    return SendWR(0, opcode, [mr.sge(0, length)], invalidate_rkey=invalidate_rkey)


def rdma_wr(opcode: WROpcode, mr: MR, offset: int, length: int, remote: int, rkey: int) -> SendWR:
    """An RDMA Read or Write of ``length`` bytes at ``offset`` of ``mr`` to or from the peer."""
    return SendWR(0, opcode, [mr.sge(offset, length)], remote_addr=remote, rkey=rkey)
