"""RDS's plain-message path in C (``ulps/rds/_plain.c``) against the Python path it is
held to.

The same completions over the same receive buffers go to two worlds, each a real node
(its deliver, its sockets and their inboxes), an :class:`RdsConnection` and an
:class:`RdmaFlow`: one takes every row the Python way (``RdmaFlow.receive_at``), the
other through :meth:`PlainReceiver.take` (runs of plain messages in C, the rest the
Python way). Everything either leaves must be the same: the sockets' messages, drops
and congestion, the sequence numbers, credits, acknowledgements and counters, the
buffers to post again, and the protocol error that ends the session, at the same row.
Hostile headers (numbers out of turn, lengths that lie, flags, checksums, extension
headers, unbound ports, pings, sockets over their bounds) come from hypothesis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmashim.ulps.rds import plain
from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.node import RdsNode
from rdmashim.ulps.rds.plain import SendRing
from rdmashim.ulps.rds.rdma import RdmaOp, Registrations, make_cookie
from rdmashim.ulps.rds.rdma_flow import ACK_REQUIRED_EVERY, RECV_SLOTS, RdmaFlow
from rdmashim.ulps.rds.rdma_session import C_SEND_WR, SLOT
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.tcp_stream import StreamDecoder
from rdmashim.ulps.rds.wire import HEADER_STRUCT, RDS_FRAG_SIZE, RDS_HEADER_LEN, RdsProtocolError
from rdmashim.verbs import SGE, WC_ROW, WCOpcode, WCStatus

needs_c = pytest.mark.skipif(
    plain.COMPILED is None, reason=f"RDS's plain-message path in C is not built: {plain.WHY_NOT}"
)

LOCAL = ipaddress.ip_address("10.0.0.1")
PEER = ipaddress.ip_address("10.0.0.2")
BOUND = (4000, 4001)
FIRST = 1000
"""The number the peer's messages start at (the connection has heard it before)."""
RCVBUF = 256
LIMIT = 512


@pytest.fixture(autouse=True)
def _restore_choice() -> Iterator[None]:
    before = plain.compiled()
    yield
    plain.use(before)


@dataclasses.dataclass
class Row:
    """One completion and, for a receive, the bytes in its buffer."""

    status: int = 0
    opcode: int = int(WCOpcode.RECV)
    header: tuple[Any, ...] = ()
    payload: bytes = b""
    byte_len: int | None = None
    """The completion's length when it differs from header and payload's."""


class Used(Registrations):
    """A socket's registrations (none here) that note each R_Key a message chases; the
    first socket's count a use-once one (so a chaser there is handed on to end it), the
    other's none (a chaser there ends nothing: neither path looks)."""

    def __init__(self, port: int, log: list[tuple[int, int]], counts: Any) -> None:
        super().__init__(counts)
        counts.use_once = int(port == BOUND[0])
        self.port, self.log = port, log

    def used(self, rkey: int) -> None:
        self.log.append((self.port, rkey))
        super().used(rkey)


