"""The RPC-over-RDMA v1 requester: ONC RPC calls over an RDMA connection (RFC 8166).

::

    async with RpcRdmaClient.connect("server", 20049) as client:
        results = await client.call(NFS_PROGRAM, 3, READ, args, cred, ddp_reply_size=65536)

The client connects with our RFC 8797 private data and learns the server's
sizes from its answer (1024 bytes each way without any). A call's
DDP-eligible arguments (an NFS WRITE's data, marked in its
:class:`~.service.Reply`) are registered and sent as Read chunks at their
positions in the call's XDR stream; a DDP-eligible result (an NFS READ's
data) lands in a Write chunk of ``ddp_reply_size`` bytes, and the Unpacker
returned presents the whole reply with it in place (as over TCP), without
copying it: the Write chunk is the tail of a buffer whose head takes the
reply's inline part, and three bytes for its XDR padding. A
call whose inline part does not fit the server's receive size goes as
RDMA_NOMSG with the whole call in a position-zero Read chunk (a Long Call);
a Reply chunk of ``reply_size_hint`` bytes is offered when that much may not
fit the inline reply size (a Long Reply).

The buffers come from a :class:`~.pool.BufferPool`, under two rules that keep reuse
safe. One is the pool's: a buffer goes to another call only when nothing refers to it
(the READ data a caller still holds pins its buffer). The other is the requester's:
the memory is never registered across calls. Each call registers its chunk afresh (a
new R_Key) and deregisters it before it looks at the reply, or when it fails, so a
server writing late (after its reply, or into a connection that failed mid-Write)
names a key that no longer exists and cannot reach a later call's data. A reused
buffer is zeroed first, so a server that claims to have written more than it did
shows zeros there, as with fresh memory, never the bytes of an earlier reply.

Credits: at most as many calls are outstanding as the server granted in its
last reply (1 before the first), and never more than the Receives we posted.
Replies are matched to calls by xid; calls may run concurrently.
"""

from __future__ import annotations

import logging
import secrets
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from rdmashim.cm import open_connection
from rdmashim.ulps.nfsrdma.pool import POOL_BUFFERS, BufferPool
from rdmashim.ulps.nfsrdma.rdma_endpoint import (
    COMPLETIONS,
    REMOTE,
    ConnectionLost,
    Endpoint,
    receives_for,
)
from rdmashim.ulps.nfsrdma.rpc import OpaqueAuth, decode_reply, encode_call
from rdmashim.ulps.nfsrdma.rpcrdma import (
    PLAIN_LEN,
    Chunk,
    ConnectPrivate,
    ErrCode,
    ErrorHeader,
    Header,
    Message,
    Proc,
    ReadSegment,
    Segment,
    chunk_length,
    decode,
    peek_plain,
    peer_sizes,
    plain_header,
)
from rdmashim.ulps.nfsrdma.xdr import Unpacker, XdrError, pad
from rdmashim.verbs import Access, QPCap, WCArray, WCFlags

if TYPE_CHECKING:
    from rdmashim.cm import Connection
    from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
    from rdmashim.verbs.abc import MR

log = logging.getLogger(__name__)

DEFAULT_CREDITS = 32


class TransportError(Exception):
    """The server answered a call with RDMA_ERROR (``code``), or its reply was unusable."""

    def __init__(self, message: str, code: ErrCode | None = None) -> None:
        super().__init__(message)
        self.code = code


_PLAIN_REPLY = Header(0, 0, Proc.RDMA_MSG, (), (), None)
"""What a plain reply's transport header says beyond its xid and credit (no chunks)."""


class _Waiter:
    """A call waiting for its reply: woken when it came, or to take the lead."""

    __slots__ = ("done", "header", "inline", "replied")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.replied = False
        self.header: Message | XdrError | ConnectionLost | None = None
        self.inline = b""

    def answer(self, header: Message | XdrError | ConnectionLost, inline: bytes = b"") -> None:
        """The call's reply (or why there is none) came."""
        self.header, self.inline, self.replied = header, inline, True
        self.done.set()


