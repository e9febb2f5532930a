"""The sans-IO connection state, byte for byte and without trio: an
:class:`RdsConnection` (numbering, acknowledgements, the retransmit queue, duplicates),
one RDMA session's :class:`RdmaFlow` (credits, acks, fragments) and one RDS/TCP
stream's :class:`StreamSender` are fed events (messages queued, bytes received, acks,
the time) and must ask to send exactly the bytes written out here by hand from
Linux's ``struct rds_header`` and deliver exactly the messages expected. No test here
runs a trio loop or opens a device or socket."""

from __future__ import annotations

import ast
import struct
from ipaddress import ip_address
from pathlib import Path

import pytest

from rdmashim.ulps.rds.connection import RdsConnection
from rdmashim.ulps.rds.cookie import RdmaStatus
from rdmashim.ulps.rds.rdma import RdmaOp
from rdmashim.ulps.rds.rdma_flow import (
    ACK_DELAY,
    ACK_HELD,
    ACK_NONE,
    ACK_NOW,
    RECV_SLOTS,
    RdmaFlow,
)
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.ulps.rds.tcp_stream import StreamDecoder, StreamSender
from rdmashim.ulps.rds.wire import NpathsExt, RdmaExt, RdsHeader, RdsProtocolError

LOCAL, PEER = ip_address("10.0.0.1"), ip_address("10.0.0.2")
CONG, ACK_REQ, RETRANS = 0x01, 0x02, 0x04
"""``RDS_FLAG_CONG_BITMAP``, ``RDS_FLAG_ACK_REQUIRED``, ``RDS_FLAG_RETRANSMITTED``."""


def hdr(
    seq: int, ack: int, length: int, sport: int, dport: int, flags: int = 0, credit: int = 0,
    ext: bytes = b"",
) -> bytes:  # fmt: skip
    """``struct rds_header`` as Linux lays it out: be64 sequence, be64 ack, be32 length,
    be16 ports, u8 flags, u8 credit, 4 bytes of padding, be16 checksum (0: none) and the
    16-byte extension area."""
    return struct.pack("!QQIHHBB4xH16s", seq, ack, length, sport, dport, flags, credit, 0, ext)


class Wire:
    """What a session built on the state would do with it: the bytes of each Send the
    flow fills, and the messages the connection delivers."""

    def __init__(self, next_seq: int = 100, settings: RdsSettings | None = None) -> None:
        self.delivered: list[tuple[object, int, int, int, bytes]] = []
        self.extensions: list[object] = []
        """The extension headers of each message delivered."""
        self.rooms = 0
        self.rds = RdsConnection(
            LOCAL, PEER, self._deliver, next_seq=next_seq, settings=settings or RdsSettings(),
            on_room=self._room,
        )  # fmt: skip
        self.flow = RdmaFlow(self.rds)

    def _deliver(
        self, peer: object, seq: int, sport: int, dport: int, extensions: object, data: bytes
    ) -> None:
        self.delivered.append((peer, seq, sport, dport, data))
        self.extensions.append(extensions)

    def _room(self) -> None:
        self.rooms += 1

    def sends(self, rdma_room: bool = True) -> list[bytes]:
        """Every Send the flow fills now (until it returns 0)."""
        out = []
        buf = bytearray(8192)
        while n := self.flow.fill(buf, 100, rdma_room):  # (at an offset, as a slot is)
            out.append(bytes(buf[100 : 100 + n]))
        return out


def test_messages_go_numbered_with_ack_required_on_the_first_and_the_last() -> None:
    w = Wire()
    w.flow.peer_credits(0)  # no flow control: only the queue bounds what goes
    for i in range(10):
        w.rds.queue(4000, 5000, b"m%d" % i)
    sends = w.sends()
    # The first asks for an ack, then one in ACK_REQUIRED_EVERY (8), and the last queued.
    asks = {0, 8, 9}
    assert sends == [
        hdr(100 + i, 0, 2, 4000, 5000, ACK_REQ if i in asks else 0) + b"m%d" % i for i in range(10)
    ]
    assert [m.seq for m in w.rds.unacked] == list(range(100, 110)) and not w.rds.unsent
    assert w.rds.next_seq == 110 and w.flow.last and not w.flow.fence