class World:
    """A node with two bound sockets and a connection to one peer, taking rows."""

    def __init__(self, compiled: bool) -> None:
        plain.use(compiled)
        self.node = RdsNode(str(LOCAL), settings=RdsSettings(rcvbuf=RCVBUF, rcvbuf_limit=LIMIT))
        self.socks = [self.node.bind(port) for port in BOUND]
        self.used: list[tuple[int, int]] = []
        """(port, R_Key) of each registration marked used by a message chasing it."""
        for sock in self.socks:
            sock._registrations = Used(sock.port, self.used, sock.received.counts)
        self.rds = RdsConnection(
            LOCAL, PEER, self.node._deliver, next_seq=1, next_recv=FIRST, heard=True
        )
        for n in range(4):  # our messages the peer has not acknowledged yet
            self.rds.queue(BOUND[0], 7, b"ours %d" % n)
            self.rds.unacked.append(self.rds.unsent.popleft())
        path = self.node._table.plain if compiled else None
        self.flow = RdmaFlow(self.rds, None if path is None else path.flow_state())
        self.recv = bytearray(SLOT * RECV_SLOTS)
        self.reposts: list[int] = []
        self.others: list[int] = []
        """The work request ids of the rows that were not receives."""
        self.error = ""
        self.receiver = None
        self.sends = bytearray(SLOT * 4)
        """The send buffers of plain messages sent in C."""
        if compiled:
            assert path is not None
            # (no native handler here: the rows come to take(); the SGEs go unused)
            sge = SGE(0, SLOT, 0)
            ring = SendRing(self.sends, sge, 4, C_SEND_WR, 128, 16, ACK_REQUIRED_EVERY)
            self.receiver = path.receiver(self.rds, self.flow, self.recv, SLOT, sge, 16, ring)

    def completion(self, wr_id: int, status: WCStatus, opcode: int, length: int) -> None:
        """What a session does with a row that is not plain (its receive part)."""
        if status != WCStatus.SUCCESS or opcode != WCOpcode.RECV:
            self.others.append(wr_id)
            return
        self.reposts.append(wr_id)
        self.flow.receive_at(memoryview(self.recv), wr_id * SLOT, length)

    def take(self, rows: list[Row]) -> None:
        packed = bytearray()
        for slot, row in enumerate(rows):
            length = 0
            if row.header:
                HEADER_STRUCT.pack_into(self.recv, slot * SLOT, *row.header)
                start = slot * SLOT + RDS_HEADER_LEN
                self.recv[start : start + len(row.payload)] = row.payload
                length = RDS_HEADER_LEN + len(row.payload)
            if row.byte_len is not None:
                length = row.byte_len
            packed += WC_ROW.pack(slot, row.status, row.opcode, length, 1, 0, 0, 0)
        try:
            if self.receiver is None:
                for slot, row in enumerate(rows):
                    length = WC_ROW.unpack_from(packed, slot * WC_ROW.size)[3]
                    self.completion(slot, WCStatus(row.status), row.opcode, length)
            else:
                self.receiver.rows[: len(packed)] = packed
                self.receiver.take(len(rows), self.completion, self.reposts)
        except RdsProtocolError as exc:
            self.error = str(exc)

    def state(self) -> dict[str, object]:
        """Everything the rows may have changed."""
        return {
            "messages": [list(sock.received) for sock in self.socks],
            "queued": [sock.queued_bytes for sock in self.socks],
            "holding": self.node._inboxes.counts.holding,
            "congested": [p for p in BOUND if self.node.congestion.test(p)],
            "drops": (self.node.drops_no_socket, self.node.drops_rcvbuf_full),
            "next_recv": self.rds.next_recv,
            "heard": self.rds.heard,
            "unacked": [m.seq for m in self.rds.unacked],
            "counters": dataclasses.asdict(self.rds.counters),
            "credits": self.flow.state.send_credits,
            "talk": self.flow.talk,
            "assembly": self.flow.assembly is not None,
            "reposts": self.reposts,
            "others": self.others,
            "used": self.used,
            "error": self.error,
        }


def both(rows: list[Row]) -> tuple[dict[str, object], dict[str, object]]:
    worlds = World(False), World(True)
    for world in worlds:
        world.take(rows)
    return worlds[0].state(), worlds[1].state()


def header(seq: int, sport: int, dport: int, payload: bytes, **fields: Any) -> tuple[Any, ...]:
    values = {
        "ack": 0, "length": len(payload), "flags": 0, "credit": 0, "csum": 0, "ext": b"",
    } | fields  # fmt: skip
    return (
        seq, values["ack"], values["length"], sport, dport, values["flags"], values["credit"],
        values["csum"], values["ext"],
    )  # fmt: skip


def plain_row(seq: int, dport: int = BOUND[0], payload: bytes = b"hello", **fields: Any) -> Row:
    return Row(header=header(seq, 9, dport, payload, **fields), payload=payload)


