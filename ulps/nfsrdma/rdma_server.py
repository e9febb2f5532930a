"""The RPC-over-RDMA v1 responder: ONC RPC calls served over RDMA connections (RFC 8166).

::

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_rdma, RpcServer([nfs, mount]), 20049)

Each connection is accepted with our RFC 8797 private data (our inline send
and receive sizes; the client's are honoured, 1024 bytes each way without
any) and gets one posted Receive per credit, and the few spare ones of
:func:`~.rdma_endpoint.receives_for` (Receives given back are posted again
several at a time). A Receive stays taken until the call's reply is about to
be sent, so granting ``credits`` in every reply never promises a Receive that
is not there; a client that sends more than it was granted meets an empty
receive queue once it has used the spare ones too, and loses its connection
(the transport's Terminate).

A call arrives as RDMA_MSG (inline) or RDMA_NOMSG (a Long Call in the
position-zero Read chunk). Read chunks are pulled by RDMA Read into the
call's XDR stream at their positions (a position counts bytes of the whole
reconstructed stream; a chunk whose length is not a multiple of four is
followed by its XDR roundup, RFC 8166 §3.4.5.2) before the stream goes to
``handle_call``; at most ``max_call_size`` bytes of chunks per call are
accepted. The reply's DDP-eligible items (RFC 8267) go by RDMA Write into
the call's Write chunks in order (the inline stream keeps each item's length
word and drops its bytes); the rest goes inline as RDMA_MSG if it fits the
client's receive size, else by RDMA Write into the Reply chunk with an
RDMA_NOMSG, else the answer is RDMA_ERROR ERR_CHUNK. A header of another
version gets ERR_VERS (1, 1), an unparsable one ERR_CHUNK. When the client
allows remote invalidation and all of the call's chunks use one R_Key, the
reply is a Send With Invalidate of it.

A connection's failure (a bad peer, a lost link) ends that connection only.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.cm import CMError, serve
from rdmashim.ulps.nfsrdma.pool import BufferPool
from rdmashim.ulps.nfsrdma.rdma_endpoint import (
    BATCH,
    ConnectionLost,
    Endpoint,
    rdma_wr,
    receives_for,
)
from rdmashim.ulps.nfsrdma.rpc import PendingCall
from rdmashim.ulps.nfsrdma.rpcrdma import (
    PLAIN_LEN,
    Chunk,
    ConnectPrivate,
    ErrCode,
    ErrorHeader,
    Header,
    Proc,
    Segment,
    VersionMismatch,
    chunk_length,
    decode,
    peek_fixed,
    peek_plain,
    peer_sizes,
    plain_header,
    read_chunks,
    write_plain_header,
)
from rdmashim.ulps.nfsrdma.service import CallHandler, Reply
from rdmashim.ulps.nfsrdma.xdr import XdrError, pad
from rdmashim.verbs import Access, QPCap, SendWR, WCFlags, WROpcode
from rdmashim.verbs.slots import LEFT, NOT_TAKEN

if TYPE_CHECKING:
    from rdmashim.cm import ConnectionRequest
    from rdmashim.cm.addressing import SockAddr
    from rdmashim.verbs.abc import MR

log = logging.getLogger(__name__)

DEFAULT_CREDITS = 32
DEFAULT_MAX_CALL = (1 << 20) + 64 * 1024
"""Bytes of Read chunks one call may bring (an NFS WRITE of 1 MiB and its headers)."""
TRANSPORT = "rdma"
CALL_BUFFERS = DEFAULT_CREDITS
"""Buffers the listener keeps for the streams of calls with Read chunks, shared by its
connections: as many as one client's calls in flight (a kernel client keeps its credits'
worth of 1 MiB WRITEs out), so a stream of WRITEs pulls each into memory that is already
there, not into a fresh buffer zeroed and faulted in per call."""


@dataclass(frozen=True, slots=True)
class Settings:
    """A responder's sizes and bounds."""

    inline_size: int
    credits: int
    max_call_size: int


class ChunkError(XdrError):
    """A call's chunks cannot be used (answered with ERR_CHUNK)."""


