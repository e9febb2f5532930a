"""RDS wire formats (Linux net/rds): header, extension headers, checksum, rdma_cm
private data and congestion map. Vectors are built by hand from the C struct layouts
(rds.h, ib.h) and checked byte by byte, then round trips and fuzzing with hypothesis."""

from __future__ import annotations

import itertools
import struct
from dataclasses import replace
from ipaddress import IPv4Address, IPv6Address

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmashim.ulps.rds import wire
from rdmashim.ulps.rds.wire import (
    RDS_CONG_MAP_BYTES,
    RDS_HEADER_LEN,
    CongestionMap,
    ConnectPrivate,
    GenNumExt,
    NpathsExt,
    RdmaDestExt,
    RdmaExt,
    RdsExtType,
    RdsFlag,
    RdsHeader,
    RdsProtocolError,
    VersionExt,
    checksum,
    verify_checksum,
)

from bytewise import tr


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[RdsHeader, int] | None:
    header = RdsHeader.decode(buf)
    return None if header is None else (header, RDS_HEADER_LEN)


def decode_map(buf: bytes | bytearray | memoryview) -> tuple[CongestionMap, int] | None:
    cong = CongestionMap.decode(buf)
    return None if cong is None else (cong, RDS_CONG_MAP_BYTES)


def rfc1071(data: bytes) -> int:
    """Reference Internet checksum: 16-bit big-endian words, end-around carry, complement."""
    total = 0
    for i in range(0, len(data), 2):
        total += (data[i] << 8) | data[i + 1]
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def be(value: int, size: int) -> bytes:
    return value.to_bytes(size, "big")


# ---------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------


def test_constants_match_linux() -> None:
    assert wire.RDS_PROTOCOL_3_0 == 0x0300
    assert wire.RDS_PROTOCOL_3_1 == 0x0301
    assert wire.RDS_PROTOCOL_VERSION == 0x0301
    assert wire.protocol(3, 1) == 0x0301
    assert (wire.protocol_major(0x0301), wire.protocol_minor(0x0301)) == (3, 1)
    assert wire.RDS_FRAG_SIZE == 4096 == 1 << wire.RDS_FRAG_SHIFT
    assert wire.RDS_MAX_MSG_SIZE == 1024 * 1024
    assert wire.RDS_CONG_MAP_BITS == 65536
    assert RDS_CONG_MAP_BYTES == 8192
    assert RDS_HEADER_LEN == 48
    assert wire.RDS_HEADER_EXT_SPACE == 16
    assert wire.RDS_MAX_ADV_CREDIT == 255
    assert wire.RDS_CM_PORT == wire.RDS_TCP_PORT == 16385
    assert wire.RDS_PORT == 18634
    assert wire.RDS_IB_SUPPORTED_PROTOCOLS == 0x0003
    assert wire.RDS_FLAG_PROBE_PORT == 1
    assert wire.RDS_RDMA_REJ_INCOMPAT == 1
    assert (RdsFlag.CONG_BITMAP, RdsFlag.ACK_REQUIRED, RdsFlag.RETRANSMITTED) == (1, 2, 4)
    assert [int(t) for t in RdsExtType] == [0, 1, 2, 3, 5, 6]
    assert issubclass(RdsProtocolError, ValueError)


def test_private_data_fits_iwarp() -> None:
    from rdmashim.providers.softiwarp import mpa

    limit = mpa.MAX_PRIVATE_DATA - mpa.V2_BLOCK_LEN
    assert wire.IWARP_MAX_PRIVATE_DATA == limit == 252
    v4 = ConnectPrivate("192.0.2.1", "192.0.2.2").encode()
    v6 = ConnectPrivate("2001:db8::1", "2001:db8::2").encode()
    assert len(v4) == wire.CONNECT_PRIVATE_V4_SIZE == 32 <= limit
    assert len(v6) == wire.CONNECT_PRIVATE_V6_SIZE == 56 <= limit
    # 56 is also all the private data an rdma_cm REQ carries over InfiniBand
    assert wire.CONNECT_PRIVATE_V6_SIZE == 92 - 36


# ---------------------------------------------------------------------------------------
# Header: known vectors
# ---------------------------------------------------------------------------------------