class _Placement:
    """A call's Write chunk: ``size`` bytes at ``head`` in a pooled buffer."""

    __slots__ = ("buf", "head", "size")

    def __init__(self, buf: bytearray, head: int, size: int) -> None:
        self.buf, self.head, self.size = buf, head, size

    def chunk(self) -> memoryview:
        """The bytes the server may write."""
        return memoryview(self.buf)[self.head : self.head + self.size]

    def splice(self, body: bytes, written: int) -> memoryview:
        """The reply stream: ``body`` (the inline part) just before the ``written`` bytes."""
        start, end = self.head - len(body), self.head + written
        self.buf[start : self.head] = body
        self.buf[end : end + pad(written)] = bytes(pad(written))
        return memoryview(self.buf)[start : end + pad(written)]


class RpcRdmaClient:
    """Calls over one RPC-over-RDMA connection (make one with :meth:`connect`)."""

    def __init__(self, conn: Connection, ep: Endpoint, inline_size: int, credits: int) -> None:
        self.conn = conn
        self.ep = ep
        self.credits = credits
        """The credits we ask for (and the Receives we posted)."""
        server = peer_sizes(conn.private_data)
        self.call_inline = min(inline_size, server.recv_size)
        """The largest call Send (transport header included) the server receives."""
        self.reply_inline = min(inline_size, server.send_size)
        """The largest reply the server may send inline to us."""
        self.granted = 1
        """Calls the server lets us have outstanding (its last reply's credit)."""
        self.outstanding = 0
        self.peak_outstanding = 0
        """The most calls that were ever outstanding at once."""
        self.invalidated = 0
        """Replies that came as Send With Invalidate."""
        self._credit_freed = trio.Event()
        self.pool = BufferPool()
        """The memory READ data lands in."""
        self._waiting: dict[int, _Waiter] = {}
        self._leader: _Waiter | None = None
        """The call taking the connection's completions (:meth:`_await_reply`)."""
        self._wcs = WCArray(COMPLETIONS)
        self._xid = secrets.randbits(32)

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        backend: str | None = None,
        inline_size: int = 4096,
        credits: int = DEFAULT_CREDITS,
        remote_invalidate: bool = True,
    ) -> AsyncIterator[RpcRdmaClient]:
        """Connect to an RPC-over-RDMA server and yield the client (closed on leaving).

        ``inline_size`` (a multiple of 1 KiB) is our Receive buffer size and
        largest inline Send; ``credits`` the calls we ask to have outstanding;
        ``remote_invalidate`` lets the server answer with Send With Invalidate.
        """
        private = ConnectPrivate(inline_size, inline_size, remote_invalidate).encode()
        endpoints: list[Endpoint] = []

        def prepare(conn: Connection) -> None:
            for stale in endpoints:  # an attempt dropped for a local port clash
                stale.close()
            endpoints[:] = [Endpoint(conn, inline_size, credits)]

        cap = QPCap(max_send_wr=128, max_recv_wr=receives_for(credits))
        try:
            async with open_connection(
                host, port, private_data=private, cap=cap, prepare=prepare, backend=backend
            ) as conn:
                yield cls(conn, endpoints[0], inline_size, credits)
        finally:
            for ep in endpoints:
                ep.close()

    async def _await_reply(self, waiter: _Waiter) -> None:
        """Wait for ``waiter``'s reply. One waiting call at a time, the leader, takes the
        connection's completions itself: the reply to its own call wakes no other task,
        and the replies to the others wake each its own. When the leader's reply came
        (or it is cancelled) it wakes another waiting call to lead. No task takes
        completions while no call waits (the send queue holds more than ``credits``
        calls and the Sends not yet known complete, so no Send waits for room then)."""
        while not waiter.replied:
            if self._leader is not None:
                await waiter.done.wait()
                if not waiter.replied:  # (woken to lead)
                    waiter.done = trio.Event()
                continue
            self._leader = waiter
            try:
                await self._lead(waiter)
            finally:
                self._leader = None
                self._hand_on(waiter)

    async def _lead(self, waiter: _Waiter) -> None:
        cq, wcs, ep = self.conn.recv_cq, self._wcs, self.ep
        try:
            while not waiter.replied:
                ep.handle(wcs, 0, await cq.poll_wait_into(wcs), self._on_receive)
        except ConnectionLost as exc:
            log.info("RPC-over-RDMA connection to %s ended: %s", self.conn.peer_addr, exc)
            for each in self._waiting.values():
                each.answer(exc)

    def _hand_on(self, leader: _Waiter) -> None:
        """Wake a call still waiting for its reply, not ``leader``'s own, to lead."""
        for each in self._waiting.values():
            if not each.replied and each is not leader:
                each.done.set()
                return

    def _on_receive(self, slot: int, length: int, flags: WCFlags) -> None:
        data = bytes(self.ep.slot_view(slot, length))
        self.ep.repost(slot)
        if flags & WCFlags.WITH_INV:
            self.invalidated += 1
        plain = peek_plain(data)
        try:
            if plain is None:
                header, start = decode(data)
                xid, credit = header.xid, header.credit
            else:  # the common reply: inline, no chunks
                (xid, credit), header, start = plain, _PLAIN_REPLY, PLAIN_LEN
        except XdrError as exc:
            if len(data) >= 4 and (waiter := self._waiting.get(int.from_bytes(data[:4], "big"))):
                waiter.answer(exc)
            else:
                log.warning("unparsable reply from %s: %s", self.conn.peer_addr, exc)
            return
        self.granted = max(1, min(credit, self.credits))
        self._credit_freed.set()
        waiter = self._waiting.get(xid)
        if waiter is None:
            log.warning("reply from %s to no call (xid %#x)", self.conn.peer_addr, xid)
            return
        waiter.answer(header, data[start:])

    def _next_xid(self) -> int:
        self._xid = (self._xid + 1) & 0xFFFFFFFF
        while self._xid in self._waiting:
            self._xid = (self._xid + 1) & 0xFFFFFFFF
        return self._xid

    async def call(
        self,
        prog: int,
        vers: int,
        proc: int,
        args: Reply,
        cred: OpaqueAuth | AuthSys | None = None,
        *,
        ddp_reply_size: int = 0,
        reply_size_hint: int = 0,
    ) -> Unpacker:
        """Call ``prog``/``vers``/``proc`` with ``args``; an Unpacker at the results.

        ``ddp_reply_size``: room for a DDP-eligible result (offered as a Write
        chunk; the result must be the last item of the reply, as NFSv3 READ's
        and READLINK's are). ``reply_size_hint``: the largest reply expected
        (a Reply chunk is offered when it may not fit inline). Raises
        :class:`~.rpc.RpcError` for a reply that is not SUCCESS,
        :class:`TransportError` for RDMA_ERROR, :class:`ConnectionLost`.
        """
        xid = self._next_xid()
        message = encode_call(xid, prog, vers, proc, cred, args)
        reply = await self.call_message(
            message, ddp_reply_size=ddp_reply_size, reply_size_hint=reply_size_hint
        )
        return decode_reply(reply)[1]

    async def call_message(
        self, message: Reply, *, ddp_reply_size: int = 0, reply_size_hint: int = 0
    ) -> bytes | memoryview:
        """Send a whole RPC message (its first word is the xid) and return the reply message.

        With a Write chunk the reply is a view into a pooled buffer, which is
        not reused while the view (or any slice of it) is alive.
        """
        xid = int.from_bytes(message.packer.data[:4], "big")
        await self._take_credit()
        waiter = self._waiting[xid] = _Waiter()
        regions: list[MR] = []
        try:
            reply_buf = bytearray(reply_size_hint if reply_size_hint > self.reply_inline else 0)
            placed: _Placement | None = None
            write_list: tuple[Chunk, ...] = ()
            if ddp_reply_size:
                head = max(self.ep.recv_size, len(reply_buf))  # any inline part fits
                buffer = self.pool.take(head + ddp_reply_size + 3)  # (+ the XDR padding)
                placed = _Placement(buffer, head, ddp_reply_size)
                write_list = (self._offer(placed.chunk(), regions),)
            reply_chunk = self._offer(memoryview(reply_buf), regions) if reply_buf else None
            header, inline = self._call_layout(xid, message, write_list, reply_chunk, regions)
            await self.ep.send([header, inline])
            await self._await_reply(waiter)
        finally:
            del self._waiting[xid]
            for region in regions:  # the server can write into none of it from here on
                region.close()
            self.outstanding -= 1
            self._credit_freed.set()
        return _reply_message(waiter, placed, reply_buf)

    async def _take_credit(self) -> None:
        while self.outstanding >= self.granted:
            if self._credit_freed.is_set():
                self._credit_freed = trio.Event()
            await self._credit_freed.wait()
        self.outstanding += 1
        self.peak_outstanding = max(self.peak_outstanding, self.outstanding)

    def _offer(self, buf: memoryview, regions: list[MR]) -> Chunk:
        """Register ``buf`` for the server to write: a one-segment chunk."""
        mr = self.ep.register(buf, REMOTE)
        regions.append(mr)
        return (Segment(mr.rkey, len(buf), mr.iova),)

    def _call_layout(
        self,
        xid: int,
        message: Reply,
        write_list: tuple[Chunk, ...],
        reply_chunk: Chunk | None,
        regions: list[MR],
    ) -> tuple[bytes, bytes]:
        """The call's transport header and inline part, encoded: DDP items as Read chunks,
        or a Long Call."""
        data = memoryview(message.packer.data)
        inline: list[bytes | memoryview] = []
        items: list[tuple[int, memoryview]] = []  # (position in the whole stream, bytes)
        start = shift = 0
        for offset, item in message.ddp:
            inline.append(data[start:offset])
            start = offset
            if len(item):
                items.append((offset + shift, item))
            shift += len(item) + pad(len(item))
        inline.append(data[start:])
        body = b"".join(inline)
        if not (items or write_list or reply_chunk) and PLAIN_LEN + len(body) <= self.call_inline:
            return plain_header(xid, self.credits), body
        reads = tuple(ReadSegment(pos, Segment(0, len(item), 0)) for pos, item in items)
        short = Header(xid, self.credits, Proc.RDMA_MSG, reads, write_list, reply_chunk)
        if len(short.encode()) + len(body) <= self.call_inline:
            read_list = tuple(ReadSegment(pos, self._expose(item, regions)) for pos, item in items)
            header = Header(xid, self.credits, Proc.RDMA_MSG, read_list, write_list, reply_chunk)
            return header.encode(), body
        zero = (ReadSegment(0, Segment(0, 0, 0)),)
        probe = Header(xid, self.credits, Proc.RDMA_NOMSG, zero, write_list, reply_chunk).encode()
        if len(probe) > self.call_inline:
            raise TransportError(f"a call header of {len(probe)} bytes does not fit")
        whole = memoryview(b"".join(message.inline()))
        read_list = (ReadSegment(0, self._expose(whole, regions)),)
        long = Header(xid, self.credits, Proc.RDMA_NOMSG, read_list, write_list, reply_chunk)
        return long.encode(), b""

    def _expose(self, item: memoryview, regions: list[MR]) -> Segment:
        """Register ``item`` for the server to read: its segment."""
        mr = self.ep.register(item, Access.REMOTE_READ)
        regions.append(mr)
        return Segment(mr.rkey, len(item), mr.iova)


