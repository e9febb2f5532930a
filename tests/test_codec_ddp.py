"""FPDU codec (RFC 5044 §4 framing, RFC 5041 DDP, RFC 5040 RDMAP) and Terminate codes:
wire vectors, byte-by-byte decoding, hypothesis round trips and fuzzing."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import (
    QN,
    Header,
    Opcode,
    Terminate,
    check_trailer,
    encode_fpdu,
    encode_read_request,
    encode_tagged,
    encode_terminate,
    encode_untagged,
    fpdu_crc,
    pad_len,
    parse_header,
    parse_terminate,
    trailer,
)
from rdmashim.providers.softiwarp.terminate import (
    DDP_CATASTROPHIC,
    RDMAP_LOCAL_CATASTROPHIC,
    DdpTaggedCode,
    DdpType,
    DdpUntaggedCode,
    Layer,
    LlpCode,
    ProtocolError,
    RdmapCode,
    RdmapType,
    TermCode,
    ddp_tagged,
    ddp_untagged,
    llp,
    rdmap,
)

from bytewise import tr

U16 = st.integers(0, 0xFFFF)
U32 = st.integers(0, 0xFFFF_FFFF)
U64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)

# The first FPDU of siw's rping: a Send of 16 bytes, last, QN 0, MSN 1, MO 0.
SIW_RPING_SEND = bytes.fromhex("0022 41 43 00000000 00000000 00000001 00000000")


def header_decoder(data: Any) -> tuple[Header, int] | None:
    """parse_header with the bytes it used, for :func:`tr`."""
    header = parse_header(data)
    return None if header is None else (header, header.header_len)


def tr_header(data: bytes, expected: Header) -> None:
    tr(header_decoder, data, expected)


def fpdu_decoder(*, crc: bool) -> Callable[[Any], tuple[tuple[Header, bytes], int] | None]:
    """A whole-FPDU reader built from the codec: header, payload, PAD + CRC check."""

    def decode(data: Any) -> tuple[tuple[Header, bytes], int] | None:
        header = parse_header(data)
        if header is None:
            return None
        end = header.ulpdu_len + 2
        total = end + pad_len(header.ulpdu_len) + 4
        if len(data) < total:
            return None
        view = memoryview(data)
        if crc:
            assert check_trailer(crc32c(view[:end]), view[end:total])
        else:
            assert bytes(view[end:total]) == bytes(total - end)
        return (header, bytes(view[header.header_len : end])), total

    return decode


# ---------------------------------------------------------------------------------------
# Wire facts
# ---------------------------------------------------------------------------------------


def test_opcodes_and_queue_numbers() -> None:
    assert [op.value for op in Opcode] == list(range(8))
    assert [op.name for op in Opcode] == [
        "WRITE",
        "READ_REQUEST",
        "READ_RESPONSE",
        "SEND",
        "SEND_INV",
        "SEND_SE",
        "SEND_SE_INV",
        "TERMINATE",
    ]
    assert (QN.SEND, QN.READ_REQUEST, QN.TERMINATE) == (0, 1, 2)
    assert {Opcode.WRITE, Opcode.READ_RESPONSE} == ddp.TAGGED_OPCODES


def test_header_lengths_count_the_mpa_length_field() -> None:
    assert ddp.TAGGED.size == ddp.TAGGED_HDR_LEN == 16
    assert ddp.UNTAGGED.size == ddp.UNTAGGED_HDR_LEN == 20
    assert ddp.READ_REQUEST.size == ddp.READ_REQUEST_HDR_LEN == 48
    assert ddp.HEADER_LEN_BY_OPCODE == (16, 48, 16, 20, 20, 20, 20, 20)


def test_siw_rping_first_send() -> None:
    assert encode_untagged(Opcode.SEND, True, QN.SEND, 1, 0, 16) == SIW_RPING_SEND
    expected = Header(Opcode.SEND, True, 0x22, qn=0, msn=1, mo=0)
    tr_header(SIW_RPING_SEND, expected)
    assert expected.payload_len == 16 and expected.header_len == 20 and not expected.tagged


@pytest.mark.parametrize(
    ("opcode", "last", "ddp_byte", "rdmap_byte"),
    [
        (Opcode.WRITE, True, 0xC1, 0x40),
        (Opcode.WRITE, False, 0x81, 0x40),
        (Opcode.READ_RESPONSE, True, 0xC1, 0x42),
        (Opcode.READ_RESPONSE, False, 0x81, 0x42),
    ],
)
def test_tagged_control_bytes(opcode: Opcode, last: bool, ddp_byte: int, rdmap_byte: int) -> None:
    wire = encode_tagged(opcode, last, 0x11223344, 0x0102030405060708, 100)
    assert wire == bytes([0x00, 14 + 100, ddp_byte, rdmap_byte]) + bytes.fromhex(
        "11223344 0102030405060708"
    )
    expected = Header(opcode, last, 114, stag=0x11223344, to=0x0102030405060708)
    tr_header(wire, expected)
    assert expected.tagged and expected.payload_len == 100


def test_rtr_zero_length_write() -> None:
    """siw's RTR: a zero-length RDMA Write to STag 1, TO 0."""
    wire = encode_tagged(Opcode.WRITE, True, 1, 0, 0)
    assert wire == bytes.fromhex("000e c1 40 00000001 0000000000000000")
    tr_header(wire, Header(Opcode.WRITE, True, 14, stag=1, to=0))