# A standalone ACK as rds_ib_send_ack builds it: populate_header(0, 0, 0), h_ack,
# h_credit, then the checksum. Words: 0102+0304+0506+0708+0005 = 0x1019 -> ~ = 0xEFE6.
ACK_WIRE = (
    bytes(8)  # h_sequence
    + bytes.fromhex("0102030405060708")  # h_ack
    + bytes(4)  # h_len
    + bytes(2)  # h_sport
    + bytes(2)  # h_dport
    + b"\x00"  # h_flags
    + b"\x05"  # h_credit
    + bytes(4)  # h_padding
    + b"\xef\xe6"  # h_csum
    + bytes(16)  # h_exthdr: NONE
)
ACK = RdsHeader(ack=0x0102030405060708, credit=5, checksum=0xEFE6)


def test_ack_header_vector() -> None:
    assert len(ACK_WIRE) == 48
    assert RdsHeader(ack=0x0102030405060708, credit=5).with_checksum() == ACK
    assert ACK.encode() == ACK_WIRE
    assert checksum(ACK_WIRE) == 0xEFE6 == rfc1071(ACK_WIRE[:30] + bytes(2) + ACK_WIRE[32:])
    assert verify_checksum(ACK_WIRE)
    tr(decode_header, ACK_WIRE, ACK)


def data_header_wire(csum: int) -> bytes:
    return (
        be(0x1122334455667788, 8)  # h_sequence
        + be(0x0000000000000041, 8)  # h_ack
        + be(0x00001000, 4)  # h_len
        + be(4001, 2)  # h_sport
        + be(4000, 2)  # h_dport
        + bytes([0x02, 0x7F])  # h_flags ACK_REQUIRED, h_credit 127
        + bytes(4)  # h_padding
        + be(csum, 2)  # h_csum
        + bytes([3])  # RDS_EXTHDR_RDMA_DEST
        + be(0xDEADBEEF, 4)  # h_rdma_rkey
        + be(0x00000200, 4)  # h_rdma_offset
        + bytes([0])  # RDS_EXTHDR_NONE
        + bytes(6)
    )


def test_data_header_with_rdma_dest_vector() -> None:
    unchecked = data_header_wire(0)
    # 1122+3344+5566+7788 +41 +1000 +0fa1+0fa0 +027f +03de+adbe+ef00+0002 -> e3f5 (folded)
    csum = 0x1C0A
    assert rfc1071(unchecked) == csum
    wire_bytes = data_header_wire(csum)
    header = RdsHeader(
        sequence=0x1122334455667788,
        ack=0x41,
        length=4096,
        sport=4001,
        dport=4000,
        flags=RdsFlag.ACK_REQUIRED,
        credit=127,
        extensions=(RdmaDestExt(rkey=0xDEADBEEF, offset=0x200),),
    )
    assert header.encode() == unchecked
    assert header.with_checksum().encode() == wire_bytes
    assert header.with_checksum().checksum == csum == checksum(wire_bytes)
    tr(decode_header, wire_bytes, replace(header, checksum=csum))
    tr(decode_header, unchecked, header)
    assert header.extensions[0].cookie == 0x00000200_DEADBEEF
    assert RdmaDestExt.from_cookie(0x00000200_DEADBEEF) == header.extensions[0]


def test_field_offsets() -> None:
    """Each field at its offset in struct rds_header, big-endian."""
    header = RdsHeader(
        sequence=1, ack=2, length=3, sport=4, dport=5, flags=RdsFlag(6), credit=7, checksum=8
    )
    data = header.encode()
    assert struct.unpack("!QQIHHBB4sH16s", data) == (1, 2, 3, 4, 5, 6, 7, bytes(4), 8, bytes(16))
    assert data[0:8] == be(1, 8)
    assert data[8:16] == be(2, 8)
    assert data[16:20] == be(3, 4)
    assert data[20:22] == be(4, 2)
    assert data[22:24] == be(5, 2)
    assert data[24] == 6 and data[25] == 7
    assert data[26:30] == bytes(4)
    assert data[30:32] == be(8, 2)


def test_congestion_map_update_header() -> None:
    """rds_cong_update_alloc: h_len 8192, h_flags CONG_BITMAP."""
    header = RdsHeader(sequence=9, length=RDS_CONG_MAP_BYTES, flags=RdsFlag.CONG_BITMAP)
    data = header.encode()
    assert data[16:20] == b"\x00\x00\x20\x00" and data[24] == 0x01
    tr(decode_header, data, header)


