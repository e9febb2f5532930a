"""RDS over TCP: the stream decoder, and our node against a peer written out by hand
here (real TCP sockets on loopback addresses) that speaks Linux ``rds_tcp``'s rules."""

from __future__ import annotations

import contextlib
import errno
import gc
import ipaddress
import logging
import os
import random
import socket
import struct
import tracemalloc
from collections.abc import AsyncIterator

import pytest
import trio
import trio.lowlevel
import trio.testing

from rdmashim.ulps.rds import tcp
from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.node import RdsError, RdsNode, RdsSocket
from rdmashim.ulps.rds.rdma import RdmaOp
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.tcp import TcpSession
from rdmashim.ulps.rds.tcp_stream import StreamDecoder
from rdmashim.ulps.rds.wire import (
    RDS_CONG_MAP_BYTES,
    RDS_FLAG_PROBE_PORT,
    RDS_HEADER_LEN,
    RDS_MAX_MSG_SIZE,
    CongestionMap,
    GenNumExt,
    NpathsExt,
    RdsFlag,
    RdsHeader,
    RdsProtocolError,
)

from rdsnodes import close, nodes, wait_until

pytestmark = pytest.mark.usefixtures("rds_paths")  # C and Python plain paths

LOW, HIGH = "127.0.0.1", "127.0.0.2"


def frame(header: RdsHeader, payload: bytes = b"") -> bytes:
    return header.encode() + payload


def data_msg(seq: int, payload: bytes, sport: int = 7, dport: int = 4000, **kw: object) -> bytes:
    return frame(RdsHeader(seq, 0, len(payload), sport, dport, **kw), payload)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- decoder
def test_stream_cut_at_every_byte_gives_the_same_messages() -> None:
    rng = random.Random(5)
    msgs = [
        (RdsHeader(i + 1, 0, n, 9, 4000), rng.randbytes(n))
        for i, n in enumerate([0, 1, 47, 48, 4097])
    ]
    msgs.append((RdsHeader(0, 0, RDS_CONG_MAP_BYTES, flags=RdsFlag.CONG_BITMAP), bytes(8192)))
    stream = b"".join(frame(h, p) for h, p in msgs)
    for cut in range(len(stream) + 1):
        dec = StreamDecoder()
        got = dec.feed(stream[:cut]) + dec.feed(stream[cut:])
        assert got == msgs, cut
        assert dec.buffered == 0
    dec = StreamDecoder()
    got = [m for b in stream for m in dec.feed(bytes([b]))]  # one byte at a time
    assert got == msgs


def test_hostile_length_is_refused_before_any_payload_is_kept() -> None:
    header = bytearray(RdsHeader(1, 0, 16, 9, 4000).encode())
    struct.pack_into("!I", header, 16, RDS_MAX_MSG_SIZE + 1)
    dec = StreamDecoder()
    assert dec.feed(bytes(header[:47])) == []
    with pytest.raises(RdsProtocolError, match="exceeds RDS_MAX_MSG_SIZE"):
        dec.feed(bytes(header[47:]))
    # The largest allowed length is taken, and waited for.
    dec = StreamDecoder()
    assert dec.feed(RdsHeader(1, 0, RDS_MAX_MSG_SIZE, 9, 4000).encode()) == []
    assert dec.buffered == 0


def test_bad_checksum_and_bad_map_length_are_protocol_errors() -> None:
    good = RdsHeader(3, 0, 0, 9, 4000).with_checksum().encode()
    bad = bytearray(good)
    bad[20] ^= 1
    with pytest.raises(RdsProtocolError, match="checksum"):
        StreamDecoder().feed(bytes(bad))
    assert StreamDecoder().feed(good)[0][0].sequence == 3  # a right one passes
    wrong_map = bytearray(RdsHeader(0, 0, 100, flags=RdsFlag.CONG_BITMAP).encode())
    with pytest.raises(RdsProtocolError, match="congestion map"):
        StreamDecoder().feed(bytes(wrong_map))


# ----------------------------------------------------------------------- a peer by hand
class RawPeer:
    """The other end of one RDS/TCP connection, driven by the test."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = StreamDecoder()
        self.got: list[tuple[RdsHeader, bytes]] = []

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive(self, want: object = None) -> tuple[RdsHeader, bytes]:
        """The next message (that ``want(header)`` accepts, when given)."""
        while True:
            while not self.got:
                data = await self.stream.receive_some(65536)
                if not data:
                    raise EOFError("the node closed the connection")
                self.got += self.decoder.feed(data)
            header, payload = self.got.pop(0)
            if want is None or want(header):  # type: ignore[operator]
                return header, payload

    async def closed(self) -> bool:
        """Whether the node closes the connection (reading on until it does)."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True


def is_data(header: RdsHeader) -> bool:
    return header.flags == RdsFlag.NONE and header.dport >= 4000


async def raw_connect(node: RdsNode) -> RawPeer:
    """Connect to the node from HIGH's lower partner LOW (the side whose connection counts)."""
    stream = await trio.open_tcp_stream(str(node.address), node.port, local_address=LOW)
    return RawPeer(stream)