@needs_c
def test_a_steady_exchange_is_taken_in_c_as_python_takes_it() -> None:
    rows = [plain_row(FIRST + i, BOUND[i % 2], b"m%d" % i, ack=0, credit=2) for i in range(40)]
    rows.insert(5, Row(opcode=int(WCOpcode.SEND)))  # a Send's completion among them
    python, c = both(rows)
    assert python == c
    assert len(c["messages"][0]) == 20 and c["next_recv"] == FIRST + 40  # type: ignore[index]
    assert c["reposts"] == [i for i in range(41) if i != 5]


@needs_c
def test_what_c_leaves_to_python_comes_out_the_same() -> None:
    rows = [
        plain_row(FIRST),
        plain_row(FIRST + 1, dport=5000),  # no socket: dropped (Python logs it)
        plain_row(FIRST + 2, dport=0),  # a ping
        plain_row(FIRST + 5),  # out of turn
        plain_row(FIRST + 6, flags=0x04),  # retransmitted
        plain_row(FIRST + 8, payload=b"x" * 300),  # over rcvbuf: congested
        plain_row(FIRST + 9, payload=b"y" * 300),  # over rcvbuf_limit: dropped
        Row(header=header(0, 0, 0, b"", ack=FIRST + 3, credit=5)),  # a bare ack
        plain_row(FIRST + 10, dport=BOUND[1], ack=99_999_999_999, credit=255),
        plain_row(FIRST + 11, ext=b"\x02\x00\x00\x12\x34"),  # chasing R_Key 0x1234
        plain_row(FIRST + 12, csum=1),  # a checksum (that does not match: the end)
    ]
    python, c = both(rows)
    assert python == c
    assert c["drops"] == (1, 1) and c["congested"] == [BOUND[0]]
    assert c["used"] == [(BOUND[0], 0x1234)]
    assert "checksum" in c["error"]  # type: ignore[operator]


@needs_c
def test_rows_while_a_message_is_assembled_stay_pythons() -> None:
    """A header whose length says more than its Send holds starts an assembly of
    fragments: the next rows are its fragments, not messages, even when one looks plain
    (hypothesis found the C path taking it as one)."""
    rows = [
        Row(header=header(FIRST, 9, BOUND[0], b"", length=1)),
        Row(header=header(FIRST, 9, BOUND[0], b"")),
        plain_row(FIRST + 1),
    ]
    python, c = both(rows)
    assert python == c
    assert c["assembly"] and c["next_recv"] == FIRST and c["messages"] == [[], []]


@needs_c
def test_a_broken_header_ends_the_session_at_the_same_row() -> None:
    rows = [
        plain_row(FIRST),
        Row(header=header(FIRST + 1, 9, BOUND[0], b"abc", length=2), payload=b"abc"),
        plain_row(FIRST + 2),
    ]
    python, c = both(rows)
    assert python == c
    assert c["error"] and c["next_recv"] == FIRST + 1


_EXTENSIONS = [
    b"", b"", b"", b"\x02\x00\x00\x00\x07", b"\x02\x00\x00\x00\x07\x01\x00\x00\x00\x01",
    b"\x01\x00\x00\x00\x07", b"\x03\x00", b"\xff",
]  # fmt: skip
"""Extension areas: none, the RDMA one (R_Key 7) alone or before another, a version one,
an RDMA destination cut short, a type unknown."""
_ports = st.sampled_from([BOUND[0], BOUND[1]] * 4 + [0, 1, 9, 5000, 65535])
"""Mostly the bound ports, sometimes a ping's, the probe's or ports with no socket."""