def test_unknown_flag_bits_are_kept() -> None:
    data = bytearray(RdsHeader().encode())
    data[24] = 0x2A  # UEK's HB_PONG-like bit + ACK_REQUIRED + the 0x20 extension flag
    header = RdsHeader.decode(data)
    assert header is not None
    assert int(header.flags) == 0x2A
    assert RdsFlag.ACK_REQUIRED in header.flags
    assert header.encode() == bytes(data)


def test_padding_is_ignored() -> None:
    data = bytearray(RdsHeader(sequence=5).encode())
    data[26:30] = b"\xff\xfe\xfd\xfc"
    assert RdsHeader.decode(data) == RdsHeader(sequence=5)


def test_short_buffers_need_more() -> None:
    for n in range(RDS_HEADER_LEN):
        assert RdsHeader.decode(bytes(n)) is None
        assert RdsHeader.decode(memoryview(bytes(n))) is None


# ---------------------------------------------------------------------------------------
# Header: errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        RdsHeader(sequence=-1),
        RdsHeader(sequence=1 << 64),
        RdsHeader(ack=1 << 64),
        RdsHeader(length=-1),
        RdsHeader(length=wire.RDS_MAX_MSG_SIZE + 1),
        RdsHeader(sport=1 << 16),
        RdsHeader(dport=-1),
        RdsHeader(flags=RdsFlag(0x100)),
        RdsHeader(credit=256),
        RdsHeader(checksum=0x10000),
        RdsHeader(extensions=(RdmaDestExt(1, 2), RdmaDestExt(3, 4))),  # 18 bytes
        RdsHeader(extensions=(VersionExt(), RdmaExt(1), RdmaExt(2), NpathsExt(1))),  # 18
        RdsHeader(extensions=(RdmaExt(1 << 32),)),
        RdsHeader(extensions=(RdmaDestExt(1, -1),)),
        RdsHeader(extensions=(NpathsExt(1 << 16),)),
        RdsHeader(extensions=(GenNumExt(-1),)),
        RdsHeader(extensions=(VersionExt(1 << 32),)),
        RdsHeader(extensions=("not an extension",)),  # type: ignore[arg-type]
    ],
)
def test_encode_rejects_what_rds_cannot_carry(header: RdsHeader) -> None:
    with pytest.raises(ValueError):
        header.encode()


def test_extensions_that_do_not_fit_name_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"need 18 bytes.*16"):
        RdsHeader(extensions=(RdmaDestExt(1, 2), RdmaDestExt(3, 4))).encode()


def test_bad_checksum_is_a_protocol_error() -> None:
    data = bytearray(ACK_WIRE)
    data[31] ^= 0x01
    with pytest.raises(RdsProtocolError, match=r"checksum 0xefe7 does not match.*0xefe6"):
        RdsHeader.decode(data)
    # decoding without the check gives the fields as they are
    assert RdsHeader.decode(data, verify=False) == replace(ACK, checksum=0xEFE7)


def test_length_over_max_is_a_protocol_error() -> None:
    data = bytearray(RdsHeader().encode())
    data[16:20] = be(wire.RDS_MAX_MSG_SIZE, 4)
    assert RdsHeader.decode(data) == RdsHeader(length=wire.RDS_MAX_MSG_SIZE)
    data[16:20] = be(wire.RDS_MAX_MSG_SIZE + 1, 4)
    with pytest.raises(RdsProtocolError, match="RDS_MAX_MSG_SIZE"):
        RdsHeader.decode(data)


@pytest.mark.parametrize("length", [0, 8191, 8193, 4096])
def test_congestion_update_of_the_wrong_size_is_a_protocol_error(length: int) -> None:
    data = bytearray(RdsHeader(length=length).encode())
    data[24] = RdsFlag.CONG_BITMAP
    with pytest.raises(RdsProtocolError, match="congestion map update"):
        RdsHeader.decode(data)


# ---------------------------------------------------------------------------------------
# Extension headers
# ---------------------------------------------------------------------------------------


def area(*chunks: bytes) -> bytes:
    raw = b"".join(chunks)
    return raw + bytes(16 - len(raw))