@pytest.mark.parametrize(
    ("opcode", "rdmap_byte"),
    [
        (Opcode.SEND, 0x43),
        (Opcode.SEND_INV, 0x44),
        (Opcode.SEND_SE, 0x45),
        (Opcode.SEND_SE_INV, 0x46),
        (Opcode.TERMINATE, 0x47),
    ],
)
@pytest.mark.parametrize(("last", "ddp_byte"), [(True, 0x41), (False, 0x01)])
def test_untagged_control_bytes(opcode: Opcode, rdmap_byte: int, last: bool, ddp_byte: int) -> None:
    wire = encode_untagged(opcode, last, 0, 7, 0x1000, 4, inv_stag=0xCAFE)
    assert wire == bytes([0x00, 22, ddp_byte, rdmap_byte]) + bytes.fromhex(
        "0000cafe 00000000 00000007 00001000"
    )
    tr_header(wire, Header(opcode, last, 22, inv_stag=0xCAFE, qn=0, msn=7, mo=0x1000))


def test_read_request_layout() -> None:
    wire = encode_read_request(
        msn=3,
        sink_stag=0xAABBCCDD,
        sink_to=0x1122334455667788,
        size=0x10000,
        src_stag=0x01020304,
        src_to=0x0A0B0C0D0E0F1011,
    )
    assert wire == bytes.fromhex(
        "002e 41 41 00000000 00000001 00000003 00000000"
        "aabbccdd 1122334455667788 00010000 01020304 0a0b0c0d0e0f1011"
    )
    expected = Header(
        Opcode.READ_REQUEST,
        True,
        46,
        qn=1,
        msn=3,
        mo=0,
        sink_stag=0xAABBCCDD,
        sink_to=0x1122334455667788,
        read_size=0x10000,
        src_stag=0x01020304,
        src_to=0x0A0B0C0D0E0F1011,
    )
    tr_header(wire, expected)
    assert expected.header_len == 48 and expected.payload_len == 0


def test_reserved_bits_are_ignored_on_receive() -> None:
    wire = bytearray(SIW_RPING_SEND)
    wire[2] |= ddp.DDP_RESERVED
    wire[3] |= ddp.RDMAP_RESERVED
    tr_header(bytes(wire), Header(Opcode.SEND, True, 0x22, qn=0, msn=1, mo=0))


# ---------------------------------------------------------------------------------------
# PAD and CRC
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ulpdu_len", "pad"),
    [(0, 2), (1, 1), (2, 0), (3, 3), (14, 0), (15, 3), (17, 1), (18, 0), (0x22, 0), (0xFFFF, 3)],
)
def test_pad_len_table(ulpdu_len: int, pad: int) -> None:
    assert pad_len(ulpdu_len) == pad


@given(U16)
def test_pad_makes_the_whole_fpdu_4_aligned(ulpdu_len: int) -> None:
    pad = pad_len(ulpdu_len)
    assert 0 <= pad <= 3
    assert (2 + ulpdu_len + pad) % 4 == 0
    assert len(trailer(ulpdu_len, None)) == pad + 4
    assert len(trailer(ulpdu_len, 0x12345678)) == pad + 4