@st.composite
def _rows(draw: st.DrawFn, seq: int) -> Row:
    """A row of any kind: mostly a received message numbered ``seq``, some Sends,
    failures, short ones, and headers whose length lies."""
    kind = draw(st.sampled_from(["message"] * 6 + ["send", "flushed", "short", "lying"]))
    if kind == "send":
        return Row(opcode=int(WCOpcode.SEND))
    if kind == "flushed":
        return Row(status=int(WCStatus.WR_FLUSH_ERR))
    if kind == "short":
        return Row(byte_len=draw(st.integers(0, RDS_HEADER_LEN - 1)))
    payload = draw(st.binary(max_size=320))
    length = len(payload) + (draw(st.integers(1, 5000)) if kind == "lying" else 0)
    fields = {
        "ack": FIRST + draw(st.integers(-6, 8)),
        "flags": draw(st.sampled_from([0, 0, 0, 1, 2, 4, 0x20, 0xFF])),
        "credit": draw(st.integers(0, 255)),
        "csum": draw(st.sampled_from([0] * 6 + [1])),
        "ext": draw(st.sampled_from(_EXTENSIONS)),
        "length": length,
    }
    sport = draw(st.sampled_from([9, 9, 9, 0, 1]))
    return Row(header=header(seq, sport, draw(_ports), payload, **fields), payload=payload)


@st.composite
def _polls(draw: st.DrawFn) -> list[Row]:
    """A poll's rows, the messages mostly numbered on from the last (a step back or
    ahead now and then)."""
    rows, seq = [], FIRST
    for _ in range(draw(st.integers(0, 24))):
        seq += draw(st.sampled_from([0] * 8 + [-3, -1, 1, 6]))
        row = draw(_rows(seq))
        rows.append(row)
        seq += bool(row.header)
    return rows


@needs_c
@settings(max_examples=300, deadline=None)
@given(_polls())
def test_any_rows_leave_both_paths_in_the_same_state(rows: list[Row]) -> None:
    python, c = both(rows)
    assert python == c


def streamed(how: str, rows: list[Row], cuts: list[int]) -> dict[str, object]:
    """What a node's RDS/TCP session leaves after the messages of ``rows`` (their headers
    and payloads back to back: a length that lies takes the bytes after it) come in
    pieces cut at ``cuts``: taken by the stream decoder (``how``: ``python``, or ``scan``:
    the plain ones in C), or (``read``) read from a real socket as the session reads it
    (in C while the decoder holds nothing: :meth:`.PlainStream.read`)."""
    world = World(how != "python")
    path = world.node._table.plain
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        plain = path.stream(world.rds, ours.fileno()) if path is not None else None
        decoder = StreamDecoder(plain)
        stream = b"".join(
            HEADER_STRUCT.pack(*row.header) + row.payload for row in rows if row.header
        )
        edges = [0, *sorted(cut % (len(stream) + 1) for cut in cuts), len(stream)]
        try:
            for start, end in itertools.pairwise(edges):
                if how != "read":
                    decoder.take(stream[start:end], world.rds.received)
                    continue
                assert plain is not None
                theirs.sendall(stream[start:end])
                with contextlib.suppress(BlockingIOError):
                    while True:  # (as TcpSession._read, till the socket is empty)
                        plain.read(decoder, world.rds.received)
        except RdsProtocolError as exc:
            world.error = str(exc)
    # (a refused message ends the session: what the decoder still holds then is moot)
    return world.state() | {"buffered": decoder.buffered if world.error is None else None}


@needs_c
@settings(max_examples=300, deadline=None)
@given(_polls(), st.lists(st.integers(0, 1 << 16), max_size=6))
def test_any_stream_leaves_both_paths_in_the_same_state(rows: list[Row], cuts: list[int]) -> None:
    """RDS/TCP: the same bytes, cut anywhere, leave a node the same on both paths
    (``rp_stream`` takes the whole plain messages at the front, Python the rest), and
    so do they read from a socket in C (``rp_stream_read``)."""
    python = streamed("python", rows, cuts)
    assert streamed("scan", rows, cuts) == python
    assert streamed("read", rows, cuts) == python