async def test_first_things_on_a_connection_are_map_and_probe() -> None:
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        node.bind(4000)
        peer = await raw_connect(node)
        with trio.fail_after(5):
            header, payload = await peer.receive()
            # The congestion map: sequence 0, ports 0, flags exactly CONG_BITMAP.
            assert header == RdsHeader(0, 0, RDS_CONG_MAP_BYTES, 0, 0, RdsFlag.CONG_BITMAP)
            assert CongestionMap.decode(payload) == CongestionMap()
            header, _ = await peer.receive()
            probe = header.sequence
            assert (header.sport, header.dport, header.ack, header.credit) == (1, 0, 0, 0)
            assert header.extensions == (NpathsExt(1), GenNumExt(node.generation))
            # Our answer to its probe, then messages both ways.
            await peer.send(data_msg(1, b"", sport=0, dport=RDS_FLAG_PROBE_PORT))
            await peer.send(data_msg(2, b"hello"))
            sock = node._sockets[4000]
            assert await sock.recvfrom() == (b"hello", (LOW, 7))
            await sock.sendto(b"back", (LOW, 7))
            header, payload = await peer.receive()
            assert (header.sport, header.dport, payload) == (4000, 7, b"back")
            assert header.sequence == probe + 1  # the next after our probe
        await peer.stream.aclose()


def waiting_bytes(peer: RawPeer) -> bytes:
    """What the peer's socket holds now (without waiting)."""
    try:
        return os.read(peer.stream.socket.fileno(), 1 << 20)  # (non-blocking: trio's)
    except BlockingIOError:
        return b""


async def started_session(node: RdsNode) -> tuple[RawPeer, RdsSocket]:
    """A hand-driven peer connected to ``node`` (at HIGH), past the map and the probe."""
    sock = node.bind(4000)
    peer = await raw_connect(node)
    await peer.receive(is_probe)
    await peer.send(data_msg(1, b"hi"))
    assert await sock.recvfrom() == (b"hi", (LOW, 7))
    await trio.testing.wait_all_tasks_blocked()
    return peer, sock


async def started_tcp_session(
    node: RdsNode,
) -> tuple[RawPeer, RdsSocket, RdsConnection, TcpSession]:
    """:func:`started_session`, with the node's connection and its session."""
    peer, sock = await started_session(node)
    (conn,) = node.connections()
    assert isinstance(conn.session, TcpSession)
    return peer, sock, conn, conn.session


async def test_a_message_to_an_idle_session_is_written_in_the_senders_task() -> None:
    """No task switch to a writer: the bytes are in the peer's socket when sendto_nowait
    returns (the round trip of rds stress -d 1 over TCP: 140 to 121 us)."""
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        with trio.fail_after(5):
            peer, sock = await started_session(node)
            sock.sendto_nowait(b"at once", (LOW, 7))
            got = waiting_bytes(peer)
            assert got == data_msg_bytes(node, got, b"at once")
        await peer.stream.aclose()


def data_msg_bytes(node: RdsNode, got: bytes, payload: bytes) -> bytes:
    """The message ``got`` should be: ours, from port 4000 to 7, numbered as it is."""
    header = RdsHeader.decode(got[:RDS_HEADER_LEN])
    assert header is not None
    return frame(RdsHeader(header.sequence, 0, len(payload), 4000, 7, header.flags), payload)


async def test_the_answers_to_a_burst_go_at_once_and_big_ones_in_order(rds_paths: str) -> None:
    """Three requests in one read: each answer is written at once, in the sender's task
    (none waits for the writer task). Then messages larger than the socket takes at
    once: what a write in the sender's task leaves goes first, whole and in order (on
    the C path the first big one goes through the gate, whose partial write closes it)."""
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        with trio.fail_after(10):
            peer, sock = await started_session(node)
            await peer.send(b"".join(data_msg(2 + i, b"q%d" % i) for i in range(3)))
            first = (await sock.recvfrom())[0]
            rest = [sock.recvfrom_nowait()[0] for _ in range(2)]
            assert [first, *rest] == [b"q0", b"q1", b"q2"]
            for i in range(3):
                sock.sendto_nowait(b"a%d" % i, (LOW, 7))
                written = StreamDecoder().feed(waiting_bytes(peer))  # (no task ran)
                assert [payload for _, payload in written] == [b"a%d" % i]
            await peer.send(data_msg(5, b"one"))  # a single message: direct writes again
            assert (await sock.recvfrom())[0] == b"one"
            big = [bytes([i]) * RDS_MAX_MSG_SIZE for i in range(6)]
            (conn,) = node.connections()
            assert (conn.direct is not None) == (rds_paths == "c")  # (the gate is open)
            sock.sendto_nowait(big[0], (LOW, 7))
            assert isinstance(conn.session, TcpSession)
            assert conn.session._rest is not None  # the socket took part of it
            assert conn.direct is None
            got: list[bytes] = []

            async def read_all() -> None:
                got.extend([(await peer.receive(lambda h: h.dport == 7))[1] for _ in range(7)])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                for data in big[1:]:
                    await sock.sendto(data, (LOW, 7))
                await sock.sendto(b"last", (LOW, 7))
            assert got == [*big, b"last"]
        await peer.stream.aclose()