@pytest.mark.parametrize(
    ("data", "crc", "wire"),
    [
        (b"123456789", 0xE3069283, "839206e3"),
        # RFC 3720 appendix B.4, CRC bytes as they go on the wire
        (bytes(32), 0x8A9136AA, "aa36918a"),
        (b"\xff" * 32, 0x62A8AB43, "43aba862"),
        (bytes(range(32)), 0x46DD794E, "4e79dd46"),
        (bytes(range(31, -1, -1)), 0x113FDB5C, "5cdb3f11"),
    ],
)
def test_crc32c_vectors_and_wire_order(data: bytes, crc: int, wire: str) -> None:
    assert crc32c(data) == crc
    assert fpdu_crc([data]) == crc
    assert fpdu_crc([data[:5], memoryview(data)[5:7], bytearray(data[7:])]) == crc
    assert trailer(2, crc) == bytes.fromhex(wire)  # ulpdu_len 2: no PAD
    assert trailer(3, crc) == b"\0\0\0" + bytes.fromhex(wire)


def test_trailer_without_crc_is_pad_and_zero_field() -> None:
    assert trailer(0x22, None) == bytes(4)
    assert trailer(0, None) == bytes(6)
    assert trailer(0, 0) == bytes(6)


def test_siw_rping_send_fpdu_with_crc() -> None:
    payload = b"rdma-ping-0: ABC"
    assert len(payload) == 16
    parts = encode_fpdu(SIW_RPING_SEND, [payload], crc=True)
    wire = b"".join(parts)
    assert len(wire) == 20 + 16 + 0 + 4
    assert wire[:36] == SIW_RPING_SEND + payload
    assert wire[36:] == crc32c(wire[:36]).to_bytes(4, "little")
    tr(fpdu_decoder(crc=True), wire, (Header(Opcode.SEND, True, 0x22, msn=1), payload))


@pytest.mark.parametrize("payload_len", range(9))
@pytest.mark.parametrize("crc", [True, False])
def test_encode_fpdu_pads_and_checksums(payload_len: int, crc: bool) -> None:
    payload = bytes(range(1, payload_len + 1))
    header = encode_tagged(Opcode.WRITE, True, 5, 0x40, payload_len)
    parts = encode_fpdu(header, [payload], crc=crc)
    assert parts[0] is header and parts[1] is payload
    wire = b"".join(parts)
    pad = pad_len(14 + payload_len)
    assert len(wire) == 16 + payload_len + pad + 4
    assert len(wire) % 4 == 0
    assert wire[16 + payload_len : -4] == bytes(pad)
    if crc:
        assert wire[-4:] == crc32c(wire[:-4]).to_bytes(4, "little")
        assert check_trailer(crc32c(wire[: 16 + payload_len]), wire[16 + payload_len :])
    else:
        assert wire[-4:] == bytes(4)
    expected = Header(Opcode.WRITE, True, 14 + payload_len, stag=5, to=0x40)
    tr(fpdu_decoder(crc=crc), wire, (expected, payload))


def test_encode_fpdu_without_payload() -> None:
    header = encode_read_request(1, 2, 3, 4, 5, 6)
    wire = b"".join(encode_fpdu(header, crc=True))
    assert len(wire) == 48 + 0 + 4  # 48 is already 4-aligned
    assert wire[-4:] == crc32c(header).to_bytes(4, "little")


@given(st.lists(st.binary(max_size=20), max_size=5), st.booleans())
def test_encode_fpdu_gather_pieces_equal_one_buffer(pieces: list[bytes], crc: bool) -> None:
    payload = b"".join(pieces)
    header = encode_untagged(Opcode.SEND, True, 0, 1, 0, len(payload))
    gathered = encode_fpdu(header, [memoryview(p) for p in pieces], crc=crc)
    assert b"".join(gathered) == b"".join(encode_fpdu(header, [payload], crc=crc))
    assert fpdu_crc([header, *pieces]) == crc32c(header + payload)