@needs_c
def test_a_read_in_c_never_begins_inside_a_message() -> None:
    """A message cut just after its header, whose payload looks like that same message's
    header (plain, numbered next, for a bound port): the decoder holds the header and no
    bytes, and the next read must go to it, not to C, which would take the payload for a
    message. Read from a socket, the node ends as Python's path leaves it."""
    lookalike = HEADER_STRUCT.pack(FIRST, 0, 0, 9, BOUND[1], 0, 0, 0, b"")
    rows = [plain_row(FIRST, BOUND[0], lookalike), plain_row(FIRST + 1, BOUND[1], b"abc")]
    python = streamed("python", rows, [RDS_HEADER_LEN])
    assert [len(box) for box in python["messages"]] == [1, 1]  # type: ignore[arg-type]
    assert streamed("read", rows, [RDS_HEADER_LEN]) == python


@needs_c
def test_a_steady_stream_is_taken_in_c() -> None:
    """A run of plain messages over TCP goes to the sockets in C, none through Python's
    delivery, however the bytes are cut."""
    rows = [plain_row(FIRST + i, BOUND[i % 2], b"m%d" % i) for i in range(30)]
    world = World(True)
    delivered: list[int] = []
    world.node._deliver = lambda *args: delivered.append(args[1])  # type: ignore[method-assign]
    assert world.node._table.plain is not None
    decoder = StreamDecoder(world.node._table.plain.stream(world.rds, -1))  # (no socket)
    stream = b"".join(HEADER_STRUCT.pack(*row.header) + row.payload for row in rows)
    count = sum(
        decoder.take(stream[i : i + 77], world.rds.received) for i in range(0, len(stream), 77)
    )
    assert count == 30 and delivered == [] and world.rds.next_recv == FIRST + 30
    assert [len(sock.received) for sock in world.socks] == [15, 15]
    assert world.rds.counters.recv_messages == 30 and decoder.buffered == 0


def sent_in(
    compiled: bool, counts: tuple[int, int, bool, int], behind: int, data: bytes,
    write: RdmaOp | None = None,
) -> Any:  # fmt: skip
    """One message queued alone on a flow with these counters (credits, receives to grant,
    flow control, messages before the next asks for an ack), the peer's ``behind`` more
    messages unacknowledged, chasing the RDMA ``write`` if any: what Python's ``fill``
    writes, or ``rp_send`` (``rp_send_write``; None: it would not), and the counters after
    (and the Write C keeps for the message's buffer)."""
    world = World(compiled)
    state = world.flow.state
    state.send_credits, state.advertise, state.flow_control, state.ack_countdown = counts
    state.acked_to_peer = FIRST - 1 - behind
    world.rds.next_recv = FIRST
    world.rds.queue(BOUND[0], 7, data, rdma=write)
    msg = world.rds.unsent[0]
    source = (0x7000, 0x77)  # (the Write's local buffer, as registered)
    posted: tuple[int, ...] = ()
    if world.receiver is None:
        buf = bytearray(SLOT)
        n = world.flow.fill(buf, 0)
        out = bytes(buf[:n]) if n and len(data) <= RDS_FRAG_SIZE else None
        assert out is None or (world.flow.last and not world.flow.fence)  # (C's Send: SE)
        if out is not None and write is not None:
            assert world.flow.rdma_op is write
            posted = (source[0], write.remote_addr, write.length, source[1], write.rkey)
    else:
        world.receiver.release()  # (what a session's handler leaves: C's next_recv is ours)
        if write is None:
            took = world.receiver.send(msg.seq, msg.sport, msg.dport, data, len(data))
        else:
            took = world.receiver.send_write(
                msg.seq, msg.sport, msg.dport, data, len(data), *source, write.length,
                write.remote_addr, write.rkey,
            )  # fmt: skip
            w = world.receiver.hook.writes[0]
            if took:
                posted = (w.addr, w.remote_addr, w.length, w.lkey, w.rkey)
        out = bytes(world.sends[: RDS_HEADER_LEN + len(data)]) if took else None
        assert world.receiver.hook.staged == took
    after = (
        state.send_credits, state.advertise, state.acked_to_peer, state.ack_at,
        state.ack_countdown,
    )  # fmt: skip
    return out, (after if out is not None else None), posted