@pytest.mark.parametrize(
    ("extensions", "raw"),
    [
        ((), bytes(16)),
        ((VersionExt(),), area(b"\x01", be(0x0301, 4))),
        ((RdmaExt(0x01020304),), area(b"\x02\x01\x02\x03\x04")),
        ((RdmaDestExt(0xA0B0C0D0, 0x10),), area(b"\x03", be(0xA0B0C0D0, 4), be(0x10, 4))),
        # rds_send_probe: NPATHS then GEN_NUM
        ((NpathsExt(8), GenNumExt(0x55AA)), area(b"\x05\x00\x08", b"\x06", be(0x55AA, 4))),
        # exactly 16 bytes: no NONE byte at the end
        (
            (VersionExt(0x0300), RdmaExt(7), NpathsExt(1), NpathsExt(2)),
            b"\x01" + be(0x0300, 4) + b"\x02" + be(7, 4) + b"\x05\x00\x01\x05\x00\x02",
        ),
        (
            (RdmaDestExt(1, 2), GenNumExt(3)),
            area(b"\x03", be(1, 4), be(2, 4), b"\x06", be(3, 4)),
        ),
    ],
)
def test_extension_vectors(extensions: tuple[wire.Extension, ...], raw: bytes) -> None:
    assert len(raw) == 16
    assert wire.encode_extensions(extensions) == raw
    assert wire.parse_extensions(raw) == extensions
    header = RdsHeader(sequence=1, extensions=extensions)
    data = header.encode()
    assert data[32:] == raw
    tr(decode_header, data, header)
    tr(decode_header, header.with_checksum().encode(), header.with_checksum())


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # NONE ends the list; what follows is ignored
        (area(b"\x00\x02", be(5, 4)), ()),
        (area(b"\x02", be(5, 4), b"\x00\x02", be(6, 4)), (RdmaExt(5),)),
        # a type of 16 or more ends the list, as in rds_message_next_extension
        (area(b"\x10", be(5, 4)), ()),
        (area(b"\x02", be(5, 4), b"\xff\x02", be(6, 4)), (RdmaExt(5),)),
        # types Linux has no size for below 16 (4, 7..15) also end it here
        (area(b"\x04", be(5, 4)), ()),
        (area(b"\x02", be(5, 4), b"\x07\x02", be(6, 4)), (RdmaExt(5),)),
        (area(b"\x02", be(5, 4), b"\x0f"), (RdmaExt(5),)),
        # a body that would run past the 16 bytes ends the list
        (
            b"\x03" + be(1, 4) + be(2, 4) + b"\x05\x00\x01" + b"\x06" + bytes(3),
            (RdmaDestExt(1, 2), NpathsExt(1)),
        ),
        (b"\x03" + be(1, 4) + be(2, 4) + b"\x03" + bytes(6), (RdmaDestExt(1, 2),)),
        (
            b"\x01" + be(1, 4) + b"\x01" + be(2, 4) + b"\x01" + be(3, 4) + b"\x05",
            (VersionExt(1), VersionExt(2), VersionExt(3)),
        ),
        (
            b"\x06" + bytes(4) + b"\x02" + bytes(4) + b"\x02" + bytes(4) + b"\x06",
            (GenNumExt(0), RdmaExt(0), RdmaExt(0)),
        ),
    ],
)
def test_parsing_stops_like_linux(raw: bytes, expected: tuple[wire.Extension, ...]) -> None:
    assert len(raw) == 16
    assert wire.parse_extensions(raw) == expected
    header = RdsHeader.decode(RdsHeader().encode()[:32] + raw)
    assert header is not None and header.extensions == expected


EXAMPLES: dict[type, wire.Extension] = {
    VersionExt: VersionExt(0x0301),
    RdmaExt: RdmaExt(0x89ABCDEF),
    RdmaDestExt: RdmaDestExt(0xFEDCBA98, 0x76543210),
    NpathsExt: NpathsExt(0x0102),
    GenNumExt: GenNumExt(0xCAFEF00D),
}


def fitting_combinations() -> list[tuple[wire.Extension, ...]]:
    out: list[tuple[wire.Extension, ...]] = []
    for count in range(6):
        for combo in itertools.product(wire.EXTENSION_TYPES, repeat=count):
            if sum(1 + cls.SIZE for cls in combo) <= 16:
                out.append(tuple(EXAMPLES[cls] for cls in combo))
    return out


def test_every_extension_combination_that_fits() -> None:
    combos = fitting_combinations()
    assert len(combos) == 165
    for extensions in combos:
        header = RdsHeader(sequence=3, length=10, extensions=extensions).with_checksum()
        data = header.encode()
        used = wire.extensions_len(extensions)
        raw = data[32:]
        pos = 0
        for ext in extensions:  # type byte, then the big-endian body
            assert raw[pos] == ext.TYPE
            assert raw[pos + 1 : pos + 1 + ext.SIZE] == ext.body()
            pos += 1 + ext.SIZE
        assert raw[used:] == bytes(16 - used)
        assert RdsHeader.decode(data) == header
        assert RdsHeader.decode(data + b"trailing") == header