@given(st.binary(max_size=64), st.data())
def test_check_trailer_catches_any_bit_flip(payload: bytes, data: st.DataObject) -> None:
    header = encode_untagged(Opcode.SEND, True, 0, 1, 0, len(payload))
    wire = bytearray(b"".join(encode_fpdu(header, [payload], crc=True)))
    end = 20 + len(payload)
    state = crc32c(wire[:end])
    assert check_trailer(state, wire[end:])
    assert check_trailer(state, memoryview(wire)[end:])
    bit = data.draw(st.integers(0, len(wire) * 8 - 1))
    wire[bit // 8] ^= 1 << (bit % 8)
    assert not check_trailer(crc32c(wire[:end]), wire[end:])


# ---------------------------------------------------------------------------------------
# parse_header: needing more, and errors
# ---------------------------------------------------------------------------------------


def test_short_inputs_need_more() -> None:
    assert parse_header(b"") is None
    assert parse_header(b"\x00\x22\x41") is None
    assert parse_header(bytearray(SIW_RPING_SEND[:19])) is None
    assert parse_header(memoryview(SIW_RPING_SEND)[:4]) is None


def assert_code(data: bytes, code: TermCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_header(data)
    assert info.value.code == code
    assert str(code) in str(info.value)


@pytest.mark.parametrize("version", [0, 2, 3])
def test_ddp_version(version: int) -> None:
    untagged = bytearray(SIW_RPING_SEND)
    untagged[2] = 0x40 | version
    assert_code(bytes(untagged[:4]), ddp_untagged(DdpUntaggedCode.VERSION))
    tagged = bytearray(encode_tagged(Opcode.WRITE, True, 1, 0, 0))
    tagged[2] = 0xC0 | version
    assert_code(bytes(tagged[:4]), ddp_tagged(DdpTaggedCode.VERSION))


@pytest.mark.parametrize("version", [0, 2, 3])
def test_rdmap_version(version: int) -> None:
    wire = bytearray(SIW_RPING_SEND)
    wire[3] = version << 6 | Opcode.SEND
    assert_code(bytes(wire), rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.VERSION))


@pytest.mark.parametrize("opcode", range(8, 16))
def test_unknown_opcode(opcode: int) -> None:
    for ddp_byte in (0x41, 0xC1):
        wire = bytes([0x00, 0x22, ddp_byte, 0x40 | opcode]) + bytes(16)
        assert_code(wire, rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE))


@pytest.mark.parametrize("opcode", list(Opcode))
def test_tagged_bit_must_match_the_opcode(opcode: Opcode) -> None:
    ddp_byte = 0x41 if opcode in ddp.TAGGED_OPCODES else 0xC1
    wire = bytes([0x00, 0x40, ddp_byte, 0x40 | opcode]) + bytes(60)
    assert_code(wire, rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE))


@pytest.mark.parametrize("opcode", list(Opcode))
def test_ulpdu_length_shorter_than_the_header(opcode: Opcode) -> None:
    hdr_len = ddp.HEADER_LEN_BY_OPCODE[opcode]
    ddp_byte = 0xC1 if opcode in ddp.TAGGED_OPCODES else 0x41
    for ulpdu_len in (0, hdr_len - 3):
        wire = ulpdu_len.to_bytes(2, "big") + bytes([ddp_byte, 0x40 | opcode])
        assert_code(wire, llp(LlpCode.FPDU_START))  # known after the first 4 bytes
    ok = (hdr_len - 2).to_bytes(2, "big") + bytes([ddp_byte, 0x40 | opcode])
    assert parse_header(ok) is None


def test_checks_run_in_order() -> None:
    # DDP version is checked first, then the RDMAP version, the opcode, the T bit
    assert_code(bytes([0, 0x22, 0x42, 0x0F]), ddp_untagged(DdpUntaggedCode.VERSION))
    assert_code(bytes([0, 0x22, 0x41, 0x0F]), rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.VERSION))
    assert_code(bytes([0, 0x22, 0x41, 0x4F]), rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE))
    assert_code(bytes([0, 0x00, 0xC1, 0x43]), rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE))


# ---------------------------------------------------------------------------------------
# hypothesis: header round trips
# ---------------------------------------------------------------------------------------