@needs_c
@settings(max_examples=200, deadline=None)
@given(
    st.tuples(st.integers(0, 4), st.integers(0, 600), st.booleans(), st.integers(0, 7)),
    st.integers(0, 3),
    st.sampled_from([0, 1, 100, RDS_FRAG_SIZE, RDS_FRAG_SIZE + 1]),
)
def test_a_plain_message_sent_in_c_is_the_one_python_sends(
    counts: tuple[int, int, bool, int], behind: int, length: int
) -> None:
    """``rp_send`` writes the bytes ``RdmaFlow.fill`` writes for a message queued alone
    (header, our ack and credits, payload) and leaves the flow's counters as it does; it
    takes exactly the messages Python would send whole now (not one in fragments, nor
    one for which no credit is left)."""
    data = bytes(range(256)) * (length // 256) + bytes(length % 256)
    assert sent_in(True, counts, behind, data) == sent_in(False, counts, behind, data)


@needs_c
@settings(max_examples=100, deadline=None)
@given(
    st.tuples(st.integers(0, 4), st.integers(0, 600), st.booleans(), st.integers(0, 7)),
    st.sampled_from([0, 16, RDS_FRAG_SIZE + 1]),
    st.integers(1, 1 << 20),
    st.integers(0, (1 << 32) - 1),
    st.integers(0, (1 << 32) - 1),
)
def test_a_message_chasing_a_write_sent_in_c_is_the_one_python_sends(
    counts: tuple[int, int, bool, int], length: int, size: int, rkey: int, offset: int
) -> None:
    """``rp_send_write`` writes the header ``RdmaFlow.fill`` writes for a message chasing
    an RDMA Write (the R_Key in its RDMA extension) and keeps the Write Python would post
    before it: the same local buffer, peer address, length and R_Key."""
    data = bytes(length)
    cookie = make_cookie(rkey, 0x10000)
    write = RdmaOp.write_to(cookie, bytes(size), offset=offset)
    c, python = (sent_in(flag, counts, 0, data, write) for flag in (True, False))
    assert c == python


def sendtos(
    direct: bool, messages: list[tuple[int, int, int]], bounds: tuple[int, int],
    congested: int, flow_control: bool,
) -> Any:  # fmt: skip
    """Messages (port, length, the RDMA Write it chases: its length, 0 none) a socket
    sends to the peer with nothing else queued: each through the gate of sendto in one
    call into C (``rp_sendto``, ``rp_sendto_write``), or as Python's sendto decides (room,
    congestion, size; then ``rp_send`` or ``rp_send_write`` at the connection's next
    number); whether each went, the send buffers, the Writes kept for them and the
    connection's state after (the gate's messages brought in)."""
    world = World(True)
    receiver = world.receiver
    assert receiver is not None
    world.rds.settings = RdsSettings(sndbuf=bounds[0], max_queued_messages=bounds[1])
    world.rds.peer_congestion.set(congested)
    state = world.flow.state
    state.send_credits, state.flow_control = 3, flow_control
    receiver.release()
    if direct:
        receiver.open()
    rds, went, writes = world.rds, [], []
    source = (0x7000, 0x77)  # (the Write's local buffer, as registered)
    for n, (port, length, size) in enumerate(messages):
        data = bytes([n]) * length
        op = RdmaOp.write_to(make_cookie(n, 0x10000), bytes(size), offset=n) if size else None
        args = () if op is None else (*source, size, op.remote_addr, op.rkey)
        if direct:
            call = receiver._lib.rp_sendto if op is None else receiver._lib.rp_sendto_write
            took = call(receiver.hook, BOUND[0], port, data, length, *args)
            if took:
                receiver.log.append((BOUND[0], port, data, op))
        else:
            call = receiver.send if op is None else receiver.send_write
            took = (
                rds.has_room and not rds.peer_congestion.test(port)
                and length <= min(bounds[0], 1 << 20)
                and call(rds.next_seq, BOUND[0], port, data, length, *args)
            )  # fmt: skip
            if took:
                rds.sent(BOUND[0], port, data, op)
        went.append(bool(took))
        w = receiver.hook.writes[(receiver.hook.send_head - 1) % 4]
        writes.append((w.addr, w.remote_addr, w.length, w.lkey, w.rkey) if took else None)
        receiver.hook.staged = 0  # (as a run of the native handler leaves it)
    receiver.sync()
    return (
        went, writes, bytes(world.sends), rds.next_seq, rds.queued_bytes, rds.queued_messages,
        [(m.seq, m.sport, m.dport, m.data, m.rdma is not None) for m in rds.unacked],
        dataclasses.asdict(rds.counters), state.send_credits, receiver.hook.gate.open,
    )  # fmt: skip


@needs_c
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(7, 9), st.integers(0, 5000),
            st.sampled_from([0, 0, 1, 70000, (1 << 20) + 1]),
        ),
        min_size=1, max_size=8,
    ),
    st.tuples(st.integers(1, 12000), st.integers(1, 10)),
    st.integers(7, 9),
    st.booleans(),
)  # fmt: skip
def test_a_sendto_in_one_call_is_the_one_python_makes(
    messages: list[tuple[int, int, int]], bounds: tuple[int, int], congested: int,
    flow_control: bool,
) -> None:  # fmt: skip
    """``rp_sendto`` (and ``rp_sendto_write``, for a message chasing an RDMA Write) takes
    exactly the messages Python's sendto would send now (the connection's room, the peer's
    congested port, the size bound, the credits and free buffers ``rp_send`` looks at),
    writes the same bytes and keeps the same Writes at the same numbers, and, once brought
    in, leaves the connection as Python's sends do: numbers, queued bytes and messages,
    what waits for the peer's acknowledgement (with its operation), counters (the RDMA
    bytes and Writes among them). Bringing them in closes the gate."""
    c = sendtos(True, messages, bounds, congested, flow_control)
    assert c == sendtos(False, messages, bounds, congested, flow_control)
    assert c[-1] == 0