async def test_sends_through_the_gate_are_framed_and_numbered_as_the_queue_would(
    rds_paths: str,
) -> None:
    """On the C path a socket's messages to an idle session go through the gate, each in
    one call into C (``rp_stream_sendto``), from the second on: the peer gets the bytes
    the queue's framing gives (:func:`message_header`), numbered on. A message the node
    queues meanwhile (a congestion map) closes the gate and goes in its turn. Brought in,
    they are the connection's: counted, and let go once TCP has the peer's ack."""
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        with trio.fail_after(10):
            peer, sock, conn, session = await started_tcp_session(node)
            sent = [bytes([65 + i]) * (i * 100) for i in range(20)]  # (the first empty)
            through_gate = []
            for data in sent[:10]:
                sock.sendto_nowait(data, (LOW, 7))
                through_gate.append(conn.direct.unsynced if conn.direct else 0)
            node._congestion.mark(4000, True)  # our map goes between, in order
            for data in sent[10:]:
                sock.sendto_nowait(data, (LOW, 7))
            got = [await peer.receive() for _ in range(21)]
            maps = [i for i, (h, _) in enumerate(got) if h.flags == RdsFlag.CONG_BITMAP]
            assert maps == [10]
            messages = got[:10] + got[11:]
            assert [payload for _, payload in messages] == sent
            first = messages[0][0].sequence
            for i, (header, payload) in enumerate(messages):
                assert header == RdsHeader(first + i, 0, len(payload), 4000, 7)
            if rds_paths == "c":
                assert through_gate == list(range(10))  # (the first opened it)
            session.check_acks()
            assert conn.direct is None and conn.next_seq == first + 20
            await wait_until(lambda: (session.check_acks(), not conn.unacked)[1], 5, "acks")
            assert conn.counters.send_messages >= 20 and conn.queued_bytes == 0
        await peer.stream.aclose()
        await wait_until(lambda: conn.session is None, 5, "the session's end")
        assert conn.direct is None  # (the gate closed with the session: no stale socket)


async def test_a_waiting_receiver_reads_the_socket_itself_and_lends_it_back() -> None:
    """A task in recvfrom reads the session's socket in place of the reader task (the
    message wakes it directly); once it stops waiting, the reader takes the socket
    back before trio waits for I/O, and messages for other sockets still arrive. A
    message that comes another way (here from the node itself) ends the wait."""
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        with trio.fail_after(5):
            peer, sock, _, session = await started_tcp_session(node)
            got: list[bytes] = []
            lent: list[bool] = []

            async def receive_one() -> None:
                got.append((await sock.recvfrom())[0])
                lent.append(session._loan.active)  # the reader stays parked

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_one)
                await trio.testing.wait_all_tasks_blocked()
                assert session._driving  # the receiver waits on the socket itself
                await peer.send(data_msg(2, b"direct"))
            assert (got, lent) == ([b"direct"], [True])
            assert not session._loan.active  # given back when trio waited for I/O
            other = node.bind(4001)
            await peer.send(data_msg(3, b"for 4001", dport=4001))
            while not other.received:  # noqa: ASYNC110 - a wait on the socket would drive it
                await trio.sleep(0.001)  # (nobody drives: the reader task has the socket)
            assert other.recvfrom_nowait() == (b"for 4001", (LOW, 7))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_one)
                await trio.testing.wait_all_tasks_blocked()
                assert session._driving
                await other.sendto(b"from 4001", (HIGH, 4000))  # not over the socket
            assert got == [b"direct", b"from 4001"]
        await peer.stream.aclose()