tagged_ops = st.sampled_from(sorted(ddp.TAGGED_OPCODES))
untagged_ops = st.sampled_from(sorted(ddp.SEND_OPCODES | {Opcode.TERMINATE}))


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, Header]:
    """An encoded header of any kind and the Header it must decode to."""
    kind = draw(st.sampled_from(["tagged", "untagged", "read_request"]))
    if kind == "tagged":
        opcode, last, stag, to = draw(tagged_ops), draw(st.booleans()), draw(U32), draw(U64)
        size = draw(st.integers(0, ddp.MAX_ULPDU - 14))
        header = Header(opcode, last, 14 + size, stag=stag, to=to)
        return encode_tagged(opcode, last, stag, to, size), header
    if kind == "untagged":
        opcode, last = draw(untagged_ops), draw(st.booleans())
        qn, msn, mo, inv = draw(U32), draw(U32), draw(U32), draw(U32)
        size = draw(st.integers(0, ddp.MAX_ULPDU - 18))
        header = Header(opcode, last, 18 + size, inv_stag=inv, qn=qn, msn=msn, mo=mo)
        return encode_untagged(opcode, last, qn, msn, mo, size, inv_stag=inv), header
    msn, sink_stag, sink_to, size = draw(U32), draw(U32), draw(U64), draw(U32)
    src_stag, src_to = draw(U32), draw(U64)
    header = Header(
        Opcode.READ_REQUEST,
        True,
        46,
        qn=QN.READ_REQUEST,
        msn=msn,
        sink_stag=sink_stag,
        sink_to=sink_to,
        read_size=size,
        src_stag=src_stag,
        src_to=src_to,
    )
    return encode_read_request(msn, sink_stag, sink_to, size, src_stag, src_to), header


@given(headers())
@settings(max_examples=300)
def test_header_round_trip(case: tuple[bytes, Header]) -> None:
    wire, expected = case
    assert len(wire) == expected.header_len == ddp.HEADER_LEN[expected.opcode]
    assert int.from_bytes(wire[:2], "big") == expected.ulpdu_len
    assert wire[2] & 0x80 == (0x80 if expected.tagged else 0)
    assert wire[2] & 0x40 == (0x40 if expected.last else 0)
    assert wire[2] & 0x03 == 1 and wire[3] >> 6 == 1 and wire[3] & 0x0F == expected.opcode
    header = parse_header(wire)
    assert header == expected
    assert isinstance(header.opcode, Opcode)
    assert header.payload_len == expected.ulpdu_len + 2 - expected.header_len


@given(headers())
@settings(max_examples=100)
def test_header_byte_by_byte(case: tuple[bytes, Header]) -> None:
    wire, expected = case
    tr_header(wire, expected)


@given(headers(), st.data())
@settings(max_examples=200)
def test_header_any_split(case: tuple[bytes, Header], data: st.DataObject) -> None:
    wire, expected = case
    cut = data.draw(st.integers(0, len(wire) - 1))
    assert parse_header(wire[:cut]) is None
    trailing = data.draw(st.binary(max_size=64))
    assert header_decoder(bytearray(wire + trailing)) == (expected, len(wire))


@given(
    st.sampled_from(list(Opcode)),
    st.booleans(),
    st.binary(max_size=300),
    st.booleans(),
    st.binary(max_size=16),
)
@settings(max_examples=100)
def test_whole_fpdu_round_trip(
    opcode: Opcode, last: bool, payload: bytes, crc: bool, trailing: bytes
) -> None:
    if opcode in ddp.TAGGED_OPCODES:
        header = encode_tagged(opcode, last, 9, 1 << 40, len(payload))
    elif opcode is Opcode.READ_REQUEST:
        header, payload = encode_read_request(1, 2, 3, 4, 5, 6), b""
    else:
        header = encode_untagged(opcode, last, 0, 1, 0, len(payload))
    wire = b"".join(encode_fpdu(header, [payload], crc=crc))
    assert len(wire) % 4 == 0
    decode = fpdu_decoder(crc=crc)
    result = decode(wire + trailing)
    assert result is not None
    (parsed, body), used = result
    assert used == len(wire) and body == payload and parsed == parse_header(header)
    if len(wire) <= 64:
        tr(decode, wire, (parsed, body))


# ---------------------------------------------------------------------------------------
# hypothesis: parse_header fuzzing
# ---------------------------------------------------------------------------------------


def expected_error(ctrl: bytes) -> TermCode | None:
    """The Terminate code RFC 5040/5041 prescribe for a header starting with ``ctrl``."""
    ulpdu_len, ddp_byte, rdmap_byte = struct.unpack("!HBB", ctrl)
    tagged = bool(ddp_byte & 0x80)
    if ddp_byte & 0x03 != 1:
        return (
            ddp_tagged(DdpTaggedCode.VERSION) if tagged else ddp_untagged(DdpUntaggedCode.VERSION)
        )
    if rdmap_byte >> 6 != 1:
        return rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.VERSION)
    opcode = rdmap_byte & 0x0F
    if opcode > 7:
        return rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE)
    if tagged != (opcode in (Opcode.WRITE, Opcode.READ_RESPONSE)):
        return rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE)
    if ulpdu_len + 2 < ddp.HEADER_LEN_BY_OPCODE[opcode]:
        return llp(LlpCode.FPDU_START)
    return None