def test_extension_bodies_are_big_endian() -> None:
    assert VersionExt(0x0301).body() == b"\x00\x00\x03\x01"
    assert RdmaExt(0x01020304).body() == b"\x01\x02\x03\x04"
    assert RdmaDestExt(0x01020304, 0x05060708).body() == bytes(range(1, 9))
    assert NpathsExt(0x0102).body() == b"\x01\x02"
    assert GenNumExt(0x01020304).body() == b"\x01\x02\x03\x04"
    assert [cls.SIZE for cls in wire.EXTENSION_TYPES] == [4, 4, 8, 2, 4]


# ---------------------------------------------------------------------------------------
# Checksum
# ---------------------------------------------------------------------------------------


def test_all_zero_header_checksum_is_ffff() -> None:
    assert checksum(bytes(48)) == 0xFFFF
    assert RdsHeader().with_checksum().checksum == 0xFFFF
    assert verify_checksum(bytes(30) + b"\xff\xff" + bytes(16))


def test_checksum_ignores_what_h_csum_holds() -> None:
    data = bytearray(ACK_WIRE)
    for value in (0, 1, 0x1234, 0xFFFF):
        data[30:32] = be(value, 2)
        assert checksum(data) == 0xEFE6


def test_checksum_reads_only_48_bytes() -> None:
    assert checksum(ACK_WIRE + b"\xff" * 10) == 0xEFE6
    assert verify_checksum(memoryview(b"xx" + ACK_WIRE + b"yy")[2:])
    with pytest.raises(ValueError):
        checksum(ACK_WIRE[:47])
    with pytest.raises(ValueError):
        verify_checksum(b"")


headers_raw = st.binary(min_size=48, max_size=48)


@given(headers_raw)
@settings(max_examples=300)
def test_checksum_matches_rfc1071(data: bytes) -> None:
    zeroed = data[:30] + bytes(2) + data[32:]
    assert checksum(data) == rfc1071(zeroed)
    sealed = zeroed[:30] + be(checksum(data), 2) + zeroed[32:]
    assert verify_checksum(sealed)
    assert rfc1071(sealed) == 0 or checksum(data) == 0


@given(headers_raw)
def test_zero_checksum_means_unchecked(data: bytes) -> None:
    unchecked = data[:30] + bytes(2) + data[32:]
    assert verify_checksum(unchecked)


@given(headers_raw, st.integers(0, 47), st.integers(1, 255))
@settings(max_examples=400)
def test_a_changed_byte_breaks_the_checksum(data: bytes, index: int, delta: int) -> None:
    sealed = bytearray(data[:30] + be(checksum(data), 2) + data[32:])
    if sealed[30:32] == b"\0\0":  # the sum came out 0: indistinguishable from unchecked
        return
    assert verify_checksum(sealed)
    sealed[index] = (sealed[index] + delta) & 0xFF
    if sealed[30:32] == b"\0\0":  # the change made it unchecked
        assert verify_checksum(sealed)
        return
    assert not verify_checksum(sealed)
    with pytest.raises(RdsProtocolError, match="checksum"):
        RdsHeader.decode(bytes(sealed))


# ---------------------------------------------------------------------------------------
# Header: hypothesis round trips and fuzzing
# ---------------------------------------------------------------------------------------

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)

extension_values = {
    VersionExt: st.builds(VersionExt, u32),
    RdmaExt: st.builds(RdmaExt, u32),
    RdmaDestExt: st.builds(RdmaDestExt, u32, u32),
    NpathsExt: st.builds(NpathsExt, u16),
    GenNumExt: st.builds(GenNumExt, u32),
}


@st.composite
def extension_lists(draw: st.DrawFn) -> tuple[wire.Extension, ...]:
    budget = 16
    out: list[wire.Extension] = []
    while True:
        fitting = [cls for cls in wire.EXTENSION_TYPES if budget >= 1 + cls.SIZE]
        if not fitting or not draw(st.booleans()):
            return tuple(out)
        cls = draw(st.sampled_from(fitting))
        out.append(draw(extension_values[cls]))
        budget -= 1 + cls.SIZE