def test_credits_data_never_takes_the_last_and_a_bare_ack_only_when_it_grants() -> None:
    w = Wire()
    w.flow.peer_credits(3)
    for _ in range(3):
        w.rds.queue(1, 2, b"")
    assert w.sends() == [hdr(100, 0, 0, 1, 2, ACK_REQ), hdr(101, 0, 0, 1, 2)]
    assert w.flow.state.send_credits == 1 and len(w.rds.unsent) == 1
    assert not w.flow.ack_allowed()  # the last credit, and nothing to grant
    w.flow.reposted(5)
    assert w.flow.ack_allowed()
    buf = bytearray(48)
    assert w.flow.fill_ack(buf, 0) == 48
    assert bytes(buf) == hdr(0, 0, 0, 0, 0, 0, credit=5)
    assert w.flow.state.send_credits == 0 and w.flow.state.advertise == 0
    # The peer's header grants 2: the message that waited goes, with the last flag.
    w.flow.receive(memoryview(hdr(0, 0, 0, 0, 0, 0, credit=2)))
    assert w.sends() == [hdr(102, 0, 0, 1, 2, ACK_REQ)]


def test_a_peer_granting_no_credits_turns_flow_control_off() -> None:
    w = Wire()
    w.flow.peer_credits(0)
    assert not w.flow.state.flow_control and w.flow.ack_allowed()
    w.flow.reposted(RECV_SLOTS)  # nothing to grant without flow control
    assert w.flow.state.advertise == 0


def test_credits_granted_are_capped_at_255_a_header() -> None:
    w = Wire()
    w.flow.peer_credits(10)
    w.flow.reposted(300)
    w.rds.queue(1, 2, b"x")
    w.rds.queue(1, 2, b"y")
    assert w.sends() == [
        hdr(100, 0, 1, 1, 2, ACK_REQ, 255) + b"x",
        hdr(101, 0, 1, 1, 2, ACK_REQ, 45) + b"y",
    ]


def test_a_long_message_goes_in_4k_fragments_with_its_extensions_on_the_first() -> None:
    w = Wire()
    w.flow.peer_credits(0)
    data = bytes(range(256)) * 40  # 10240 bytes: 4096 + 4096 + 2048
    w.rds.queue(7, 8, data, extensions=(NpathsExt(1),))
    ext = bytes([5]) + (1).to_bytes(2, "big")  # RDS_EXTHDR_NPATHS, be16 npaths
    sends = w.sends()
    assert sends == [
        hdr(100, 0, 10240, 7, 8, ACK_REQ, ext=ext) + data[:4096],
        hdr(100, 0, 10240, 7, 8, ACK_REQ) + data[4096:8192],
        hdr(100, 0, 10240, 7, 8, ACK_REQ) + data[8192:],
    ]


def test_an_rdma_operation_starts_with_its_message_and_the_first_fragment_names_it() -> None:
    w = Wire()
    w.flow.peer_credits(0)
    write = RdmaOp.write_to(0x1234_0000_ABCD, b"w")
    read = RdmaOp.read_into(0x99, bytearray(1))
    w.rds.queue(1, 2, b"a", rdma=write)
    w.rds.queue(1, 2, b"b", rdma=read)
    buf = bytearray(128)
    assert w.flow.fill(buf, 0) == 49 and w.flow.rdma_op is write and not w.flow.fence
    ext = bytes([2]) + (0xABCD).to_bytes(4, "big")  # RDS_EXTHDR_RDMA, be32 rkey
    assert bytes(buf[:49]) == hdr(100, 0, 1, 1, 2, ACK_REQ, ext=ext) + b"a"
    w.flow.rdma_op = None
    # No room for another RDMA operation: the message waits.
    assert w.flow.fill(buf, 0, rdma_room=False) == 0 and w.flow.rdma_op is None
    assert w.flow.fill(buf, 0) == 49 and w.flow.rdma_op is read and w.flow.fence
    assert bytes(buf[:49]) == hdr(101, 0, 1, 1, 2, ACK_REQ, ext=bytes([2, 0, 0, 0, 0x99])) + b"b"
    # The peer has both messages: their operations are done (the Read was before its
    # message, fenced).
    w.rds.acked(101)
    assert write.status is read.status is RdmaStatus.SUCCESS