@needs_c
def test_a_closed_gate_sends_nothing() -> None:
    """Until the session opens it (and after each time Python brings its messages in),
    ``rp_sendto`` takes nothing."""
    world = World(True)
    assert world.receiver is not None
    world.flow.state.send_credits = 8
    world.rds.direct = world.receiver  # (as its session sets it)
    world.receiver.release()
    assert not world.receiver.sendto(BOUND[0], 7, b"x", 1)
    world.receiver.open()
    assert world.receiver.sendto(BOUND[0], 7, b"x", 1)
    world.receiver.log.append((BOUND[0], 7, b"x", None))
    world.rds.queue(BOUND[0], 7, b"python's")  # (brings it in first: numbered before)
    assert not world.receiver.sendto(BOUND[0], 7, b"y", 1)
    assert [m.data for m in world.rds.unacked][-1:] == [b"x"]
    assert world.rds.unsent[0].seq == world.rds.unacked[-1].seq + 1


@pytest.mark.parametrize("compiled", [True, False])
def test_an_empty_inbox_says_so(compiled: bool) -> None:
    """A take from an empty inbox raises IndexError on either path (the C queue's empty
    answer is a NULL pointer, which read would crash the process), and the inbox still
    works after."""
    if compiled and plain.COMPILED is None:
        pytest.skip(f"RDS's plain path in C is not built: {plain.WHY_NOT}")
    world = World(compiled)
    box = world.socks[0].received
    with pytest.raises(IndexError):
        box.take()
    box.push(b"after", PEER, 7, 1)
    assert box.take().data == b"after" and not len(box)