@st.composite
def headers(draw: st.DrawFn) -> RdsHeader:
    flags = RdsFlag(draw(u8))
    length = draw(st.integers(0, wire.RDS_MAX_MSG_SIZE))
    if flags & RdsFlag.CONG_BITMAP:
        length = RDS_CONG_MAP_BYTES
    header = RdsHeader(
        sequence=draw(u64),
        ack=draw(u64),
        length=length,
        sport=draw(u16),
        dport=draw(u16),
        flags=flags,
        credit=draw(u8),
        extensions=draw(extension_lists()),
    )
    return header.with_checksum() if draw(st.booleans()) else header


@given(headers())
@settings(max_examples=300)
def test_header_round_trip(header: RdsHeader) -> None:
    data = header.encode()
    assert len(data) == 48
    assert RdsHeader.decode(data) == header
    assert RdsHeader.decode(bytearray(data)) == header
    assert RdsHeader.decode(memoryview(data)) == header
    assert verify_checksum(data)
    decoded = RdsHeader.decode(data)
    assert decoded is not None
    assert isinstance(decoded.flags, RdsFlag)
    assert isinstance(decoded.extensions, tuple)


@given(headers(), st.binary(max_size=20))
@settings(max_examples=50)
def test_header_byte_by_byte(header: RdsHeader, trailing: bytes) -> None:
    data = header.encode()
    tr(decode_header, data, header)
    assert RdsHeader.decode(data + trailing) == header


@st.composite
def near_headers(draw: st.DrawFn) -> bytes:
    """Valid headers with some bytes overwritten, resealed or not."""
    data = bytearray(draw(headers()).encode())
    for _ in range(draw(st.integers(0, 4))):
        data[draw(st.integers(0, 47))] = draw(u8)
    if draw(st.booleans()):
        data[30:32] = be(checksum(data), 2)
    return bytes(data) + draw(st.binary(max_size=8))


@given(st.one_of(st.binary(max_size=80), near_headers()))
@settings(max_examples=400)
def test_header_decode_fuzz(data: bytes) -> None:
    try:
        header = RdsHeader.decode(data)
    except RdsProtocolError as exc:
        assert str(exc)
        return
    if header is None:
        assert len(data) < 48
        return
    again = header.encode()
    used = wire.extensions_len(header.extensions)
    # what decodes re-encodes to the same bytes, bar padding and what follows the
    # last extension header
    assert again[:26] == data[:26]
    assert again[30:32] == data[30:32]
    assert again[32 : 32 + used] == data[32 : 32 + used]
    assert RdsHeader.decode(again, verify=False) == header


# ---------------------------------------------------------------------------------------
# rdma_cm private data
# ---------------------------------------------------------------------------------------


def v4_private_wire() -> bytes:
    return (
        bytes([192, 0, 2, 1])  # dp_saddr
        + bytes([192, 0, 2, 2])  # dp_daddr
        + b"\x03\x01"  # protocol 3.1
        + b"\x00\x03"  # minor mask RDS_IB_SUPPORTED_PROTOCOLS
        + b"\x05"  # tos
        + b"\x00"  # reserved
        + b"\x10\x00"  # frag size 4096
        + be(0x0102030405060708, 8)  # dp_ack_seq
        + be(1024, 4)  # dp_credit
    )


V4_PRIVATE = ConnectPrivate(
    saddr=IPv4Address("192.0.2.1"),
    daddr=IPv4Address("192.0.2.2"),
    tos=5,
    frag_size=4096,
    ack_seq=0x0102030405060708,
    credit=1024,
)


def test_ipv4_private_data_vector() -> None:
    raw = v4_private_wire()
    assert len(raw) == 28
    assert V4_PRIVATE.encode(packed=True) == raw
    assert V4_PRIVATE.encode() == raw + bytes(4)  # 64-bit Linux's sizeof: 32
    for data in (raw, raw + bytes(4), raw + bytes(28), bytearray(raw), memoryview(b"x" + raw)[1:]):
        assert ConnectPrivate.decode(data, ipv6=False) == V4_PRIVATE
    assert not V4_PRIVATE.ipv6
    assert V4_PRIVATE.version == wire.RDS_PROTOCOL_3_1