def test_our_congestion_map_goes_first_outside_the_sequence() -> None:
    w = Wire()
    w.flow.peer_credits(0)
    w.rds.queue(1, 2, b"after")
    bitmap = bytes([0x80]) + bytes(8191)
    w.rds.queue_map(bytes(8192))
    w.rds.queue_map(bitmap)  # only the newest goes
    assert w.sends() == [
        hdr(0, 0, 8192, 0, 0, CONG) + bitmap[:4096],
        hdr(0, 0, 8192, 0, 0, CONG) + bitmap[4096:],
        hdr(100, 0, 5, 1, 2, ACK_REQ) + b"after",
    ]
    assert [m.seq for m in w.rds.unacked] == [100]  # the map is kept by nobody


def test_received_messages_are_delivered_once_in_order_and_acked() -> None:
    w = Wire()
    w.flow.peer_credits(4)
    w.rds.queue(1, 2, b"q")
    assert w.sends() == [hdr(100, 0, 1, 1, 2, ACK_REQ) + b"q"]
    # The peer's answer acknowledges ours and grants a credit.
    w.flow.receive(memoryview(hdr(7, 100, 3, 2, 1, 0, credit=1) + b"ans"))
    assert w.delivered == [(PEER, 7, 2, 1, b"ans")]
    assert not w.rds.unacked and w.rds.queued_bytes == 0 and w.flow.state.send_credits == 4
    # A duplicate (resent after a reconnect) is dropped.
    w.flow.receive(memoryview(hdr(7, 100, 3, 2, 1, RETRANS) + b"ans"))
    assert len(w.delivered) == 1 and w.rds.counters.recv_drop_old_seq == 1
    # The ack is held back for a message of ours to carry...
    assert w.flow.acknowledge(lambda: 5.0) == ACK_HELD
    assert w.flow.state.ack_at == 5.0 + ACK_DELAY
    assert w.flow.acknowledge(lambda: 6.0) == ACK_NONE  # held already
    assert not w.flow.ack_expired(5.0 + ACK_DELAY / 2)
    # ... which does: h_ack 7, and no bare ack is due any more.
    w.rds.queue(1, 2, b"r")
    assert w.sends() == [hdr(101, 7, 1, 1, 2, ACK_REQ) + b"r"]
    assert not w.flow.ack_expired(5.0 + ACK_DELAY)
    assert w.flow.acknowledge(lambda: 7.0) == ACK_NONE


def test_a_held_ack_goes_alone_when_nothing_of_ours_carries_it() -> None:
    w = Wire()
    w.flow.peer_credits(4)
    w.flow.receive(memoryview(hdr(1, 0, 1, 2, 1) + b"x"))
    assert w.flow.acknowledge(lambda: 0.0) == ACK_HELD
    assert w.flow.ack_expired(ACK_DELAY)
    buf = bytearray(48)
    w.flow.fill_ack(buf, 0)
    assert bytes(buf) == hdr(0, 1, 0, 0, 0)
    assert not w.flow.ack_expired(1.0)  # once