@st.composite
def near_headers(draw: st.DrawFn) -> bytes:
    """Headers whose control bytes are mostly valid, so fuzzing reaches every check."""
    ulpdu_len = draw(st.one_of(st.integers(0, 60), U16))
    ddp_byte = draw(st.one_of(st.sampled_from([0x01, 0x41, 0x81, 0xC1]), st.integers(0, 255)))
    rdmap_byte = draw(st.one_of(st.integers(0x40, 0x4F), st.integers(0, 255)))
    rest = draw(st.binary(max_size=60))
    return ulpdu_len.to_bytes(2, "big") + bytes([ddp_byte, rdmap_byte]) + rest


@given(st.one_of(st.binary(max_size=80), near_headers()))
@settings(max_examples=500)
def test_parse_header_fuzz(data: bytes) -> None:
    code = expected_error(data[:4]) if len(data) >= 4 else None
    try:
        header = parse_header(data)
    except ProtocolError as exc:
        assert code is not None, f"unexpected {exc!r}"
        assert exc.code == code
        return
    assert code is None
    if header is None:
        assert len(data) < 4 or len(data) < ddp.HEADER_LEN_BY_OPCODE[data[3] & 0x0F]
        return
    assert len(data) >= header.header_len
    assert header.payload_len >= 0
    assert header.tagged == bool(data[2] & 0x80)
    assert header.last == bool(data[2] & 0x40)
    assert header.ulpdu_len == int.from_bytes(data[:2], "big")
    # decoding only looks at the header bytes
    assert parse_header(memoryview(data)[: header.header_len]) == header


# ---------------------------------------------------------------------------------------
# Terminate
# ---------------------------------------------------------------------------------------


def test_terminate_wire_layout() -> None:
    wire = encode_terminate(Terminate(llp(LlpCode.CRC)))
    assert wire == bytes.fromhex("0016 41 47 00000000 00000002 00000001 00000000 20020000")
    header = parse_header(wire)
    assert header == Header(Opcode.TERMINATE, True, 22, qn=2, msn=1, mo=0)
    body = wire[header.header_len :]
    assert len(body) == header.payload_len == 4
    assert parse_terminate(body) == Terminate(llp(LlpCode.CRC))


def test_terminate_with_copied_ddp_header() -> None:
    copied = SIW_RPING_SEND
    term = Terminate(
        ddp_untagged(DdpUntaggedCode.MSN_RANGE), ddp_header_copied=True, copied_header=copied
    )
    wire = encode_terminate(term)
    assert wire[:20] == bytes.fromhex("002a 41 47 00000000 00000002 00000001 00000000")
    assert wire[20:24] == bytes.fromhex("1203c000")  # DDP / untagged / 0x03, M and D
    assert wire[24:] == copied
    assert parse_terminate(wire[20:]) == term
    assert parse_terminate(memoryview(wire)[20:]) == term
    term = Terminate(
        rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.ACCESS_RIGHTS),
        rdmap_header_copied=True,
        copied_header=copied,
    )
    wire = encode_terminate(term)
    assert wire[20:24] == bytes.fromhex("0102a000")  # RDMAP / protection / 0x02, M and R
    assert parse_terminate(wire[20:]) == term


def test_terminate_copied_header_needs_the_m_flag() -> None:
    body = bytes.fromhex("12034000") + b"ignored"
    assert parse_terminate(body) == Terminate(
        ddp_untagged(DdpUntaggedCode.MSN_RANGE), ddp_header_copied=True
    )


@pytest.mark.parametrize("size", range(4))
def test_terminate_body_too_short(size: int) -> None:
    with pytest.raises(ProtocolError):
        parse_terminate(bytes(size))


term_codes = st.one_of(
    st.builds(TermCode, st.integers(0, 15), st.integers(0, 15), st.integers(0, 255)),
    st.sampled_from([
        llp(LlpCode.INSUFFICIENT_IRD),
        ddp_tagged(DdpTaggedCode.INVALID_STAG),
        rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE),
        DDP_CATASTROPHIC,
        RDMAP_LOCAL_CATASTROPHIC,
    ]),
)  # fmt: skip