def _reply_message(
    waiter: _Waiter, placed: _Placement | None, reply_buf: bytearray
) -> bytes | memoryview:
    """The reply message: inline or from the Reply chunk, the Write chunk's data spliced in."""
    header = waiter.header
    if isinstance(header, (XdrError, ConnectionLost)):
        raise header
    assert header is not None
    if isinstance(header, ErrorHeader):
        raise TransportError(f"the server answered {header.code.name}", header.code)
    if header.proc == Proc.RDMA_MSG:
        body = waiter.inline
    else:
        if header.reply_chunk is None or not reply_buf:
            raise TransportError("RDMA_NOMSG reply without the Reply chunk we offered")
        n = chunk_length(header.reply_chunk)
        if n > len(reply_buf):
            raise TransportError(f"Reply chunk of {n} bytes, {len(reply_buf)} offered")
        body = bytes(reply_buf[:n])
    if placed is None or not header.write_list:
        return body
    written = chunk_length(header.write_list[0])
    if written > placed.size:
        raise TransportError(f"Write chunk of {written} bytes, {placed.size} offered")
    if not written:
        return body
    if len(body) < 4 or int.from_bytes(body[-4:], "big") != written:
        raise TransportError(f"{written} bytes in the Write chunk, not the reply's last item")
    return placed.splice(body, written)


__all__ = ["DEFAULT_CREDITS", "POOL_BUFFERS", "BufferPool", "RpcRdmaClient", "TransportError"]


def __getattr__(name: str) -> object:
    """``ReceivePool``, the pool's old name, kept working with a warning."""
    if name == "ReceivePool":
        warnings.warn(
            "rdmashim.ulps.nfsrdma.rdma_client.ReceivePool is now "
            "rdmashim.ulps.nfsrdma.pool.BufferPool (its take() counts all the bytes)",
            DeprecationWarning,
            stacklevel=2,
        )
        return BufferPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
