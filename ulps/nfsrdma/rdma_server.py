"""The RPC-over-RDMA v1 responder: ONC RPC calls served over RDMA connections (RFC 8166).

::

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_rdma, RpcServer([nfs, mount]), 20049)

Each connection is accepted with our RFC 8797 private data (our inline send
and receive sizes; the client's are honoured, 1024 bytes each way without
any) and gets one posted Receive per credit. A Receive stays taken until the
call's reply is about to be sent, so a client has at most ``credits`` calls
in progress and granting ``credits`` in every reply never promises a Receive
that is not there; a client that sends more than it was granted meets an
empty receive queue and loses its connection (the transport's Terminate).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from rdmashim.cm import CMError, serve
from rdmashim.ulps.nfsrdma.rdma_endpoint import ConnectionLost, Endpoint, rdma_wr, send_wr
from rdmashim.ulps.nfsrdma.rpcrdma import (
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
    peer_sizes,
    read_chunks,
)
from rdmashim.ulps.nfsrdma.service import CallHandler
from rdmashim.ulps.nfsrdma.xdr import XdrError, pad
from rdmashim.verbs import Access, QPCap, SendWR, WROpcode

if TYPE_CHECKING:
    from rdmashim.cm import ConnectionRequest
    from rdmashim.cm.addressing import SockAddr
    from rdmashim.ulps.nfsrdma.service import Reply
    from rdmashim.verbs.abc import MR
    from rdmashim.verbs.wr import WC

log = logging.getLogger(__name__)

DEFAULT_CREDITS = 32
DEFAULT_MAX_CALL = (1 << 20) + 64 * 1024
"""Bytes of Read chunks one call may bring (an NFS WRITE of 1 MiB and its headers)."""
TRANSPORT = "rdma"


@dataclass(frozen=True, slots=True)
class Settings:
    """A responder's sizes and bounds."""

    inline_size: int
    credits: int
    max_call_size: int


class ChunkError(XdrError):
    """A call's chunks cannot be used (answered with ERR_CHUNK)."""


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

    async def handler(request: ConnectionRequest) -> None:
        try:
            await _Responder(server, request, settings).run()
        except CMError as exc:
            log.info("RPC-over-RDMA connection from %s not set up: %s", request.peer_addr, exc)
        except Exception:  # one connection's failure must not stop the listener
            log.exception("RPC-over-RDMA connection from %s failed", request.peer_addr)

    cap = QPCap(max_send_wr=128, max_recv_wr=credits)
    await serve(handler, port, host=host, cap=cap, backend=backend, task_status=task_status)