async def test_a_ping_pong_looks_at_tcps_acks_when_the_reader_waits_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a ping-pong each end's reader looks at TCP's acknowledgements (a system call)
    when it goes back to waiting, not between the message it read and the answer: when
    an answer reaches the app, its request is still held as unacknowledged, and it is
    let go by the app's next wait (the watching task, slowed down here, never looks).
    (Each round brings in what went through the gate, so every request goes through the
    connection's queue here. The readers block at once: a polling one looks at each
    empty read, before the answer comes.)"""
    monkeypatch.setattr(tcp, "ACK_BACKSTOP", 60.0)
    a, b = await nodes([LOW, HIGH], "tcp", RdsSettings(busy_poll=0.0))
    try:
        sa, sb = a.bind(4000), b.bind(5000)
        held: list[list[int]] = []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def echo() -> None:
                    while True:
                        data, _ = await sb.recvfrom()
                        await sb.sendto(data, (LOW, 4000))

                nursery.start_soon(echo)
                for i in range(50):
                    await sa.sendto(b"%d" % i, (HIGH, 5000))
                    assert await sa.recvfrom() == (b"%d" % i, (HIGH, 5000))
                    rds = a.connections()[0]
                    rds._bring_in()  # (what went through the gate in C: it closes)
                    held.append([m.seq for m in rds.unacked])
                nursery.cancel_scope.cancel()
        # (the first round brings the connection up: what it held is the start's)
        assert all(len(seqs) == 1 for seqs in held[1:]), held
        assert [seqs[0] for seqs in held[1:]] == list(range(held[1][0], held[1][0] + 49))
    finally:
        await close([a, b])


@pytest.mark.parametrize("ending", ["idle", "garbage"])
async def test_a_receiver_driving_a_session_that_ends_waits_on(ending: str) -> None:
    """The session ends while a task reads its socket: closed from our side while the
    peer says nothing (idle expiry), or for a header the peer should never send (a
    length over RDS_MAX_MSG_SIZE, read by that task). The task stops reading the socket
    (it waited on a descriptor of its own, which the session's end closes), nothing is
    delivered, and it takes the message of the next session."""
    settings = RdsSettings(peer_idle_expiry=0.3 if ending == "idle" else 60.0)
    async with RdsNode(HIGH, 0, transport="tcp", settings=settings) as node:
        with trio.fail_after(10):
            peer, sock = await started_session(node)
            got: list[bytes] = []

            async def receive_one() -> None:
                got.append((await sock.recvfrom())[0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive_one)
                await trio.testing.wait_all_tasks_blocked()
                assert sock._driving is not None
                if ending == "garbage":
                    header = bytearray(RdsHeader(2, 0, 16, 7, 4000).encode())
                    struct.pack_into("!I", header, 16, RDS_MAX_MSG_SIZE + 1)
                    await peer.send(bytes(header))
                assert await peer.closed()  # the session ended ...
                await trio.testing.wait_all_tasks_blocked()
                assert sock._driving is None  # ... and the reader left its socket
                again = await raw_connect(node)
                await again.send(data_msg(9, b"next session"))
            assert got == [b"next session"]
        await peer.stream.aclose()
        await again.stream.aclose()


async def test_ping_on_port_0_and_the_handshake_probe_are_answered() -> None:
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        peer = await raw_connect(node)
        with trio.fail_after(5):
            await peer.send(data_msg(1, b"", sport=33, dport=0))  # rds-ping
            header, _ = await peer.receive(lambda h: h.dport == 33)
            assert (header.sport, header.length, header.extensions) == (0, 0, ())
            probe = RdsHeader(
                2, 0, 0, RDS_FLAG_PROBE_PORT, 0, extensions=(NpathsExt(8), GenNumExt(77))
            )
            await peer.send(frame(probe))
            header, _ = await peer.receive(lambda h: h.dport == RDS_FLAG_PROBE_PORT)
            assert header.sport == 0
            assert header.extensions == (NpathsExt(1), GenNumExt(node.generation))
            assert node.connections()[0].peer_generation == 77
            # A ping with source port 0 is no ping (recv.c): no answer, no harm.
            await peer.send(data_msg(3, b"", sport=0, dport=0))
            await peer.send(data_msg(4, b"", sport=34, dport=0))
            header, _ = await peer.receive(lambda h: h.dport in (0, 34) and h.sequence > 1)
            assert header.dport == 34
        await peer.stream.aclose()


async def test_a_new_generation_in_the_probe_is_a_restart() -> None:
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        sock = node.bind(4000)
        peer = await raw_connect(node)
        with trio.fail_after(5):
            for seq, gen in ((1, 77), (2, 77)):  # the same generation twice: nothing new
                probe = RdsHeader(seq, 0, 0, RDS_FLAG_PROBE_PORT, 0, extensions=(GenNumExt(gen),))
                await peer.send(frame(probe))
            await peer.send(data_msg(3, b"before"))
            assert (await sock.recvfrom())[0] == b"before"
            (conn,) = node.connections()
            assert (conn.peer_generation, conn.counters.peer_restarts) == (77, 0)
            await peer.stream.aclose()
            peer = await raw_connect(node)  # the peer came back as a new incarnation
            probe = RdsHeader(1, 0, 0, RDS_FLAG_PROBE_PORT, 0, extensions=(GenNumExt(78),))
            await peer.send(frame(probe))
            # Its numbering starts afresh, even flagged as a resend.
            await peer.send(data_msg(2, b"after", flags=RdsFlag.RETRANSMITTED))
            assert (await sock.recvfrom())[0] == b"after"
            assert conn.peer_generation == 78 and conn.counters.peer_restarts >= 1
        await peer.stream.aclose()


@pytest.mark.parametrize(
    "garbage",
    [
        # h_len over 1 MiB
        struct.pack("!QQI", 1, 0, RDS_MAX_MSG_SIZE + 1) + bytes(RDS_HEADER_LEN - 20),
        # checksum that does not match
        bytes(RdsHeader(1, 0, 0, 7, 4000).with_checksum().encode()[:30]) + b"\x12\x34" + bytes(16),
        # a congestion map of the wrong size
        RdsHeader(0, 0, 10, flags=RdsFlag.CONG_BITMAP).encode() + bytes(10),
    ],
    ids=["h_len", "checksum", "map"],
)
async def test_a_bad_stream_ends_the_connection_not_the_node(garbage: bytes) -> None:
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        sock = node.bind(4000)
        peer = await raw_connect(node)
        with trio.fail_after(5):
            await peer.send(data_msg(1, b"before"))
            assert (await sock.recvfrom())[0] == b"before"
            await peer.send(garbage)
            assert await peer.closed()
            peer = await raw_connect(node)  # the node takes the next connection
            await peer.send(data_msg(2, b"after"))
            assert (await sock.recvfrom())[0] == b"after"
        await peer.stream.aclose()


async def test_retransmitted_duplicates_are_dropped_after_a_reconnect() -> None:
    async with RdsNode(HIGH, 0, transport="tcp") as node:
        sock = node.bind(4000)
        peer = await raw_connect(node)
        with trio.fail_after(5):
            for seq in (1, 2, 3):
                await peer.send(data_msg(seq, b"m%d" % seq))
            assert [(await sock.recvfrom())[0] for _ in range(3)] == [b"m1", b"m2", b"m3"]
            await peer.stream.aclose()
            peer = await raw_connect(node)
            # What TCP acked may come again after a reconnect, flagged: dropped once seen.
            for seq in (2, 3, 4):
                await peer.send(data_msg(seq, b"m%d" % seq, flags=RdsFlag.RETRANSMITTED))
            assert (await sock.recvfrom())[0] == b"m4"
            assert node.connections()[0].counters.recv_drop_old_seq == 2
            assert not sock.received
        await peer.stream.aclose()


@contextlib.asynccontextmanager
async def listening(address: str, port: int) -> AsyncIterator[trio.socket.SocketType]:
    """A plain TCP listener at (``address``, ``port``): a hand-driven RDS peer's."""
    with trio.socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await listener.bind((address, port))
        listener.listen()
        yield listener


async def test_the_lower_address_connects_and_the_higher_knocks() -> None:
    """Our node at the higher address with something to send connects and closes at
    once; the lower one connects back. At the lower address it does the same to a
    knock: closes it and connects."""
    async with listening(LOW, 0) as raw_listener:
        port = raw_listener.getsockname()[1]
        async with RdsNode(HIGH, port, transport="tcp") as node:
            sock = node.bind(4000)
            await sock.sendto(b"to the low one", (LOW, 4000))
            with trio.fail_after(5):
                knock, _ = await raw_listener.accept()
                with knock:
                    assert knock.getpeername()[0] == HIGH
                    assert await knock.recv(10) == b""  # closed at once, nothing sent
                peer = await raw_connect(node)  # the lower address connects back
                _, payload = await peer.receive(is_data)
                assert payload == b"to the low one"
            await peer.stream.aclose()
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        with trio.fail_after(5):
            knocker = await trio.open_tcp_stream(LOW, node.port, local_address=HIGH)
            assert await RawPeer(knocker).closed()  # refused ...
            conn, _ = await high_listener.accept()  # ... and the node connects instead
            with conn:
                assert conn.getpeername()[0] == LOW


TCP_REPAIR = 19
"""``linux/tcp.h``: a socket in repair mode closes without sending FIN or RST."""


async def connected_low_node(
    node: RdsNode, high: trio.socket.SocketType
) -> tuple[RawPeer, RdsSocket]:
    """Have ``node`` (the lower address) connect to the hand-driven higher one listening
    on ``high`` and carry a first message on it; the peer's end and our socket."""
    sock = node.bind(4000)
    await sock.sendto(b"one", (HIGH, 4000))
    first, _ = await high.accept()
    old = RawPeer(trio.SocketStream(first))
    assert (await old.receive(is_data))[1] == b"one"
    return old, sock


async def settled_low_node(
    node: RdsNode, high: trio.socket.SocketType
) -> tuple[RawPeer, RdsSocket]:
    """:func:`connected_low_node`, and the peer has spoken (``hello`` from its port 7 to
    our 4000, taken) and acknowledged our message: nothing of ours waits."""
    old, sock = await connected_low_node(node, high)
    await old.send(data_msg(1, b"hello"))
    assert await sock.recvfrom() == (b"hello", (HIGH, 7))
    (conn,) = node.connections()
    await wait_until(lambda: not conn.pending, 2, "our message acknowledged")
    return old, sock


def is_probe(header: RdsHeader) -> bool:
    return header.sport == RDS_FLAG_PROBE_PORT and header.dport == 0


async def test_a_knock_while_connected_is_checked_with_a_probe_and_the_connection_kept() -> None:
    """A knock on its way while our connection came up (the kernel's send path knocks
    again while its path is down): the live connection answers the probe and stays."""
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        with trio.fail_after(5):
            old, sock = await connected_low_node(node, high_listener)
            knocker = await trio.open_tcp_stream(LOW, node.port, local_address=HIGH)
            assert await RawPeer(knocker).closed()
            header, _ = await old.receive(is_probe)  # the check, on our connection
            assert header.extensions[1] == GenNumExt(node.generation)
            await sock.sendto(b"two", (HIGH, 4000))
            assert (await old.receive(is_data))[1] == b"two"  # still the same one
        (conn,) = node.connections()
        assert conn.counters.sessions == 1
        assert conn.counters.retransmits == 0
        await old.stream.aclose()


async def test_a_knock_from_a_peer_that_lost_its_end_brings_a_new_connection() -> None:
    """The peer lost its end without a word (its socket closed in TCP repair mode sends
    no FIN or RST, as a reboot), then knocks: the probe on our connection meets a reset,
    and we connect anew."""
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        with trio.fail_after(5):
            old, _ = await connected_low_node(node, high_listener)
            old.stream.socket.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
            await old.stream.aclose()  # gone, silently
            knocker = await trio.open_tcp_stream(LOW, node.port, local_address=HIGH)
            assert await RawPeer(knocker).closed()
            second, _ = await high_listener.accept()  # ... and connect anew
            new = RawPeer(trio.SocketStream(second))
            header, _ = await new.receive(is_probe)
            assert header.extensions[1] == GenNumExt(node.generation)
            await new.stream.aclose()
        (conn,) = node.connections()
        assert conn.counters.sessions == 2


async def test_a_connection_the_peer_resets_unanswered_counts_as_refused() -> None:
    """Linux resets a connection from the lower address that arrives while its own
    knock is under way (``rds_tcp_accept_one``), its TCP having acknowledged what we
    wrote: the message goes again on the next connection, flagged, and the session
    counts as refused."""
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        sock = node.bind(4000)
        await sock.sendto(b"once", (HIGH, 4000))
        with trio.fail_after(5):
            first, _ = await high_listener.accept()
            assert await first.recv(1)  # the session is up, writing
            first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            first.close()  # a reset, before a word
            second, _ = await high_listener.accept()
            new = RawPeer(trio.SocketStream(second))
            header, payload = await new.receive(lambda h: h.dport == 4000)
            assert (payload, header.flags) == (b"once", RdsFlag.RETRANSMITTED)
            await new.send(frame(RdsHeader(1, 0, 0, 4000, 4000)))
            assert (await sock.recvfrom())[0] == b""
        (conn,) = node.connections()
        assert (conn.counters.sessions, conn.counters.sessions_refused) == (2, 1)
        await new.stream.aclose()


async def test_the_lower_address_connects_again_after_a_drop_with_nothing_to_send() -> None:
    """Linux's higher address never connects again by itself after its path drops: it
    holds what it had not delivered and waits for the lower one, knocking only when it
    sends anew (``threads.c`` ``rds_queue_reconnect``). Our node at the lower address,
    with nothing of its own waiting, connects again all the same, as Linux's does: the
    peer's message that was on its way when the connection broke arrives."""
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        with trio.fail_after(5):
            old, sock = await settled_low_node(node, high_listener)
            reset(old.stream.socket)  # its path drops, "second" still held
            second, _ = await high_listener.accept()
            new = RawPeer(trio.SocketStream(second))
            await new.receive(is_probe)
            await new.send(data_msg(2, b"second", flags=RdsFlag.RETRANSMITTED))
            assert await sock.recvfrom() == (b"second", (HIGH, 7))
        (conn,) = node.connections()
        assert (conn.counters.sessions, conn.counters.sessions_refused) == (2, 0)
        await new.stream.aclose()


async def test_a_refused_connection_is_tried_again_with_no_knock_after_it() -> None:
    """A knock asks us to connect; the peer resets our connection before a word (its
    own knock's teardown still under way, ``tcp_listen.c`` ``rds_tcp_accept_one``) and
    never knocks again (its sender waits for room in a queue only a connection
    empties). We connect again, backing off, until one is taken."""
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        sock = node.bind(4000)
        with trio.fail_after(5):
            knocker = await trio.open_tcp_stream(LOW, node.port, local_address=HIGH)
            assert await RawPeer(knocker).closed()
            first, _ = await high_listener.accept()
            assert await first.recv(1)  # our session is up, writing
            reset(first)
            second, _ = await high_listener.accept()
            new = RawPeer(trio.SocketStream(second))
            await new.receive(is_probe)
            await new.send(data_msg(1, b"at last"))
            assert await sock.recvfrom() == (b"at last", (HIGH, 7))
        (conn,) = node.connections()
        assert (conn.counters.sessions, conn.counters.sessions_refused) == (2, 1)
        await new.stream.aclose()


async def test_resends_across_the_peers_numbering_restart_are_taken_once() -> None:
    """Linux numbers from 1 again when it learns we restarted (our probe's generation,
    ``recv.c`` ``rds_conn_peer_gen_update``), while messages it numbered before still
    wait in its queue and go after that: 250, 251, 252, then 1, 2. The connection
    breaks before TCP acknowledged 252, 1 and 2, so they come again, flagged, with 3 that
    never arrived: 252 is a duplicate though it lies above the new numbers (Linux
    would take it, then drop 3 as old), and 3 is new though it lies below 252."""
    async with (
        RdsNode(LOW, 0, transport="tcp") as node,
        listening(HIGH, node.port) as high_listener,
    ):
        with trio.fail_after(5):
            old, sock = await connected_low_node(node, high_listener)
            first = [(250, b"k0"), (251, b"k1"), (252, b"k2"), (1, b"k3"), (2, b"k4")]
            for seq, payload in first:
                await old.send(data_msg(seq, payload))
            assert [(await sock.recvfrom())[0] for _ in first] == [p for _, p in first]
            reset(old.stream.socket)
            second, _ = await high_listener.accept()  # the lower address connects again
            new = RawPeer(trio.SocketStream(second))
            await new.receive(is_probe)
            for seq, payload in [(252, b"k2"), (1, b"k3"), (2, b"k4"), (3, b"k5")]:
                await new.send(data_msg(seq, payload, flags=RdsFlag.RETRANSMITTED))
            await new.send(data_msg(4, b"k6"))
            assert [(await sock.recvfrom())[0] for _ in range(2)] == [b"k5", b"k6"]
            await trio.testing.wait_all_tasks_blocked()
            assert not sock.received
        (conn,) = node.connections()
        assert (conn.counters.recv_drop_old_seq, conn.counters.peer_restarts) == (3, 1)
        await new.stream.aclose()


async def test_connecting_again_after_a_drop_ends_when_the_peer_is_idle_too_long(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer gone for good (nothing listens any more) is tried until it has been idle
    for ``peer_idle_expiry``; then the node stops and forgets it, as any idle peer."""
    caplog.set_level(logging.INFO, logger="rdmashim.ulps.rds")
    settings = RdsSettings(peer_idle_expiry=0.5, reconnect_max=0.1)
    async with node_whose_peer_went(settings) as node:
        with trio.fail_after(5):
            await wait_until(lambda: node.peers_expired == 1, 4, "the peer forgotten")
        assert not node._peers and node.peers_expired == 1
        assert f"RDS connect to {HIGH} failed" in caplog.text  # it was tried again


async def test_a_knock_ends_the_wait_between_attempts_to_connect_again() -> None:
    """The peer's RDS went (rmmod rds_tcp: nothing listens) and our attempts to connect
    again wait longer and longer between them; when it is back and knocks, we connect
    at once, not when the wait ends."""
    settings = RdsSettings(reconnect_min=5.0, reconnect_max=5.0)
    async with node_whose_peer_went(settings) as node:
        await trio.sleep(0.5)  # refused at once, then a wait of 2.5 to 5 s
        async with listening(HIGH, node.port) as high_listener:
            knocker = await trio.open_tcp_stream(LOW, node.port, local_address=HIGH)
            with trio.fail_after(1):
                assert await RawPeer(knocker).closed()
                second, _ = await high_listener.accept()
            with second:
                assert second.getpeername()[0] == LOW


@contextlib.asynccontextmanager
async def node_whose_peer_went(settings: RdsSettings) -> AsyncIterator[RdsNode]:
    """A node at LOW whose settled session with the hand-driven peer at HIGH was reset,
    with nothing listening at HIGH any more (the peer's RDS went)."""
    async with RdsNode(LOW, 0, transport="tcp", settings=settings) as node:
        async with listening(HIGH, node.port) as high_listener:
            with trio.fail_after(5):
                old, _ = await settled_low_node(node, high_listener)
        reset(old.stream.socket)
        yield node


def reset(raw: socket.socket | trio.socket.SocketType) -> None:
    """Close with a reset (SO_LINGER 0), as Linux's RDS refuses or drops a connection."""
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()


async def test_simultaneous_sends_from_both_sides_build_one_connection() -> None:
    a, b = await nodes([LOW, HIGH], "tcp")
    try:
        sa, sb = a.bind(4000), b.bind(4000)
        n = 200
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for src, dst in ((sa, HIGH), (sb, LOW)):

                    async def blast(src: object = src, dst: str = dst) -> None:
                        for i in range(n):
                            await src.sendto(b"%d" % i, (dst, 4000))  # type: ignore[attr-defined]

                    nursery.start_soon(blast)
            got_b = [int((await sb.recvfrom())[0]) for _ in range(n)]
            got_a = [int((await sa.recvfrom())[0]) for _ in range(n)]
        assert got_a == got_b == list(range(n))
        assert not sa.received and not sb.received
        for node in (a, b):
            (conn,) = node.connections()
            assert conn.session is not None and not conn.session.lost
            assert conn.counters.sessions == 1
    finally:
        await close([a, b])


async def test_reconnect_under_a_flow_with_resets_loses_and_doubles_nothing() -> None:
    a, b = await nodes([LOW, HIGH], "tcp")
    try:
        sa, sb = a.bind(4000), b.bind(4000)
        n, cuts = 5000, 0
        got: list[int] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:

                async def receive() -> None:
                    while len(got) < n:
                        got.append(int((await sb.recvfrom())[0]))

                nursery.start_soon(receive)
                for i in range(n):
                    await sa.sendto(b"%d" % i, (HIGH, 4000))
                    if i % 1000 == 500:
                        while True:  # a live session to cut
                            session = a.connections()[0].session
                            if session is not None and not session.lost:
                                break
                            await trio.sleep(0.005)
                        # A reset from the sending side: SO_LINGER 0, then close. (From
                        # the receiving side, what its TCP acknowledged and its node had
                        # not read yet would be lost: see docs/rds.md.)
                        raw = session.stream.socket  # type: ignore[union-attr]
                        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        raw.close()
                        cuts += 1
                    if i % 50 == 0:
                        await trio.lowlevel.checkpoint()
        assert got == list(range(n))
        assert cuts == 5
        assert a.connections()[0].counters.sessions >= 2
    finally:
        await close([a, b])


async def test_rdma_is_refused_over_tcp_naming_the_transport() -> None:
    a, b = await nodes([LOW, HIGH], "tcp")
    try:
        s = a.bind(4000)
        with pytest.raises(RdsError, match="over tcp") as info:
            s.get_mr(bytearray(4096))
        assert info.value.errno == errno.EOPNOTSUPP
        with pytest.raises(RdsError, match="over tcp"):
            await s.sendto(b"x", (HIGH, 4000), rdma=RdmaOp.write_to(1 << 32, b"abc"))
        with pytest.raises(ValueError, match="neither"):
            RdsNode(LOW, transport="udp")  # type: ignore[arg-type]
    finally:
        await close([a, b])


# ----------------------------------------------------------------------- bounds
async def test_tcp_strangers_are_bounded_by_max_peers_and_expire() -> None:
    """Strangers from 40 lower addresses each connect, send a message and go:
    ``max_peers`` holds the entries to 8 meanwhile and ``peer_idle_expiry`` clears
    them. A new peer beyond
    ``max_peers`` with none idle is refused (closed) and a send to one is ENOBUFS."""
    settings = RdsSettings(max_peers=8, peer_idle_expiry=0.5)
    node_ip = "127.0.0.200"
    async with RdsNode(node_ip, 0, transport="tcp", settings=settings) as node:
        inbox = node.bind(5000)
        with trio.fail_after(60):
            for i in range(40):
                ip = f"127.0.0.{i + 2}"
                stream = await trio.open_tcp_stream(node_ip, node.port, local_address=ip)
                async with stream:
                    await stream.send_all(data_msg(1, b"hi", sport=9, dport=5000))
                    assert await inbox.recvfrom() == (b"hi", (ip, 9))
                assert len(node._peers) <= settings.max_peers
            await wait_for(lambda: not node._peers, 5)
        assert node.peers_expired == 40
    settings = RdsSettings(max_peers=2)
    async with RdsNode(node_ip, 0, transport="tcp", settings=settings) as node:
        with trio.fail_after(20):
            held = [
                RawPeer(await trio.open_tcp_stream(node_ip, node.port, local_address=ip))
                for ip in ("127.0.0.2", "127.0.0.3")
            ]
            for peer in held:
                await peer.receive()  # the node's map: the session is up
            refused = RawPeer(
                await trio.open_tcp_stream(node_ip, node.port, local_address="127.0.0.4")
            )
            assert await refused.closed()
            with pytest.raises(RdsError, match="max_peers") as info:
                await node.bind(4000).sendto(b"x", ("127.0.0.9", 4000))
            assert info.value.errno == errno.ENOBUFS
            for peer in held:
                await peer.stream.aclose()


TCP_HEAP_PER_CONNECTION = 4 * 1024
"""Python heap 300 strangers may leave per connection (interned strings, caches), as the
RDMA transport's soak allows (tests/test_rds_bounds.py)."""


async def test_tcp_strangers_leave_no_session_and_no_heap_behind() -> None:
    """300 strangers connect over TCP, send a message and go; once their entries
    expire no RDS connection or TCP session is left, and the Python heap is back
    where it was after the first 30 (tracemalloc)."""
    settings = RdsSettings(peer_idle_expiry=0.3)
    node_ip = "127.0.9.200"  # above every stranger: their connections carry the traffic
    async with RdsNode(node_ip, 0, transport="tcp", settings=settings) as node:
        inbox = node.bind(5000)
        with trio.fail_after(120):
            for i in range(330):
                if i == 30:  # allocators and caches settled: the baseline
                    gc.collect()
                    tracemalloc.start()
                ip = f"127.0.{2 + i // 250}.{2 + i % 250}"
                stream = await trio.open_tcp_stream(node_ip, node.port, local_address=ip)
                async with stream:
                    await stream.send_all(data_msg(1, b"hi", sport=9, dport=5000))
                    assert await inbox.recvfrom() == (b"hi", (ip, 9))
            await wait_for(lambda: not node._peers, 10)
        gc.collect()
        heap = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        print(f"RDS/TCP soak: {heap // 300} heap bytes kept per connection")
        alive = [o for o in gc.get_objects() if isinstance(o, RdsConnection | TcpSession)]
        assert alive == []
        assert node.peers_expired == 330
        assert heap / 300 < TCP_HEAP_PER_CONNECTION, heap


async def test_tcp_idle_session_is_closed_and_maps_wait_as_one() -> None:
    async with RdsNode(
        HIGH, 0, transport="tcp", settings=RdsSettings(peer_idle_expiry=0.5)
    ) as node:
        peer = await raw_connect(node)
        with trio.fail_after(10):
            await peer.receive()
            start = trio.current_time()
            assert await peer.closed()
            assert trio.current_time() - start >= 0.4
        await peer.stream.aclose()
        # Maps go outside the sequence: of several waiting, the newest only.
        rds = RdsConnection(node.address, ipaddress.ip_address(LOW), lambda *a: None)
        for i in range(100):
            rds.queue_map(bytes([i]) * RDS_CONG_MAP_BYTES)
        assert rds.map_out == bytes([99]) * RDS_CONG_MAP_BYTES and not rds.unsent
        assert rds.counters.cong_updates_sent == 100


async def wait_for(condition: object, seconds: float) -> None:
    with trio.fail_after(seconds):
        while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - plain state
            await trio.sleep(0.01)