PLAIN_CALL = Header(0, 0, Proc.RDMA_MSG, (), (), None)
"""The transport header of every plain call (an RDMA_MSG without chunks), but its xid."""
Answer = Reply | PendingCall | ErrorHeader | None
"""What a call gets: a reply, one its program is still making, an RDMA_ERROR, or nothing."""


async def serve_rdma(
    server: CallHandler,
    port: int,
    host: str = "0.0.0.0",
    *,
    backend: str | None = None,
    inline_size: int = 4096,
    credits: int = DEFAULT_CREDITS,
    max_call_size: int = DEFAULT_MAX_CALL,
    task_status: trio.TaskStatus[SockAddr | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on ``host``:``port`` and serve RPC-over-RDMA connections until cancelled.

    Use with ``nursery.start``: it reports the listening address. ``inline_size``
    (a multiple of 1 KiB) is our Receive buffer size and largest inline Send;
    ``credits`` the Receives posted per connection.
    """
    ConnectPrivate(inline_size, inline_size).encode()  # ValueError now for a bad size
    if credits < 1:
        raise ValueError(f"credits {credits} < 1")
    settings = Settings(inline_size, credits, max_call_size)
    pool = BufferPool(CALL_BUFFERS)

    async def handler(request: ConnectionRequest) -> None:
        try:
            await _Responder(server, request, settings, pool).run()
        except CMError as exc:
            log.info("RPC-over-RDMA connection from %s not set up: %s", request.peer_addr, exc)
        except Exception:  # one connection's failure must not stop the listener
            log.exception("RPC-over-RDMA connection from %s failed", request.peer_addr)

    cap = QPCap(max_send_wr=128, max_recv_wr=receives_for(credits))
    await serve(handler, port, host=host, cap=cap, backend=backend, task_status=task_status)


class _Responder:
    """One connection: receives calls, pulls their chunks, sends their replies.

    A call without Read chunks is decoded where it lies in its Receive slot
    and, when :meth:`~.rpc.RpcServer.call_now` can answer it at once, answered
    in the completion task; a call with Read chunks has their RDMA Reads posted
    there and is taken on from their completion, as if it had just arrived; a
    call its program carries out in a task gets a task of its own. Either way
    its Receive slot stays taken until the reply is about to be sent.
    """

    def __init__(
        self, server: CallHandler, request: ConnectionRequest, s: Settings, pool: BufferPool
    ) -> None:
        self.server = server
        self.request = request
        self.settings = s
        self.peer = request.peer_addr
        client = peer_sizes(request.private_data)
        self.reply_inline = min(s.inline_size, client.recv_size)
        self.remote_invalidate = client.remote_invalidate
        self.ep = Endpoint(request, s.inline_size, s.credits)
        self.pool = pool
        """The streams of calls with Read chunks (the listener's: no allocation and
        zeroing per call)."""
        self.nursery: trio.Nursery | None = None
        self._plain = True
        """The last call the event loop took was plain (inline, no chunks)."""
        self._later: list[tuple[int, int, Answer]] = []
        """Answers the serving thread left for the event loop: (slot, xid, answer)."""
        self._busy = 0
        """The connection's tasks at work (:meth:`_spawn`; the nursery has no others) and
        calls whose Read chunks are being pulled (:meth:`_pull`)."""

    async def run(self) -> None:
        try:
            answer = ConnectPrivate(self.settings.inline_size, self.settings.inline_size)
            await self.request.accept(private_data=answer.encode())
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                try:
                    await self.ep.run(self._on_receive, served=self)
                except ConnectionLost as exc:
                    log.info("RPC-over-RDMA connection from %s ended: %s", self.peer, exc)
                nursery.cancel_scope.cancel()
        finally:
            self.ep.close()

    # -------------------------------------------- served from a thread (rdma_endpoint.Served)
    def receive(self, slot: int, length: int, _flags: WCFlags) -> bool:
        """In the thread serving the connection: a plain call answered at once with a
        plain reply from a Send slot is answered here; another answer waits for
        :meth:`resume` (no registration here); a call with chunks goes to the event
        loop (False)."""
        called = self._call_plain(slot, length)
        if called is None:
            return False
        xid, answer = called
        if not self._send_plain(slot, xid, answer):
            self._later.append((slot, xid, answer))
        return True

    def answer(self, slot: int, length: int, send_slot: int) -> int:
        """In the thread answering from the endpoint's slots: a plain call whose reply is
        plain too is answered into Send slot ``send_slot`` (the reply's length: the
        backend posts it and gives the Receive back); another answer waits for
        :meth:`resume` (``LEFT``); a call with chunks goes to :meth:`receive`, which
        leaves it to the event loop (``NOT_TAKEN``)."""
        called = self._call_plain(slot, length)
        if called is None:
            return NOT_TAKEN
        xid, answer = called
        body = self._inline_body(answer)
        if body is None:
            self._later.append((slot, xid, answer))
            return LEFT
        out = self.ep.send_slot_view(send_slot)
        write_plain_header(out, xid, self.settings.credits)
        end = PLAIN_LEN + len(body)
        out[PLAIN_LEN:end] = body
        return end

    def _call_plain(self, slot: int, length: int) -> tuple[int, Answer] | None:
        """The xid of the plain call in Receive slot ``slot`` and what the program
        answers at once; None when its header is not plain (chunks, another version)."""
        data = self.ep.slot_view(slot, length)
        plain = peek_plain(data)
        if plain is None:
            return None
        return plain[0], self.server.call_now(data[PLAIN_LEN:], self.peer, TRANSPORT)

    def quiet(self) -> bool:
        """Whether a thread may serve: no task of the connection at work, no answer
        waiting for the event loop, and the last call the event loop took was plain
        (a stream of calls with chunks stays in the event loop)."""
        return self._plain and not self._later and not self._busy

    def resume(self) -> None:
        """The thread gave the connection back: the answers it left are sent (or their
        calls finished in tasks)."""
        later, self._later = self._later, []
        for slot, xid, answer in later:
            self._answer(slot, xid, PLAIN_CALL, answer)

    # ------------------------------------------------------------------ the event loop's
    def _on_receive(self, slot: int, length: int, _flags: WCFlags) -> None:
        data = self.ep.slot_view(slot, length)
        plain = peek_plain(data)
        self._plain = plain is not None
        if plain is not None:  # the common call: inline, no chunks
            xid = plain[0]
            answer = self.server.call_now(data[PLAIN_LEN:], self.peer, TRANSPORT)
            if not self._send_plain(slot, xid, answer):
                self._answer(slot, xid, PLAIN_CALL, answer)
            return
        try:
            xid = peek_fixed(data)[0]
        except XdrError:
            self._close(f"a {length}-byte message without a transport header")
            return
        try:
            header, start = decode(data)
            if isinstance(header, ErrorHeader):
                raise ChunkError("RDMA_ERROR sent to a responder")
        except VersionMismatch as exc:
            log.info("RPC-over-RDMA from %s: %s", self.peer, exc)
            error = ErrorHeader(xid, self.settings.credits, ErrCode.ERR_VERS)
            self._answer(slot, xid, None, error)
            return
        except XdrError as exc:
            self._answer(slot, xid, None, self._chunk_error(xid, exc))
            return
        if header.read_list or header.proc != Proc.RDMA_MSG:
            self._pull(slot, header, data[start:])
        else:
            answer = self.server.call_now(data[start:], self.peer, TRANSPORT)
            self._answer(slot, xid, header, answer)

    def _send_plain(self, slot: int, xid: int, answer: Answer) -> bool:
        """The answer to a plain call, when it is a reply that is plain too (no
        DDP-eligible item, inline) and a Send slot and room in the send queue are there
        now: sent, True; else nothing done."""
        body = self._inline_body(answer)
        if body is None:
            return False
        return self.ep.try_answer(slot, (plain_header(xid, self.settings.credits), body))

    def _inline_body(self, answer: Answer) -> bytearray | None:
        """The RPC reply's bytes when ``answer`` is a reply that goes plain (no DDP-eligible
        item) and inline; else None."""
        if type(answer) is not Reply or answer.ddp:
            return None
        body = answer.packer.data
        return body if PLAIN_LEN + len(body) <= self.reply_inline else None

    def _chunk_error(self, xid: int, exc: XdrError) -> ErrorHeader:
        log.info("RPC-over-RDMA from %s, xid %#x: %s", self.peer, xid, exc)
        return ErrorHeader(xid, self.settings.credits, ErrCode.ERR_CHUNK)

    def _close(self, why: str) -> None:
        log.warning("RPC-over-RDMA connection from %s closed: %s", self.peer, why)
        assert self.nursery is not None
        self.nursery.cancel_scope.cancel()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        assert self.nursery is not None
        self.nursery.start_soon(self._guarded, work)
        self._busy += 1

    async def _guarded(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except ConnectionLost:
            pass  # run() reports it
        except Exception as exc:
            log.exception("RPC-over-RDMA call from %s failed", self.peer)
            self._close(f"{type(exc).__name__}: {exc}")
        finally:
            self._busy -= 1

    def _answer(self, slot: int, xid: int, call: Header | None, answer: Answer) -> None:
        """Answer now if that needs no waiting, else in a task of its own."""
        if isinstance(answer, PendingCall) or not self._try_answer(slot, xid, call, answer):
            self._spawn(self._finish(slot, xid, call, answer))

    async def _finish(self, slot: int, xid: int, call: Header | None, answer: Answer) -> None:
        """Answer, once the program is done and the send queue has room."""
        if isinstance(answer, PendingCall):
            answer = await answer.finish()
        while not self._try_answer(slot, xid, call, answer):
            await self.ep.wait_room()

    def _try_answer(
        self, slot: int, xid: int, call: Header | None, answer: Reply | ErrorHeader | None
    ) -> bool:
        """Send the reply to call ``xid`` (its transport header ``call``; None with an
        RDMA_ERROR) and give the Receive back; False if the send queue has no room now
        (nothing done)."""
        if answer is None:  # not a call: no answer
            self.ep.repost(slot)
            return True
        if isinstance(answer, ErrorHeader) or call is None:
            assert isinstance(answer, ErrorHeader)
            return self._send(slot, [answer.encode()], [], 0, [])
        try:
            return self._reply(slot, xid, call, answer)
        except ChunkError as exc:
            return self._try_answer(slot, xid, None, self._chunk_error(xid, exc))

    # ------------------------------------------------------------------ calls
    def _pull(self, slot: int, header: Header, inline: memoryview) -> None:
        """A call with Read chunks (or a Long Call): its stream laid out and its chunks'
        RDMA Reads posted now, by the completion task, and the call answered from the
        completion of the last (:meth:`_pulled`): no task waits for them, unless the send
        queue has no room for them now."""
        xid = header.xid
        try:
            stream, places = self._lay_out(header, inline)
            reads = _spread(places)
        except XdrError as exc:
            self._answer(slot, xid, None, self._chunk_error(xid, exc))
            return
        if not reads:
            self._answer(slot, xid, header, self.server.call_now(stream, self.peer, TRANSPORT))
            return
        mr = self.ep.register(stream, Access.LOCAL_WRITE)
        wrs = [
            rdma_wr(WROpcode.RDMA_READ, mr, at, seg.length, seg.offset, seg.handle)
            for at, seg in reads
        ]
        self._busy += 1
        try:
            posted = len(wrs) <= BATCH and self.ep.try_post(
                wrs, [mr], lambda: self._pulled(slot, header, stream)
            )
        except ConnectionLost:
            mr.close()
            raise
        if not posted:
            self._spawn(self._pull_in_steps(slot, header, stream, wrs, mr))

    async def _pull_in_steps(
        self, slot: int, header: Header, stream: memoryview, wrs: list[SendWR], mr: MR
    ) -> None:
        """:meth:`_pull`'s Reads when the send queue had no room for them: posted as it
        makes room, then the call answered."""
        try:
            await self.ep.post(wrs)
        finally:
            mr.close()
        self._pulled(slot, header, stream)

    def _pulled(self, slot: int, header: Header, stream: memoryview) -> None:
        """The call's Read chunks are in its stream: it is answered."""
        self._busy -= 1
        self._answer(slot, header.xid, header, self.server.call_now(stream, self.peer, TRANSPORT))

    def _lay_out(
        self, header: Header, inline: memoryview
    ) -> tuple[memoryview, list[tuple[int, Chunk]]]:
        """The call's XDR stream with the inline part in place and room for every Read
        chunk (in a buffer of the listener's pool, reused once nothing refers to it), and
        where each chunk goes in it. Raises :class:`ChunkError`."""
        chunks = read_chunks(header.read_list)
        if header.proc == Proc.RDMA_NOMSG:
            if not chunks or chunks[0][0] != 0:
                raise ChunkError("RDMA_NOMSG without a position-zero Read chunk")
            inline = inline[:0]
        elif chunks and chunks[0][0] == 0:
            raise ChunkError("position-zero Read chunk in an RDMA_MSG")
        total = sum(chunk_length(c) for _, c in chunks)
        if total > self.settings.max_call_size:
            raise ChunkError(f"{total} bytes of Read chunks, at most {self.settings.max_call_size}")
        # Lay out the stream: inline runs, and room for each chunk and its roundup;
        # then make it once at its final size and copy the inline runs in.
        size = used = 0
        runs: list[tuple[int, int, int]] = []  # (at in the stream, at in inline, length)
        places: list[tuple[int, Chunk]] = []
        for position, chunk in chunks:
            before = position - size
            if before < 0 or used + before > len(inline):
                raise ChunkError(f"Read chunk position {position} outside the call")
            runs.append((size, used, before))
            size, used = size + before, used + before
            places.append((size, chunk))
            n = chunk_length(chunk)
            size += n + pad(n)
        runs.append((size, used, len(inline) - used))
        total = size + len(inline) - used
        out = memoryview(self.pool.take(total, zero=False))[:total]
        for at, start, n in runs:
            out[at : at + n] = inline[start : start + n]
        for at, chunk in places:  # a reused buffer has old bytes where the roundups go
            n = chunk_length(chunk)
            out[at + n : at + n + pad(n)] = bytes(pad(n))
        return out, places

    # ------------------------------------------------------------------ replies
    def _reply(self, slot: int, xid: int, call: Header, reply: Reply) -> bool:
        data = memoryview(reply.packer.data)
        inline: list[bytes | memoryview] = []
        writes: list[tuple[int, Chunk]] = []
        sources: list[memoryview] = []
        returned: list[Chunk] = []
        start = 0
        for index, (offset, item) in enumerate(reply.ddp):
            inline.append(data[start:offset])
            start = offset
            if index < len(call.write_list):
                chunk = call.write_list[index]
                room = chunk_length(chunk)
                if len(item) > room:
                    raise ChunkError(f"a {len(item)}-byte result for a {room}-byte Write chunk")
                writes.append((sum(len(s) for s in sources), chunk))
                sources.append(item)
                returned.append(_filled(chunk, len(item)))
            else:  # no chunk for it: inline, as over TCP
                inline += [item, bytes(pad(len(item)))]
        inline.append(data[start:])
        returned += [_filled(c, 0) for c in call.write_list[len(returned) :]]
        credits = self.settings.credits
        if returned:
            wire = Header(xid, credits, Proc.RDMA_MSG, (), tuple(returned), None).encode()
        else:
            wire = plain_header(xid, credits)
        size = sum(len(part) for part in inline)
        if len(wire) + size > self.reply_inline:
            if call.reply_chunk is None or size > chunk_length(call.reply_chunk):
                raise ChunkError(
                    f"a {size}-byte reply fits neither inline ({self.reply_inline}) "
                    f"nor a Reply chunk"
                )
            writes.append((sum(len(s) for s in sources), call.reply_chunk))
            sources.append(memoryview(b"".join(inline)))
            reply_chunk = _filled(call.reply_chunk, size)
            header = Header(xid, credits, Proc.RDMA_NOMSG, (), tuple(returned), reply_chunk)
            wire, inline = header.encode(), []
        if not sources:
            return self._send(slot, [wire, *inline], [], self._invalidate(call), [])
        # One writable source of its own (READ's data) is registered where it is; else
        # one copy (a source in a Receive slot is given back before the Writes read it).
        one = len(sources) == 1 and not sources[0].readonly
        if one and self.ep.in_receive_buffer(sources[0]):
            one = False
        ops = _spread(writes, sum(len(s) for s in sources))
        if len(ops) < self.ep.sq_depth and not self.ep.has_room(len(ops) + 1):
            return False  # (more than it holds at all: _send takes them in steps)
        source = sources[0] if one else bytearray(b"".join(sources))
        regions = [self.ep.register(source)] if len(source) else []
        wrs = [
            rdma_wr(WROpcode.RDMA_WRITE, regions[0], at, seg.length, seg.offset, seg.handle)
            for at, seg in ops
        ]
        return self._send(slot, [wire, *inline], wrs, self._invalidate(call), regions)

    def _invalidate(self, call: Header) -> int:
        """The R_Key a Send With Invalidate may invalidate (0: none)."""
        if not self.remote_invalidate:
            return 0
        handles = {e.segment.handle for e in call.read_list}
        for chunk in (*call.write_list, call.reply_chunk or ()):
            handles.update(s.handle for s in chunk)
        return handles.pop() if len(handles) == 1 else 0

    def _send(
        self,
        slot: int,
        parts: list[bytes | memoryview],
        wrs: list[SendWR],
        invalidate: int,
        regions: list[MR],
    ) -> bool:
        """RDMA Writes, then the reply's Send; the call's Receive is given back first.
        False if the send queue has no room now (nothing done)."""
        if len(wrs) + 1 > self.ep.sq_depth:  # more Writes than it holds: a few at a time
            self._spawn(self._send_in_steps(slot, parts, wrs, invalidate, regions))
            return True
        if not self.ep.has_room(len(wrs) + 1):
            return False
        self.ep.repost(slot)
        sent = self.ep.try_send(parts, wrs, invalidate, regions)
        assert sent, "room was checked"
        return True

    async def _send_in_steps(
        self,
        slot: int,
        parts: list[bytes | memoryview],
        wrs: list[SendWR],
        invalidate: int,
        regions: list[MR],
    ) -> None:
        """:meth:`_send` of more RDMA Writes than the send queue holds: the Writes in
        batches, each waited for, then the Send."""
        try:
            await self.ep.post(wrs)
            self.ep.repost(slot)
            await self.ep.send(parts, (), invalidate, regions)
        except BaseException:
            for region in regions:
                region.close()
            raise


def _filled(chunk: Chunk, length: int) -> Chunk:
    """A chunk as returned to the requester: each segment's length what was written to it."""
    out = []
    for seg in chunk:
        n = min(seg.length, length)
        length -= n
        out.append(Segment(seg.handle, n, seg.offset))
    return tuple(out)


def _spread(places: list[tuple[int, Chunk]], limit: int | None = None) -> list[tuple[int, Segment]]:
    """Local offsets and segments of the RDMA operations moving each chunk's bytes.

    ``places`` gives each chunk's local start; with ``limit`` (Writes) a chunk
    takes only the bytes up to the next chunk's start (its item's length), and
    a segment that would pass 64 bits of address space is refused.
    """
    ops: list[tuple[int, Segment]] = []
    for index, (at, chunk) in enumerate(places):
        end = places[index + 1][0] if index + 1 < len(places) else limit
        for seg in chunk:
            n = seg.length if end is None else min(seg.length, end - at)
            if n <= 0:
                continue
            if seg.offset + n > 1 << 64:
                raise ChunkError(f"segment at {seg.offset:#x} of {n} bytes passes 2**64")
            ops.append((at, Segment(seg.handle, n, seg.offset)))
            at += n
    return ops


__all__ = ["DEFAULT_CREDITS", "DEFAULT_MAX_CALL", "CallHandler", "serve_rdma"]