class _Responder:
    """One connection: receives calls, pulls their chunks, sends their replies."""

    def __init__(self, server: CallHandler, request: ConnectionRequest, s: Settings) -> None:
        self.server = server
        self.request = request
        self.settings = s
        self.peer = request.peer_addr
        client = peer_sizes(request.private_data)
        self.reply_inline = min(s.inline_size, client.recv_size)
        self.remote_invalidate = client.remote_invalidate
        self.ep = Endpoint(request, s.inline_size, s.credits)
        self.nursery: trio.Nursery | None = None

    async def run(self) -> None:
        try:
            answer = ConnectPrivate(self.settings.inline_size, self.settings.inline_size)
            await self.request.accept(private_data=answer.encode())
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                try:
                    await self.ep.run(self._on_receive)
                except ConnectionLost as exc:
                    log.info("RPC-over-RDMA connection from %s ended: %s", self.peer, exc)
                nursery.cancel_scope.cancel()
        finally:
            self.ep.close()

    def _on_receive(self, slot: int, length: int, wc: WC) -> None:
        data = bytes(self.ep.slot_view(slot, length))
        assert self.nursery is not None
        self.nursery.start_soon(self._serve_call, slot, data)

    def _close(self, why: str) -> None:
        log.warning("RPC-over-RDMA connection from %s closed: %s", self.peer, why)
        assert self.nursery is not None
        self.nursery.cancel_scope.cancel()

    async def _serve_call(self, slot: int, data: bytes) -> None:
        try:
            await self._serve(slot, data)
        except ConnectionLost:
            pass  # run() reports it
        except Exception as exc:
            log.exception("RPC-over-RDMA call from %s failed", self.peer)
            self._close(f"{type(exc).__name__}: {exc}")

    async def _serve(self, slot: int, data: bytes) -> None:
        try:
            xid = peek_fixed(data)[0]
        except XdrError:
            self._close(f"a {len(data)}-byte message without a transport header")
            return
        try:
            header, start = decode(data)
            if isinstance(header, ErrorHeader):
                raise ChunkError("RDMA_ERROR sent to a responder")
            message = await self._assemble(header, memoryview(data)[start:])
        except VersionMismatch as exc:
            log.info("RPC-over-RDMA from %s: %s", self.peer, exc)
            await self._send_error(slot, ErrorHeader(xid, self.settings.credits, ErrCode.ERR_VERS))
            return
        except XdrError as exc:
            log.info("RPC-over-RDMA from %s, xid %#x: %s", self.peer, xid, exc)
            await self._send_error(slot, ErrorHeader(xid, self.settings.credits, ErrCode.ERR_CHUNK))
            return
        reply = await self.server.handle_call(memoryview(message), self.peer, TRANSPORT)
        if reply is None:
            self.ep.repost(slot)
            return
        try:
            await self._reply(slot, header, reply)
        except ChunkError as exc:
            log.info("RPC-over-RDMA reply to %s, xid %#x: %s", self.peer, xid, exc)
            await self._send_error(slot, ErrorHeader(xid, self.settings.credits, ErrCode.ERR_CHUNK))

    # ------------------------------------------------------------------ calls
    async def _assemble(self, header: Header, inline: memoryview) -> bytearray:
        """The call's XDR stream: the inline part with every Read chunk pulled in place."""
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
        out = bytearray(size + len(inline) - used)
        for at, start, n in runs:
            out[at : at + n] = inline[start : start + n]
        if not places:
            return out
        mr = self.ep.register(out, Access.LOCAL_WRITE)
        try:
            await self.ep.post(
                [
                    rdma_wr(WROpcode.RDMA_READ, mr, at, seg.length, seg.offset, seg.handle)
                    for at, seg in _spread(places)
                ]
            )
        finally:
            mr.close()
        return out

    # ------------------------------------------------------------------ replies
    async def _reply(self, slot: int, call: Header, reply: Reply) -> None:
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
        body = b"".join(inline)
        credits = self.settings.credits
        header = Header(call.xid, credits, Proc.RDMA_MSG, (), tuple(returned), None)
        wire = header.encode()
        if len(wire) + len(body) > self.reply_inline:
            if call.reply_chunk is None or len(body) > chunk_length(call.reply_chunk):
                raise ChunkError(
                    f"a {len(body)}-byte reply fits neither inline ({self.reply_inline}) "
                    f"nor a Reply chunk"
                )
            writes.append((sum(len(s) for s in sources), call.reply_chunk))
            sources.append(memoryview(body))
            reply_chunk = _filled(call.reply_chunk, len(body))
            header = Header(call.xid, credits, Proc.RDMA_NOMSG, (), tuple(returned), reply_chunk)
            wire, body = header.encode(), b""
        # One writable source (READ's data) is registered where it is; else one copy.
        one = len(sources) == 1 and not sources[0].readonly
        source = sources[0] if one else bytearray(b"".join(sources))
        ops = _spread(writes, len(source))
        regions = [self.ep.register(source)] if source else []
        wrs = [
            rdma_wr(WROpcode.RDMA_WRITE, regions[0], at, seg.length, seg.offset, seg.handle)
            for at, seg in ops
        ]
        await self._send(slot, wire + body, wrs, self._invalidate(call), regions)

    def _invalidate(self, call: Header) -> int:
        """The R_Key a Send With Invalidate may invalidate (0: none)."""
        if not self.remote_invalidate:
            return 0
        handles = {e.segment.handle for e in call.read_list}
        for chunk in (*call.write_list, call.reply_chunk or ()):
            handles.update(s.handle for s in chunk)
        return handles.pop() if len(handles) == 1 else 0

    async def _send_error(self, slot: int, error: ErrorHeader) -> None:
        await self._send(slot, error.encode(), [], 0, [])

    async def _send(
        self, slot: int, message: bytes, wrs: list[SendWR], invalidate: int, regions: list[MR]
    ) -> None:
        """RDMA Writes, then the reply's Send; the call's Receive is posted again first."""
        buf = bytearray(message)
        regions.append(self.ep.register(buf))
        try:
            self.ep.repost(slot)
            await self.ep.post([*wrs, send_wr(regions[-1], len(buf), invalidate)])
        finally:
            for region in regions:
                region.close()


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