def test_ipv6_private_data_vector() -> None:
    s, d = IPv6Address("2001:db8::1"), IPv6Address("fe80::1234")
    raw = s.packed + d.packed + b"\x03\x01\x00\x03" + b"\x00\x00\x00\x00" + be(7, 8) + be(0, 4)
    assert len(raw) == 52
    pd = ConnectPrivate(s, d, ack_seq=7)
    assert pd.encode(packed=True) == raw
    assert pd.encode() == raw + bytes(4)  # 56: the whole IB REQ private data
    assert ConnectPrivate.decode(raw, ipv6=True) == pd
    assert ConnectPrivate.decode(raw + bytes(4), ipv6=True) == pd
    assert pd.ipv6


def test_private_data_defaults_are_linux_mainline() -> None:
    raw = ConnectPrivate("10.0.0.1", "10.0.0.2").encode(packed=True)
    assert raw[8:12] == b"\x03\x01\x00\x03"
    assert raw[12:] == bytes(16)


def test_private_data_too_short_is_a_protocol_error() -> None:
    raw = v4_private_wire()
    for n in range(28):
        with pytest.raises(RdsProtocolError, match=rf"IPv4 .* {n} bytes, needs 28"):
            ConnectPrivate.decode(raw[:n], ipv6=False)
    with pytest.raises(RdsProtocolError, match=r"IPv6 .* 32 bytes, needs 52"):
        ConnectPrivate.decode(raw + bytes(4), ipv6=True)


def test_private_data_encode_errors() -> None:
    with pytest.raises(ValueError, match="two families"):
        ConnectPrivate("10.0.0.1", "::1")
    for field, value in [
        ("protocol_major", 256),
        ("protocol_minor", -1),
        ("protocol_minor_mask", 1 << 16),
        ("tos", 256),
        ("reserved", 256),
        ("frag_size", 1 << 16),
        ("ack_seq", 1 << 64),
        ("credit", 1 << 32),
    ]:
        with pytest.raises(ValueError, match=field):
            replace(V4_PRIVATE, **{field: value}).encode()


ipv4s = st.builds(IPv4Address, st.integers(0, (1 << 32) - 1))
ipv6s = st.builds(IPv6Address, st.integers(0, (1 << 128) - 1))


@st.composite
def privates(draw: st.DrawFn) -> ConnectPrivate:
    addrs = ipv6s if draw(st.booleans()) else ipv4s
    return ConnectPrivate(
        saddr=draw(addrs),
        daddr=draw(addrs),
        protocol_major=draw(u8),
        protocol_minor=draw(u8),
        protocol_minor_mask=draw(u16),
        tos=draw(u8),
        reserved=draw(u8),
        frag_size=draw(u16),
        ack_seq=draw(u64),
        credit=draw(u32),
    )


@given(privates(), st.booleans())
@settings(max_examples=200)
def test_private_data_round_trip(pd: ConnectPrivate, packed: bool) -> None:
    data = pd.encode(packed=packed)
    assert len(data) == {(False, True): 28, (False, False): 32, (True, True): 52}.get(
        (pd.ipv6, packed), 56
    )
    assert len(data) <= wire.IWARP_MAX_PRIVATE_DATA
    assert ConnectPrivate.decode(data, ipv6=pd.ipv6) == pd
    assert ConnectPrivate.decode(memoryview(data), ipv6=pd.ipv6) == pd


@given(st.binary(max_size=70), st.booleans())
@settings(max_examples=300)
def test_private_data_decode_fuzz(data: bytes, ipv6: bool) -> None:
    try:
        pd = ConnectPrivate.decode(data, ipv6=ipv6)
    except RdsProtocolError:
        assert len(data) < (52 if ipv6 else 28)
        return
    assert pd.ipv6 is ipv6
    packed = pd.encode(packed=True)
    assert packed == data[: len(packed)]