@st.composite
def terminates(draw: st.DrawFn) -> Terminate:
    copied = draw(st.one_of(st.just(b""), st.binary(max_size=48), headers().map(lambda c: c[0])))
    return Terminate(draw(term_codes), draw(st.booleans()), draw(st.booleans()), copied)


@given(terminates())
@settings(max_examples=200)
def test_terminate_round_trip(term: Terminate) -> None:
    wire = encode_terminate(term)
    header = parse_header(wire)
    assert header == Header(Opcode.TERMINATE, True, len(wire) - 2, qn=2, msn=1, mo=0)
    body = wire[header.header_len : header.header_len + header.payload_len]
    assert body == wire[20:]
    parsed = parse_terminate(body)
    assert parsed == term
    assert str(parsed.code) == str(term.code)
    # the whole Terminate FPDU decodes the same way
    fpdu = b"".join(encode_fpdu(wire[:20], [body], crc=True))
    tr(fpdu_decoder(crc=True), fpdu, (header, body))


@given(st.binary(max_size=80))
@settings(max_examples=300)
def test_parse_terminate_fuzz(body: bytes) -> None:
    try:
        term = parse_terminate(body)
    except ProtocolError as exc:
        assert len(body) < 4
        assert exc.code.layer == Layer.RDMAP
        return
    assert term.copied_header in (b"", body[4:])
    assert 0 <= term.code.layer <= 15 and 0 <= term.code.etype <= 15
    assert 0 <= term.code.ecode <= 255
    str(term.code)  # never raises
    # re-encoding keeps everything but the reserved bits (and M without a header)
    word = int.from_bytes(body[:4], "big") & 0xFFFF_E000
    if not term.copied_header:
        word &= ~0x8000
    assert encode_terminate(term)[20:] == word.to_bytes(4, "big") + term.copied_header


# ---------------------------------------------------------------------------------------
# terminate.py: the code tables and TermCode.__str__
# ---------------------------------------------------------------------------------------


def test_code_tables_match_rfc5040_5041_5044_6581() -> None:
    assert {m.name: m.value for m in Layer} == {"RDMAP": 0, "DDP": 1, "LLP": 2}
    assert {m.name: m.value for m in RdmapType} == {
        "CATASTROPHIC": 0,
        "REMOTE_PROTECTION": 1,
        "REMOTE_OPERATION": 2,
    }
    assert {m.name: m.value for m in RdmapCode} == {
        "INVALID_STAG": 0x00,
        "BASE_BOUNDS": 0x01,
        "ACCESS_RIGHTS": 0x02,
        "STAG_NOT_ASSOC": 0x03,
        "TO_WRAP": 0x04,
        "VERSION": 0x05,
        "OPCODE": 0x06,
        "CATASTROPHIC_STREAM": 0x07,
        "CATASTROPHIC_GLOBAL": 0x08,
        "CANNOT_INVALIDATE": 0x09,
        "UNSPECIFIED": 0xFF,
    }
    assert {m.name: m.value for m in DdpType} == {"CATASTROPHIC": 0, "TAGGED": 1, "UNTAGGED": 2}
    assert {m.name: m.value for m in DdpTaggedCode} == {
        "INVALID_STAG": 0x00,
        "BASE_BOUNDS": 0x01,
        "STAG_NOT_ASSOC": 0x02,
        "TO_WRAP": 0x03,
        "VERSION": 0x04,
    }
    assert {m.name: m.value for m in DdpUntaggedCode} == {
        "INVALID_QN": 0x01,
        "MSN_NO_BUFFER": 0x02,
        "MSN_RANGE": 0x03,
        "INVALID_MO": 0x04,
        "MSG_TOO_LONG": 0x05,
        "VERSION": 0x06,
    }
    assert {m.name: m.value for m in LlpCode} == {
        "TCP_STREAM_LOST": 0x01,
        "CRC": 0x02,
        "FPDU_START": 0x03,
        "INVALID_REQ_REP": 0x04,
        "LOCAL_CATASTROPHIC": 0x05,
        "INSUFFICIENT_IRD": 0x06,
        "NO_MATCHING_RTR": 0x07,
    }