def test_many_receives_to_grant_make_an_ack_due_now() -> None:
    w = Wire()
    w.flow.peer_credits(4)
    w.flow.reposted(RECV_SLOTS // 2)
    assert w.flow.acknowledge(lambda: 0.0) == ACK_NOW


def test_fragments_are_assembled_and_a_stray_one_is_a_protocol_error() -> None:
    w = Wire()
    data = bytes(range(200)) * 50  # 10000 bytes
    for start in (0, 4096, 8192):
        w.flow.receive(memoryview(hdr(1, 0, 10000, 3, 4) + data[start : start + 4096]))
    assert w.delivered == [(PEER, 1, 3, 4, data)]
    w.flow.receive(memoryview(hdr(2, 0, 5000, 3, 4) + bytes(4096)))
    with pytest.raises(RdsProtocolError, match="fragment of message 3 inside message 2"):
        w.flow.receive(memoryview(hdr(3, 0, 5000, 3, 4) + bytes(904)))
    with pytest.raises(RdsProtocolError, match="47-byte message shorter"):
        Wire().flow.receive(memoryview(bytes(47)))


def test_a_message_chasing_an_rdma_operation_is_taken_as_its_decoded_header_says() -> None:
    """A received message whose only extension is RDS_EXTHDR_RDMA is taken from the
    header in place (no header decoded); it delivers what the decoded header says, and
    one with more extensions, or in fragments, goes through the decoding as before."""
    rdma = bytes([2]) + (0xABCD).to_bytes(4, "big")
    dest = bytes([3]) + (7).to_bytes(4, "big") + (64).to_bytes(4, "big")
    data = bytes(range(256)) * 20  # 5120 bytes: two fragments
    sends = [
        hdr(1, 0, 3, 2, 1, ext=rdma) + b"one",
        hdr(2, 0, 3, 2, 1, ext=rdma + dest) + b"two",
        hdr(3, 0, 5120, 2, 1, ext=rdma) + data[:4096],
        hdr(3, 0, 5120, 2, 1) + data[4096:],
        hdr(4, 0, 4, 2, 1, ext=rdma + bytes([0, 9, 9])) + b"four",  # (stops at NONE)
    ]
    w = Wire()
    for send in sends:
        w.flow.receive(memoryview(send))
    assert [d[1:] for d in w.delivered] == [
        (1, 2, 1, b"one"), (2, 2, 1, b"two"), (3, 2, 1, data), (4, 2, 1, b"four"),
    ]  # fmt: skip
    firsts = [RdsHeader.decode(sends[i]) for i in (0, 1, 2, 4)]  # (3 is a second fragment)
    assert w.extensions == [h.extensions for h in firsts if h is not None]
    assert w.extensions[0] == (RdmaExt(0xABCD),) and len(w.extensions[1]) == 2


def test_a_new_session_resends_what_the_peer_lacks_flagged_and_drops_rdma() -> None:
    w = Wire()
    w.flow.peer_credits(0)
    op = RdmaOp.write_to(0x5, b"w")
    w.rds.queue(1, 2, b"a")
    w.rds.queue(1, 2, b"b", rdma=op)
    w.rds.queue(1, 2, b"c")
    assert len(w.sends()) == 3
    w.rds.resume(peer_ack=100)  # the peer had "a"
    assert op.status is RdmaStatus.DROPPED and w.rds.counters.rdma_dropped == 1
    flow = RdmaFlow(w.rds)  # the next session
    flow.peer_credits(0)
    buf = bytearray(64)
    assert flow.fill(buf, 0) == 49
    assert bytes(buf[:49]) == hdr(102, 0, 1, 1, 2, RETRANS | ACK_REQ) + b"c"
    assert w.rds.counters.retransmits == 1 and w.rds.queued_bytes == 1


def test_a_sender_waiting_for_room_is_told_when_an_ack_makes_some() -> None:
    w = Wire(settings=RdsSettings(max_queued_messages=2))
    w.flow.peer_credits(0)
    w.rds.queue(1, 2, b"a")
    w.rds.queue(1, 2, b"b")
    assert not w.rds.has_room
    w.sends()
    w.rds.acked(99)  # nothing new
    w.rds.room_wanted = True
    w.rds.acked(99)
    assert w.rooms == 0
    w.rds.acked(100)
    assert w.rooms == 1 and w.rds.has_room and not w.rds.room_wanted
    w.rds.acked(101)  # nobody waits: nobody is told
    assert w.rooms == 1


def test_a_peer_map_is_taken_outside_the_sequence_and_reports_changes() -> None:
    changes: list[set[int]] = []
    rds = RdsConnection(LOCAL, PEER, lambda *a: None, on_congestion=lambda c, p: changes.append(p))
    flow = RdmaFlow(rds)
    bitmap = bytearray(8192)
    bitmap[4000 // 8] = 1 << (4000 % 8)  # port 4000 (little-endian words, as Linux's)
    flow.receive(memoryview(hdr(0, 0, 8192, 0, 0, CONG) + bitmap[:4096]))
    flow.receive(memoryview(hdr(0, 0, 8192, 0, 0, CONG) + bitmap[4096:]))
    assert changes == [{4000}] and rds.peer_congestion.test(4000)
    assert rds.next_recv == 1 and rds.counters.cong_updates_received == 1 and rds.busy


def test_rds_tcp_writes_whole_messages_with_no_ack_and_no_credit() -> None:
    """Over TCP a message is its header (``h_ack``, ``h_credit`` 0) and its whole
    payload; the newest map goes first; TCP's ack for a message's last byte acks it."""
    w = Wire()
    stream = StreamSender(w.rds)
    big = bytes(range(256)) * 20  # 5120 bytes: no fragments on a stream
    w.rds.queue(1, 2, b"a")
    w.rds.queue(3, 4, big)
    w.rds.queue_map(bytes(8192))
    first = hdr(0, 0, 8192, 0, 0, CONG) + bytes(8192)
    batch = stream.batch()
    assert bytes(batch) == first + hdr(100, 0, 1, 1, 2) + b"a" + hdr(101, 0, 5120, 3, 4) + big
    assert stream.batch() == bytearray()  # (written first: then the next batch)
    stream.wrote(len(batch))
    ends = [len(first) + 49, len(batch)]
    assert list(stream.inflight) == [(ends[0], 100), (ends[1], 101)]
    stream.acked_to(ends[0] - 1)  # not all of "a"
    assert [m.seq for m in w.rds.unacked] == [100, 101]
    stream.acked_to(ends[0])
    assert [m.seq for m in w.rds.unacked] == [101] and stream.last_offset == ends[1]
    # A new session sends what the peer lacks again, flagged, from offset 0 of its stream.
    w.rds.resume(0)
    again = StreamSender(w.rds)
    assert bytes(again.batch()) == hdr(101, 0, 5120, 3, 4, RETRANS) + big
    # And the peer's stream, cut anywhere, gives the messages whole.
    decoder = StreamDecoder()
    got = [m for i in range(0, len(batch), 1000) for m in decoder.feed(batch[i : i + 1000])]
    assert [(h.sequence, h.flags, len(data)) for h, data in got] == [
        (0, CONG, 8192), (100, 0, 1), (101, 0, 5120),
    ]  # fmt: skip


class GateLog:
    """A session's gate as the connection sees it (:class:`~.connection.DirectSends`):
    what went through it waits in its log, numbered on from the connection's next, until
    :meth:`sync` brings it in (the C half does the sending; here nothing is sent)."""

    def __init__(self, rds: RdsConnection) -> None:
        self.rds = rds
        self.log: list[tuple[int, int, bytes, RdmaOp | None]] = []
        rds.direct = self  # type: ignore[assignment]  # (open)

    def went(self, sport: int, dport: int, data: bytes) -> None:
        self.log.append((sport, dport, data, None))

    def sync(self) -> None:
        if self.rds.direct is self:
            self.rds.direct = None
            log, self.log = self.log, []
            self.rds.sent_directly(log)


def test_what_went_through_the_gate_is_brought_in_by_acks_that_reach_it_and_by_resume() -> None:
    """An acknowledgement of messages before the gate's leaves it open; one that reaches
    its messages brings them in first; a new session brings them in before it sends
    again what the peer lacks, so they go again in their turn, flagged."""
    w = Wire()
    stream = StreamSender(w.rds)
    w.rds.queue(1, 2, b"a")
    stream.wrote(len(stream.batch()))
    gate = GateLog(w.rds)
    gate.went(1, 2, b"b")  # numbered 101 and 102 by the gate
    gate.went(1, 2, b"c")
    w.rds.acked(100)
    assert w.rds.direct is gate and not w.rds.unacked  # ("a" let go; the gate stays open)
    w.rds.acked(101)
    assert w.rds.direct is None and [m.seq for m in w.rds.unacked] == [102]
    gate = GateLog(w.rds)
    gate.went(1, 2, b"d")  # 103
    w.rds.resume(peer_ack=101)
    again = StreamSender(w.rds)
    assert (
        bytes(again.batch())
        == hdr(102, 0, 1, 1, 2, RETRANS) + b"c" + hdr(103, 0, 1, 1, 2, RETRANS) + b"d"
    )


PURE = ["connection.py", "rdma_flow.py", "tcp_stream.py", "cookie.py", "wire.py"]


@pytest.mark.parametrize("name", PURE)
def test_the_connection_state_modules_import_no_io(name: str) -> None:
    """The sans-IO modules name no trio, verbs, CM or socket module (``settings`` is a
    frozen dataclass; its busy-poll check is the verbs' and runs at construction)."""
    path = Path(__file__).parents[1] / "ulps" / "rds" / name
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    banned = ("trio", "socket", "rdmashim.verbs", "rdmashim.cm", "rdmashim.ulps.rds.rdma_session")
    bad = sorted(m for m in imported if m.startswith(banned))
    assert not bad, f"{name} imports {bad}"
