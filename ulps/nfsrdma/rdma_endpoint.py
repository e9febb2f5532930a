"""One RPC-over-RDMA connection's queue pair, as both the requester and the responder drive it.

An :class:`Endpoint` owns the connection's Receive buffers (one slot of the
inline receive size per posted Receive) and Send buffers, both registered
once, and drives the queue pair with the batch verbs: the Receives are a
:class:`~rdmashim.verbs.RecvBatch` (entry ``i`` is slot ``i``, re-posted by
index), the Sends from the Send slots a :class:`~rdmashim.verbs.SendBatch`,
and one task (:meth:`Endpoint.run`; a thread where the backend serves one, see
:class:`Served`; or a requester's waiting call, :meth:`Endpoint.handle`) takes
completions into a :class:`~rdmashim.verbs.WCArray` and hands each received
message to the transport, where it is answered, without a task of its own when
it can be.

Receives given back (:meth:`repost`) are posted :data:`REPOST_EVERY` at a
time, in one post: an endpoint of ``credits`` keeps ``REPOST_EVERY - 1``
Receives more than that posted (:func:`receives_for`), so the ones waiting
to be posted never leave a credit its peer was granted without a Receive.
The Sends from slots (:meth:`try_send`) filled within one batch of
completions are posted once, at its end. A Send never waits for its
completion: its slot (and any region its RDMA Writes read from) is released
when the completion comes. A Send from a slot is signaled only every
:data:`SIGNAL_EVERY` Sends, or when it carries regions or follows RDMA
Writes: its completion releases the slots of the Sends posted before it too
(a send queue completes in order). Other work requests are not signaled but
the last of each :meth:`post` (or :meth:`try_post`, whose completion calls back
instead of waking a task).
The send queue is never asked to hold more than it has room for: a Send
that finds no room waits (:meth:`send`) or is left to its caller
(:meth:`try_send`). A work completion with an error status ends the
connection (:class:`ConnectionLost`) and wakes every waiter with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from rdmashim.verbs import (
    Access,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    WCArray,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.verbs.slots import Slots

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.cm import Connection, ConnectionRequest
    from rdmashim.verbs.abc import CQ, MR

log = logging.getLogger(__name__)

BATCH = 16
"""Work requests of one :meth:`Endpoint.post` posted before waiting for their completion."""
COMPLETIONS = 64
"""Completions taken at once."""
REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE
"""What a requester grants on a buffer the responder writes (Write and Reply chunks)."""

Bytes = bytes | bytearray | memoryview
"""A part of a message to send: bytes (a memoryview of format ``B``)."""
OnReceive = Callable[[int, int, WCFlags], None]
"""``on_receive(slot, length, wc_flags)``: a message arrived in a Receive slot."""


class Served(Protocol):
    """How :meth:`Endpoint.run` lets a thread of the backend's own serve the connection
    (``CQ.serve_in_thread``), for a transport that answers most messages at once.

    ``receive`` runs in that thread for each received message: True when it dealt
    with it there (it may post Sends from slots and :meth:`Endpoint.repost`, and
    nothing that touches trio), False to leave it to the event loop's ``on_receive``
    (the thread then gives the QP back). ``quiet`` says whether the thread may serve:
    no task of the connection is at work and nothing waits for the event loop; asked
    in the event loop before each turn and in the thread after each message. Once
    the thread gave the QP back, ``resume`` runs in the event loop (what ``receive``
    left for it), then ``on_receive`` takes the rest of the batch.

    Where the backend answers from the endpoint's slots (:class:`~rdmashim.verbs.slots.
    Slots`), ``answer`` takes a lone received message instead of ``receive``: it writes
    the answer into the Send slot's view (:meth:`Endpoint.send_slot_view`) and returns
    its length, or returns ``slots.LEFT`` (taken, left for the event loop) or
    ``slots.NOT_TAKEN`` (then ``receive`` gets it).
    """

    def receive(self, slot: int, length: int, flags: WCFlags) -> bool: ...

    def answer(self, slot: int, length: int, send_slot: int) -> int: ...

    def quiet(self) -> bool: ...

    def resume(self) -> None: ...


SIGNAL_EVERY = 8
"""Sends from slots per signaled one (whose completion releases the others' slots)."""
REPOST_EVERY = 8
"""Receives given back before they are posted again, in one post."""


def receives_for(credits: int) -> int:
    """The Receives an endpoint of ``credits`` keeps posted (its QP's ``max_recv_wr``):
    room for the calls (or replies) its peer may have outstanding while up to
    ``REPOST_EVERY - 1`` Receives wait to be posted again."""
    return credits + REPOST_EVERY - 1


class ConnectionLost(ConnectionError):
    """The connection's queue pair failed or was closed."""


class _Posted:
    """Work requests posted together, up to a signaled last one: how many, the regions
    to close when they complete, a waiter if a task waits for them, and what to call
    once they all completed (not when they failed)."""

    __slots__ = ("count", "done", "regions", "status", "then")

    def __init__(
        self, count: int, regions: Sequence[MR], wait: bool, then: Callable[[], None] | None
    ) -> None:
        self.count = count
        self.regions = regions
        self.done = trio.Event() if wait else None
        self.then = then
        self.status = WCStatus.SUCCESS


class Endpoint:
    """Receives, Sends and RDMA operations of one connection (see the module doc)."""

    def __init__(self, conn: Connection | ConnectionRequest, recv_size: int, credits: int) -> None:
        self.conn = conn
        self.qp = conn.qp
        self.pd = conn.pd
        self.recv_size = recv_size
        self.recv_count = recv_count = receives_for(credits)
        self.recv_buffer = bytearray(recv_size * recv_count)
        self.recv_mr = self.pd.reg_mr(self.recv_buffer, Access.LOCAL_WRITE)
        self._recv_view = self.recv_mr.buf
        self._recvs = RecvBatch(
            RecvWR(slot, [self.recv_mr.sge(slot * recv_size, recv_size)])
            for slot in range(recv_count)
        )
        # Send slots: twice the Receives, as a Send's completion may come after the
        # peer already used the credit its message granted.
        slots = 2 * recv_count
        self._send_base = recv_count  # the wr_id of Send slot i is _send_base + i
        self._send_mr = self.pd.reg_mr(bytearray(recv_size * slots))
        self._send_view = self._send_mr.buf
        self._sends = SendBatch(
            SendWR(self._send_base + i, WROpcode.SEND, [], SendFlags.SIGNALED) for i in range(slots)
        )
        self.sq_depth = self.qp.cap.max_send_wr
        """Work requests the send queue holds."""
        self.slots = Slots(
            recv=self.recv_mr.sge(0, recv_size), nrecv=recv_count,
            send=self._send_mr.sge(0, recv_size), nsend=slots, send_base=self._send_base,
            signal_every=SIGNAL_EVERY, repost_every=REPOST_EVERY, room=self.sq_depth,
            free=list(range(slots)),
        )  # fmt: skip
        """The state of the slots (a thread serving the QP may take it over): the free
        Send slots (a stack: the slot released last is taken first), the slots of the
        Sends posted and not known complete, the send queue's room, the slot Sends since
        the last signaled one, the Receive slots given back and not posted yet."""
        self._send_free = self.slots.free
        self._unacked = self.slots.unacked
        self._slot_count = [1] * slots  # work requests the slot's Send completes
        self._slot_shape = [(-1, 0, True)] * slots  # the length, R_Key and signaling it has now
        self._slot_regions: list[Sequence[MR]] = [()] * slots  # closed when it completes
        self._posted: dict[int, _Posted] = {}  # by the wr_id of the signaled last request
        self._next_wr = self._send_base + slots
        self._room = trio.Event()
        self._bursting = False
        self._deferred: list[int] = []  # Send slots filled during a burst
        self._threaded = False  # a thread serves the QP (run's served)
        self._closing: list[MR] = []  # regions to close once it gave the QP back
        self.lost: ConnectionLost | None = None
        self.qp.post_recv_batch(self._recvs)

    def slot_view(self, slot: int, length: int) -> memoryview:
        """The first ``length`` received bytes of a Receive slot."""
        base = slot * self.recv_size
        return self._recv_view[base : base + length]

    def send_slot_view(self, slot: int) -> memoryview:
        """Send slot ``slot``'s bytes (where a thread answering from slots writes)."""
        base = slot * self.recv_size
        return self._send_view[base : base + self.recv_size]

    def in_receive_buffer(self, view: memoryview) -> bool:
        """Whether ``view`` lies in the Receive slots (reused once given back)."""
        return view.obj is self.recv_buffer or view.obj is self._recv_view.obj

    def repost(self, slot: int) -> None:
        """Give a Receive slot back (its bytes are done with); posted with the next
        ``REPOST_EVERY - 1`` given back."""
        if self.lost is not None:
            return
        again = self.slots.give_back(slot)
        if again:
            try:
                self.qp.post_recv_batch(self._recvs, indices=again)
            except OSError as exc:
                raise self._lose(f"posting receives failed: {exc}") from exc

    def register(self, buffer: Buffer, access: Access = Access.NONE) -> MR:
        """Register ``buffer`` on the connection's PD."""
        return self.pd.reg_mr(buffer, access)

    # ------------------------------------------------------------------ sending
    def try_send(
        self,
        parts: Sequence[Bytes],
        before: Sequence[SendWR] = (),
        invalidate: int = 0,
        regions: Sequence[MR] = (),
    ) -> bool:
        """Send the message ``parts`` (byte buffers, copied now), after the RDMA Writes
        ``before``, with Invalidate of ``invalidate`` when non-zero; ``regions`` are closed
        once the Send completed. False (nothing done, ``regions`` still the caller's) when
        the send queue has no room now. Raises :class:`ConnectionLost`.
        """
        if self.lost is not None:
            raise self.lost
        size = 0
        for part in parts:
            size += len(part)
        count = len(before) + 1
        if count > self.slots.room:
            return False
        if size <= self.recv_size and self._send_free:
            self._send_slot(parts, size, before, invalidate, regions)
            return True
        # No slot (or too big for one): a region of its own, closed at its completion.
        message = bytearray(b"".join(parts))
        mr = self.register(message)
        wr = send_wr(mr, size, invalidate)
        self._post_signaled([*before, wr], [*regions, mr], wait=False)
        return True

    def try_answer(self, slot: int, parts: Sequence[Bytes]) -> bool:
        """Give Receive ``slot`` back and send the message ``parts`` (byte buffers, copied
        now) from a Send slot, if one is free, it fits and the send queue has room now;
        else False, nothing done. It never registers memory (a thread serving the QP may
        call it). Raises :class:`ConnectionLost`."""
        if self.lost is not None:
            raise self.lost
        if not self._send_free or self.slots.room < 1:
            return False
        size = 0
        for part in parts:
            size += len(part)
        if size > self.recv_size:
            return False
        self.repost(slot)
        self._send_slot(parts, size, (), 0, ())
        return True

    def _send_slot(
        self,
        parts: Sequence[Bytes],
        size: int,
        before: Sequence[SendWR],
        invalidate: int,
        regions: Sequence[MR],
    ) -> None:
        """:meth:`try_send` of a message of ``size`` bytes from a free Send slot, for which
        the send queue has room."""
        slot = self._send_free.pop()
        at = base = slot * self.recv_size
        buf = self._send_view
        for part in parts:
            end = at + len(part)
            buf[at:end] = part
            at = end
        slots = self.slots
        signaled = bool(before or regions) or slots.unsignaled >= SIGNAL_EVERY - 1
        slots.unsignaled = 0 if signaled else slots.unsignaled + 1
        shape = (size, invalidate, signaled)
        if self._slot_shape[slot] != shape:  # else the entry stays prepared
            self._slot_shape[slot] = shape
            opcode = WROpcode.SEND_WITH_INV if invalidate else WROpcode.SEND
            self._sends.set(
                slot, opcode=opcode, sg_list=[self._send_mr.sge(base, size)],
                invalidate_rkey=invalidate,
                send_flags=SendFlags.SIGNALED if signaled else SendFlags.NONE,
            )  # fmt: skip
        count = len(before) + 1
        slots.room -= count
        if before or regions:
            self._slot_count[slot] = count
            self._slot_regions[slot] = regions
            slots.held += 1
        if self._bursting and not before:
            self._deferred.append(slot)
            return
        try:
            if before:
                self.qp.post_send([*self._unsignaled(before), self._sends[slot]])
            else:
                self.qp.post_send_batch(self._sends, indices=[slot])
        except OSError as exc:
            raise self._lose(f"posting failed: {exc}") from exc
        self._unacked.append(slot)

    async def send(
        self,
        parts: Sequence[Bytes],
        before: Sequence[SendWR] = (),
        invalidate: int = 0,
        regions: Sequence[MR] = (),
    ) -> None:
        """:meth:`try_send`, waiting for room in the send queue if there is none now."""
        while not self.try_send(parts, before, invalidate, regions):
            await self.wait_room()

    async def post(self, wrs: Sequence[SendWR]) -> None:
        """Post ``wrs`` (their wr_ids and flags are set here) and wait until all complete.

        Raises :class:`ConnectionLost` if any fails or the connection ends first.
        """
        for start in range(0, len(wrs), BATCH):
            batch = wrs[start : start + BATCH]
            while len(batch) > self.slots.room:
                await self.wait_room()
            posted = self._post_signaled(batch, (), wait=True)
            assert posted.done is not None
            await posted.done.wait()
            if posted.status != WCStatus.SUCCESS:
                raise self.lost or ConnectionLost(posted.status.name)

    def try_post(
        self, wrs: Sequence[SendWR], regions: Sequence[MR], then: Callable[[], None]
    ) -> bool:
        """Post ``wrs`` (their wr_ids and flags are set here) if the send queue has room
        for all of them now, and call ``then()`` from the completion handling once they
        all completed, after closing ``regions``; False, nothing done, when there is no
        room (:meth:`post` waits for it). Nothing is called if they fail: the connection
        is lost, and :meth:`close` closes ``regions``. Raises :class:`ConnectionLost`."""
        self._check()
        if len(wrs) > self.slots.room:
            return False
        self._post_signaled(wrs, regions, wait=False, then=then)
        return True

    def _unsignaled(self, wrs: Sequence[SendWR]) -> Sequence[SendWR]:
        """``wrs`` with wr_ids of their own and unsignaled."""
        for wr in wrs:
            wr.wr_id = self._next_wr
            wr.send_flags &= ~SendFlags.SIGNALED
            self._next_wr += 1
        return wrs

    def _post_signaled(
        self,
        wrs: Sequence[SendWR],
        regions: Sequence[MR],
        *,
        wait: bool,
        then: Callable[[], None] | None = None,
    ) -> _Posted:
        """Post ``wrs``, only the last signaled, remembered by its wr_id."""
        self._unsignaled(wrs)
        wrs[-1].send_flags |= SendFlags.SIGNALED
        posted = self._posted[wrs[-1].wr_id] = _Posted(len(wrs), regions, wait, then)
        self.slots.room -= len(wrs)
        try:
            self.qp.post_send(list(wrs))
        except OSError as exc:
            del self._posted[wrs[-1].wr_id]
            raise self._lose(f"posting failed: {exc}") from exc
        return posted

    def _flush(self) -> None:
        """The end of a burst: the Sends from slots filled in it."""
        if self._deferred and self.lost is None:
            deferred, self._deferred = self._deferred, []
            try:
                self.qp.post_send_batch(self._sends, indices=deferred)
            except OSError as exc:
                raise self._lose(f"posting failed: {exc}") from exc
            self._unacked.extend(deferred)

    def has_room(self, count: int) -> bool:
        """Whether the send queue has room for ``count`` more work requests now."""
        return count <= self.slots.room

    async def wait_room(self) -> None:
        """Wait until a work request in the send queue completed (:class:`ConnectionLost`
        if the connection ends first)."""
        self._check()
        if self._room.is_set():
            self._room = trio.Event()
        await self._room.wait()
        self._check()

    def _check(self) -> None:
        if self.lost is not None:
            raise self.lost

    def _lose(self, why: str) -> ConnectionLost:
        if self.lost is None:
            self.lost = ConnectionLost(why)
            for posted in self._posted.values():
                posted.status = WCStatus.WR_FLUSH_ERR
                if posted.done is not None:
                    posted.done.set()
            self._room.set()
        return self.lost

    # ------------------------------------------------------------------ completions
    async def run(self, on_receive: OnReceive, served: Served | None = None) -> None:
        """Take completions until the connection fails; ``on_receive(slot, length,
        wc_flags)`` for each received message (the slot stays the caller's until
        :meth:`repost`).

        With ``served``, whenever ``served.quiet()`` the completions are taken in a
        thread of the backend's own where it can (``CQ.serve_in_thread``), and each
        received message goes to ``served.receive`` there first; see :class:`Served`.

        Raises :class:`ConnectionLost`.
        """
        cq = self.conn.recv_cq
        if self.conn.send_cq is not cq:
            raise ValueError("an Endpoint needs one completion queue for sends and receives")
        wcs = WCArray(COMPLETIONS)
        try:
            while True:
                if served is not None and served.quiet():
                    if not await self._serve_in_thread(cq, wcs, on_receive, served):
                        served = None  # (the backend cannot: the event loop's way only)
                    continue
                n = await cq.poll_wait_into(wcs)
                self.handle(wcs, 0, n, on_receive)
        finally:
            self._lose("the connection closed")

    def handle(self, wcs: WCArray, start: int, n: int, on_receive: OnReceive) -> None:
        """Completions ``start:n`` of ``wcs`` (polled by whoever takes them: :meth:`run`,
        or a requester's waiting call), each received message to ``on_receive``; the
        Sends from slots filled meanwhile are posted once, at the end. Raises
        :class:`ConnectionLost`."""
        self._bursting = True
        try:
            for i in range(start, n):
                self._complete(wcs, i, on_receive)
        finally:
            self._bursting = False
        self._flush()

    async def _serve_in_thread(
        self, cq: CQ, wcs: WCArray, on_receive: OnReceive, served: Served
    ) -> bool:
        """One turn of :meth:`run` in a thread; False if the backend cannot."""
        rest: list[int] = []

        def on_completions(wcs: WCArray, n: int) -> bool:
            self._bursting = True
            try:
                for i in range(n):
                    if wcs.status[i] != WCStatus.SUCCESS:
                        rest[:] = (i, n)
                        return False
                    if wcs.opcode[i] != WCOpcode.RECV:
                        self._complete(wcs, i, on_receive)
                    elif not served.receive(wcs.wr_id[i], wcs.byte_len[i], wcs.wc_flags[i]):
                        rest[:] = (i, n)  # (the event loop's on_receive takes it)
                        return False
                    elif not served.quiet():
                        rest[:] = (i + 1, n)
                        return False
                return True
            finally:
                self._bursting = False
                self._flush()

        self.slots.answer = served.answer
        self._threaded = True
        try:
            ran = await cq.serve_in_thread(wcs, on_completions, self.slots)
        finally:
            self._threaded = False
            closing, self._closing = self._closing, []
            for region in closing:
                region.close()
        if ran:
            served.resume()
            if rest:
                self.handle(wcs, rest[0], rest[1], on_receive)
        return ran

    def _complete(self, wcs: WCArray, i: int, on_receive: OnReceive) -> None:
        wr_id = wcs.wr_id[i]
        if wcs.status[i] != WCStatus.SUCCESS:
            posted = self._posted.pop(wr_id, None)
            if posted is not None:
                posted.status = wcs.status[i]
                self._close(posted.regions)
                if posted.done is not None:
                    posted.done.set()
            raise self._lose(f"work request {wr_id} completed with {wcs.status[i].name}")
        if wcs.opcode[i] == WCOpcode.RECV:
            on_receive(wr_id, wcs.byte_len[i], wcs.wc_flags[i])
            return
        slot = wr_id - self._send_base
        if 0 <= slot < len(self._slot_count):
            self._release_through(slot)
            return
        posted = self._posted.pop(wr_id, None)
        if posted is None:
            return
        self.slots.room += posted.count
        self._room.set()  # (no task waits while a thread serves: Served.quiet)
        self._close(posted.regions)
        if posted.done is not None:
            posted.done.set()
        if posted.then is not None:
            posted.then()

    def _release_through(self, slot: int) -> None:
        """The signaled Send of ``slot`` completed, and with it every Send posted before
        it: their slots, room and regions are free. The slots go back so that they are
        taken again in the order they were posted (each keeps its place among the
        signaled and the unsignaled, and its entry stays prepared)."""
        done: list[int] = []
        unacked = self._unacked
        while unacked:
            done.append(unacked.popleft())
            if done[-1] == slot:
                break
        slots = self.slots
        for each in reversed(done):
            count = self._slot_count[each]
            slots.room += count
            regions = self._slot_regions[each]
            if count > 1 or regions:
                self._slot_count[each] = 1
                self._slot_regions[each] = ()
                slots.held -= 1
                self._close(regions)
            self._send_free.append(each)
        self._room.set()

    def _close(self, regions: Sequence[MR]) -> None:
        """Deregister ``regions`` now, or once a thread serving the QP gave it back (a
        deregistration is the event loop's: it looks at every QP of the device)."""
        if self._threaded:
            self._closing.extend(regions)
            return
        for region in regions:
            region.close()

    def close(self) -> None:
        """Deregister the Receive and Send buffers and the regions of Sends not completed
        (once the QP is gone or in error)."""
        for regions in [*(p.regions for p in self._posted.values()), *self._slot_regions]:
            for region in regions:
                region.close()
        self._posted.clear()
        self._slot_regions = [()] * len(self._slot_regions)
        self.recv_mr.close()
        self._send_mr.close()


def send_wr(mr: MR, length: int, invalidate_rkey: int = 0) -> SendWR:
    """A Send (with Invalidate of ``invalidate_rkey`` when non-zero) of a region's first bytes."""
    opcode = WROpcode.SEND_WITH_INV if invalidate_rkey else WROpcode.SEND
    return SendWR(0, opcode, [mr.sge(0, length)], invalidate_rkey=invalidate_rkey)


def rdma_wr(opcode: WROpcode, mr: MR, offset: int, length: int, remote: int, rkey: int) -> SendWR:
    """An RDMA Read or Write of ``length`` bytes at ``offset`` of ``mr`` to or from the peer."""
    return SendWR(0, opcode, [mr.sge(offset, length)], remote_addr=remote, rkey=rkey)