def test_code_constructors() -> None:
    assert rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE) == TermCode(0, 2, 6)
    assert ddp_tagged(DdpTaggedCode.VERSION) == TermCode(1, 1, 4)
    assert ddp_untagged(DdpUntaggedCode.VERSION) == TermCode(1, 2, 6)
    assert llp(LlpCode.NO_MATCHING_RTR) == TermCode(2, 0, 7)
    assert TermCode(1, 0, 0) == DDP_CATASTROPHIC
    assert TermCode(0, 0, 0xFF) == RDMAP_LOCAL_CATASTROPHIC
    assert hash(llp(LlpCode.CRC)) == hash(TermCode(2, 0, 2))


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.OPCODE), "RDMAP/REMOTE_OPERATION/OPCODE"),
        (rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.VERSION), "RDMAP/REMOTE_OPERATION/VERSION"),
        (
            rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.INVALID_STAG),
            "RDMAP/REMOTE_PROTECTION/INVALID_STAG",
        ),
        (RDMAP_LOCAL_CATASTROPHIC, "RDMAP/CATASTROPHIC/UNSPECIFIED"),
        (ddp_tagged(DdpTaggedCode.BASE_BOUNDS), "DDP/TAGGED/BASE_BOUNDS"),
        (ddp_tagged(DdpTaggedCode.VERSION), "DDP/TAGGED/VERSION"),
        (ddp_untagged(DdpUntaggedCode.VERSION), "DDP/UNTAGGED/VERSION"),
        (ddp_untagged(DdpUntaggedCode.INVALID_QN), "DDP/UNTAGGED/INVALID_QN"),
        (DDP_CATASTROPHIC, "DDP/CATASTROPHIC/code 0x00"),
        (llp(LlpCode.CRC), "LLP/MPA/CRC"),
        (llp(LlpCode.INSUFFICIENT_IRD), "LLP/MPA/INSUFFICIENT_IRD"),
        (TermCode(2, 0, 3), "LLP/MPA/FPDU_START"),
        (TermCode(0, 2, 0x42), "RDMAP/REMOTE_OPERATION/code 0x42"),
        (TermCode(0, 7, 5), "RDMAP/type 7/code 0x05"),
        (TermCode(1, 2, 0), "DDP/UNTAGGED/code 0x00"),
        (TermCode(1, 3, 1), "DDP/type 3/code 0x01"),
        (TermCode(2, 1, 2), "LLP/type 1/code 0x02"),
        (TermCode(2, 0, 0), "LLP/MPA/code 0x00"),
        (TermCode(3, 0, 0), "layer 3/type 0/code 0x00"),
        (TermCode(15, 15, 255), "layer 15/type 15/code 0xff"),
    ],
)
def test_term_code_str(code: TermCode, text: str) -> None:
    assert str(code) == text


@given(st.builds(TermCode, st.integers(0, 255), st.integers(0, 255), st.integers(0, 255)))
def test_term_code_str_never_raises(code: TermCode) -> None:
    parts = str(code).split("/")
    assert len(parts) == 3 and all(parts)


def test_every_table_entry_has_a_name() -> None:
    tables = [
        (Layer.RDMAP, t, RdmapCode) for t in RdmapType
    ] + [
        (Layer.DDP, DdpType.TAGGED, DdpTaggedCode),
        (Layer.DDP, DdpType.UNTAGGED, DdpUntaggedCode),
        (Layer.LLP, 0, LlpCode),
    ]  # fmt: skip
    for layer, etype, codes in tables:
        for ecode in codes:
            text = str(TermCode(layer, etype, ecode))
            assert text.endswith("/" + ecode.name) and text.startswith(layer.name + "/")


def test_protocol_error_carries_its_code() -> None:
    exc = ProtocolError("boom")
    assert exc.code == RDMAP_LOCAL_CATASTROPHIC
    assert exc.header is None and exc.quote_rdmap is False
    assert str(exc) == "boom [RDMAP/CATASTROPHIC/UNSPECIFIED]"
    header = Header(Opcode.SEND, True, 18)
    exc = ProtocolError("bad", llp(LlpCode.CRC), header=header, quote_rdmap=True)
    assert exc.code == llp(LlpCode.CRC) and exc.header is header and exc.quote_rdmap
    assert "LLP/MPA/CRC" in str(exc)