def test_ci_builds_the_plain_path() -> None:
    """CI sets RDMASHIM_REQUIRE_EXTENSIONS=1 where gcc and the headers are installed: the
    C path must have been built there, so its tests above do not skip."""
    if os.environ.get("RDMASHIM_REQUIRE_EXTENSIONS", "") in ("", "0"):
        pytest.skip("RDMASHIM_REQUIRE_EXTENSIONS is not set")
    assert plain.COMPILED is not None, plain.WHY_NOT


def handler_run(world: World, rows: list[Row], quiet: int) -> int:
    """One run of the native handler (``rp_handle``) over ``rows``, polled in one go from a
    stand-in verbs table (the receives it posts again are only counted), with ``quiet``
    the port whose reader drives the session: whether it asked for Python."""
    receiver = world.receiver
    assert receiver is not None
    ffi, lib, hook = receiver._ffi, receiver._lib, receiver.hook
    packed = bytearray()
    for slot, row in enumerate(rows):
        HEADER_STRUCT.pack_into(world.recv, slot * SLOT, *row.header)
        start = slot * SLOT + RDS_HEADER_LEN
        world.recv[start : start + len(row.payload)] = row.payload
        packed += WC_ROW.pack(slot, 0, int(WCOpcode.RECV), RDS_HEADER_LEN + len(row.payload),
                              1, 0, 0, 0)  # fmt: skip
    polls = [bytes(packed)]

    def poll(cq: Any, out: Any, room: int) -> int:
        if not polls:
            return 0
        chunk = polls.pop()
        assert len(chunk) <= room * WC_ROW.size
        ffi.memmove(out, chunk, len(chunk))
        return len(chunk) // WC_ROW.size

    verbs = ffi.new("rp_verbs *")
    callbacks = (
        ffi.callback("uint32_t(void *, rp_row *, uint32_t)", poll),
        ffi.callback("uint32_t(void *, const rp_recv *, uint32_t)", lambda qp, wrs, n: n),
        ffi.callback("uint32_t(void *, const rp_send_wr *, uint32_t)", lambda qp, wrs, n: n),
    )
    verbs.poll, verbs.post_recv, verbs.post_send = callbacks
    hook.quiet_port = quiet
    return int(lib.rp_handle(hook, verbs, ffi.NULL, ffi.NULL, 0))


@needs_c
def test_a_run_for_the_driving_reader_is_taken_without_python() -> None:
    """The native handler asks for Python only for what is Python's: a run of plain
    messages for the port whose reader drives the session is taken whole in C, however
    many came together (their answers go out one by one from C, as a ping-pong's do);
    a message for another port has a reader to wake."""
    world = World(True)
    run = [plain_row(FIRST + i, BOUND[0], b"m%d" % i) for i in range(6)]
    assert handler_run(world, run, quiet=BOUND[0]) == 0
    assert len(world.socks[0].received) == 6
    assert world.receiver is not None and world.receiver.state.next_recv == FIRST + 6
    other = [plain_row(FIRST + 6, BOUND[1], b"for the other socket")]
    assert handler_run(world, other, quiet=BOUND[0]) == 1
    assert len(world.socks[1].received) == 1


@needs_c
def test_a_chaser_asks_for_python_only_where_a_use_once_registration_may_end() -> None:
    """A message chasing an RDMA operation (its R_Key in the extension header) for the
    driving reader's socket needs Python only while that socket has a use-once
    registration, which the message ends; with none it is a plain message."""
    world = World(True)
    counts = world.socks[0].received.counts
    chaser = {"ext": b"\x02\x00\x00\x12\x34"}
    assert counts.use_once == 1  # (World's first socket counts one)
    assert handler_run(world, [plain_row(FIRST, **chaser)], quiet=BOUND[0]) == 1
    assert world.receiver is not None
    world.receiver.fold(None)
    world.receiver.release()
    assert world.used == [(BOUND[0], 0x1234)]
    counts.use_once = 0
    assert handler_run(world, [plain_row(FIRST + 1, **chaser)], quiet=BOUND[0]) == 0
    assert world.used == [(BOUND[0], 0x1234)] and len(world.socks[0].received) == 2