# ---------------------------------------------------------------------------------------
# Congestion map
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("port", "byte", "value"),
    [
        (0, 0, 0x01),
        (1, 0, 0x02),
        (7, 0, 0x80),
        (8, 1, 0x01),
        (4001, 500, 0x02),
        (32767, 4095, 0x80),
        (32768, 4096, 0x01),  # first bit of the second 4 KiB page
        (65535, 8191, 0x80),
    ],
)
def test_congestion_bit_positions(port: int, byte: int, value: int) -> None:
    """Linux's little-endian bit numbering: port p is bit p % 8 of byte p // 8."""
    cong = CongestionMap()
    cong.set(port)
    image = cong.encode()
    assert len(image) == RDS_CONG_MAP_BYTES
    expected = bytearray(RDS_CONG_MAP_BYTES)
    expected[byte] = value
    assert image == bytes(expected)
    # and bit p % 64 of the little-endian 64-bit word p // 64, as rds_ib_cong_recv reads it
    word = struct.unpack_from("<Q", image, (port // 64) * 8)[0]
    assert word == 1 << (port % 64)
    assert cong.test(port) and port in cong
    assert list(cong) == [port]
    cong.clear(port)
    assert cong.encode() == bytes(RDS_CONG_MAP_BYTES)
    assert not cong.test(port) and not cong


def test_congestion_map_vector() -> None:
    cong = CongestionMap([0, 9, 15, 16, 4000, 65535])
    image = bytearray(RDS_CONG_MAP_BYTES)
    image[0] = 0x01
    image[1] = 0x82  # ports 9 and 15
    image[2] = 0x01  # port 16
    image[500] = 0x01  # port 4000
    image[8191] = 0x80
    assert cong.encode() == bytes(image)
    tr(decode_map, bytes(image), cong)
    assert list(cong) == [0, 9, 15, 16, 4000, 65535]


def test_congestion_map_decode_needs_8k() -> None:
    assert CongestionMap.decode(bytes(RDS_CONG_MAP_BYTES - 1)) is None
    assert CongestionMap.decode(b"") is None
    assert CongestionMap.decode(bytes(RDS_CONG_MAP_BYTES)) == CongestionMap()
    assert CongestionMap.decode(b"\xff" * (RDS_CONG_MAP_BYTES + 5)) == CongestionMap(range(65536))


def test_congestion_map_port_range() -> None:
    cong = CongestionMap()
    for bad in (-1, 65536, 1 << 20):
        for method in (cong.set, cong.clear, cong.test):
            with pytest.raises(ValueError, match="port"):
                method(bad)
        assert bad not in cong
    with pytest.raises(ValueError):
        CongestionMap([70000])


def test_congestion_map_copy_eq_and_diff() -> None:
    a = CongestionMap([1, 2, 3])
    b = a.copy()
    assert a == b and a is not b
    assert a.diff(b) == set()
    b.clear(2)
    b.set(40000)
    assert a != b
    assert a.diff(b) == b.diff(a) == {2, 40000}
    assert a == CongestionMap([1, 2, 3])  # the copy is independent
    full = CongestionMap(range(65536))
    assert CongestionMap().diff(full) == set(range(65536))
    assert a != "map" and a.__eq__("map") is NotImplemented
    with pytest.raises(TypeError):
        hash(a)
    assert repr(CongestionMap(range(3))) == "CongestionMap([0, 1, 2])"
    assert repr(full).endswith(", ...])")


ports = st.integers(0, 65535)
port_sets = st.sets(ports, max_size=40)


@given(port_sets)
@settings(max_examples=100)
def test_congestion_map_round_trip(congested: set[int]) -> None:
    cong = CongestionMap(congested)
    image = cong.encode()
    assert CongestionMap.decode(image) == cong
    assert CongestionMap.decode(memoryview(image)) == cong
    assert set(cong) == congested
    for port in congested:
        assert image[port // 8] >> (port % 8) & 1
    assert sum(bin(b).count("1") for b in image) == len(congested)


@given(port_sets, port_sets)
@settings(max_examples=100)
def test_congestion_diff_is_symmetric_difference(a: set[int], b: set[int]) -> None:
    assert CongestionMap(a).diff(CongestionMap(b)) == a ^ b


@given(port_sets, st.lists(st.tuples(st.booleans(), ports), max_size=30))
@settings(max_examples=100)
def test_congestion_set_clear_model(start: set[int], ops: list[tuple[bool, int]]) -> None:
    cong = CongestionMap(start)
    model = set(start)
    for on, port in ops:
        if on:
            cong.set(port)
            model.add(port)
        else:
            cong.clear(port)
            model.discard(port)
        assert cong.test(port) is on
    assert set(cong) == model
    assert cong == CongestionMap(model)


@given(st.binary(max_size=64), st.dictionaries(st.integers(0, 8191), u8, max_size=20))
@settings(max_examples=100)
def test_congestion_map_decode_fuzz(short: bytes, patches: dict[int, int]) -> None:
    assert CongestionMap.decode(short) is None
    image = bytearray(RDS_CONG_MAP_BYTES)
    for index, value in patches.items():
        image[index] = value
    cong = CongestionMap.decode(bytes(image) + short)
    assert cong is not None
    assert cong.encode() == bytes(image)
