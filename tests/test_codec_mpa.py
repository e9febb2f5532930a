"""MPA start frame codec (RFC 5044 §7.1, RFC 6581): wire vectors, byte-by-byte decoding,
hypothesis round trips and fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmashim.providers.softiwarp import mpa
from rdmashim.providers.softiwarp.mpa import RTR, StartFrame, encode_start_frame, parse_start_frame
from rdmashim.providers.softiwarp.terminate import LlpCode, ProtocolError, llp

from bytewise import tr

# Linux siw's default MPA Request: rev 2, Enhanced, IRD=1 ORD=1, no private data.
SIW_REQUEST = b"MPA ID Req Frame" + bytes([0x10, 0x02, 0x00, 0x04]) + bytes([0, 1, 0, 1])


def tr_request(data: bytes, expected: StartFrame) -> None:
    tr(lambda b: parse_start_frame(b, reply=False), data, expected)


def tr_reply(data: bytes, expected: StartFrame) -> None:
    tr(lambda b: parse_start_frame(b, reply=True), data, expected)


def block(ird_word: int, ord_word: int) -> bytes:
    return ird_word.to_bytes(2, "big") + ord_word.to_bytes(2, "big")


# ---------------------------------------------------------------------------------------
# Wire facts
# ---------------------------------------------------------------------------------------


def test_constants_match_the_wire() -> None:
    assert mpa.REQ_KEY == b"MPA ID Req Frame"
    assert mpa.REP_KEY == b"MPA ID Rep Frame"
    assert len(mpa.REQ_KEY) == len(mpa.REP_KEY) == 16
    assert mpa.HEADER_LEN == 20
    assert mpa.MAX_PRIVATE_DATA == 256
    assert mpa.V2_BLOCK_LEN == 4
    assert mpa.IRD_ORD_MASK == 0x3FFF
    assert (mpa.FLAG_MARKERS, mpa.FLAG_CRC, mpa.FLAG_REJECT, mpa.FLAG_ENHANCED) == (
        0x80,
        0x40,
        0x20,
        0x10,
    )


def test_siw_default_request_encodes_exactly() -> None:
    frame = StartFrame(reply=False, ird=1, ord=1)
    assert encode_start_frame(frame) == SIW_REQUEST
    assert frame.revision == 2 and frame.enhanced


def test_siw_default_request_decodes() -> None:
    expected = StartFrame(reply=False, revision=2, enhanced=True, ird=1, ord=1)
    tr_request(SIW_REQUEST, expected)


def test_siw_request_ulp_private_data_follows_the_v2_block() -> None:
    frame = StartFrame(reply=False, ird=1, ord=1, private_data=b"rdma_cm")
    wire = encode_start_frame(frame)
    assert wire == b"MPA ID Req Frame" + bytes([0x10, 0x02, 0x00, 0x0B, 0, 1, 0, 1]) + b"rdma_cm"
    tr_request(wire, frame)


def test_siw_gso_bit_and_other_reserved_bits_are_ignored() -> None:
    # siw sets its private GSO_EXP bit (0x08 in the flags byte) when talking to siw.
    wire = b"MPA ID Req Frame" + bytes([0x18, 0x02, 0x00, 0x04, 0, 1, 0, 1])
    tr_request(wire, StartFrame(reply=False, ird=1, ord=1))
    wire = b"MPA ID Req Frame" + bytes([0x1F, 0x02, 0x00, 0x04, 0, 1, 0, 1])
    tr_request(wire, StartFrame(reply=False, ird=1, ord=1))


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        ({}, 0x00),
        ({"markers": True}, 0x80),
        ({"crc": True}, 0x40),
        ({"reject": True}, 0x20),
        ({"markers": True, "crc": True, "reject": True}, 0xE0),
    ],
)
def test_flag_bits_rev1(kwargs: dict[str, bool], flags: int) -> None:
    frame = StartFrame(reply=True, revision=1, enhanced=False, **kwargs)
    wire = encode_start_frame(frame)
    assert wire == b"MPA ID Rep Frame" + bytes([flags, 0x01, 0x00, 0x00])
    tr_reply(wire, frame)


def test_flag_bits_rev2_enhanced() -> None:
    frame = StartFrame(reply=True, crc=True, ird=0x3FFF, ord=0x2A)
    wire = encode_start_frame(frame)
    assert wire == b"MPA ID Rep Frame" + bytes([0x50, 0x02, 0x00, 0x04]) + block(0x3FFF, 0x2A)
    tr_reply(wire, frame)


def test_rev2_without_enhanced_has_no_v2_block() -> None:
    frame = StartFrame(reply=False, revision=2, enhanced=False, private_data=b"abc")
    wire = encode_start_frame(frame)
    assert wire == b"MPA ID Req Frame" + bytes([0x00, 0x02, 0x00, 0x03]) + b"abc"
    tr_request(wire, frame)


@pytest.mark.parametrize(
    ("p2p", "rtr", "ird_word", "ord_word"),
    [
        (True, RTR.NONE, 0x8000, 0x0000),
        (True, RTR.WRITE, 0x8000, 0x8000),
        (True, RTR.READ, 0x8000, 0x4000),
        (True, RTR.SEND, 0xC000, 0x0000),
        (True, RTR.WRITE | RTR.READ, 0x8000, 0xC000),
        (True, RTR.SEND | RTR.WRITE | RTR.READ, 0xC000, 0xC000),
        (False, RTR.WRITE, 0x0000, 0x8000),
    ],
)
def test_p2p_and_rtr_bits(p2p: bool, rtr: RTR, ird_word: int, ord_word: int) -> None:
    """P2P is 0x8000 in the IRD word, Write RTR 0x8000 and Read RTR 0x4000 in the ORD
    word (zero-length Send RTR 0x4000 in the IRD word); the values sit in the low 14 bits."""
    frame = StartFrame(reply=False, ird=16, ord=5, p2p=p2p, rtr=rtr)
    wire = encode_start_frame(frame)
    assert wire[:20] == b"MPA ID Req Frame" + bytes([0x10, 0x02, 0x00, 0x04])
    assert wire[20:] == block(ird_word | 16, ord_word | 5)
    tr_request(wire, frame)


def test_rev1_with_enhanced_bit_is_not_enhanced() -> None:
    """The Enhanced bit means nothing in rev 1: the whole private data is the ULP's."""
    wire = b"MPA ID Req Frame" + bytes([0x10, 0x01, 0x00, 0x04, 0, 1, 0, 1])
    expected = StartFrame(reply=False, revision=1, enhanced=False, private_data=bytes([0, 1, 0, 1]))
    tr_request(wire, expected)


def test_largest_private_data() -> None:
    frame = StartFrame(reply=False, private_data=b"p" * 252, ird=3, ord=4)
    assert frame.max_private_data == 252
    wire = encode_start_frame(frame)
    assert len(wire) == 20 + 256 and wire[18:20] == b"\x01\x00"
    tr_request(wire, frame)
    frame = StartFrame(reply=True, revision=1, enhanced=False, private_data=b"q" * 256)
    assert frame.max_private_data == 256
    wire = encode_start_frame(frame)
    assert len(wire) == 20 + 256 and wire[18:20] == b"\x01\x00"
    tr_reply(wire, frame)


def test_reject_reply_with_private_data() -> None:
    frame = StartFrame(reply=True, reject=True, private_data=b"go away")
    wire = encode_start_frame(frame)
    assert wire == b"MPA ID Rep Frame" + bytes([0x30, 0x02, 0x00, 0x0B, 0, 0, 0, 0]) + b"go away"
    tr_reply(wire, frame)


# ---------------------------------------------------------------------------------------
# Encoder errors
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        StartFrame(reply=False, private_data=bytes(253)),
        StartFrame(reply=False, enhanced=False, private_data=bytes(257)),
        StartFrame(reply=True, revision=1, enhanced=False, private_data=bytes(257)),
        StartFrame(reply=False, revision=0, enhanced=False),
        StartFrame(reply=False, revision=3, enhanced=False),
        StartFrame(reply=False, revision=3),
        StartFrame(reply=False, revision=-1, enhanced=False),
        StartFrame(reply=False, revision=1, enhanced=True),
        StartFrame(reply=True, revision=1),  # enhanced is the default
        StartFrame(reply=False, ird=0x4000),
        StartFrame(reply=False, ord=0x4000),
        StartFrame(reply=False, ird=-1),
        StartFrame(reply=False, ord=-1),
    ],
)
def test_encode_rejects_what_mpa_cannot_carry(frame: StartFrame) -> None:
    with pytest.raises(ValueError):
        encode_start_frame(frame)


# ---------------------------------------------------------------------------------------
# Decoder errors
# ---------------------------------------------------------------------------------------


def assert_invalid(data: bytes, *, reply: bool) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_start_frame(data, reply=reply)
    assert info.value.code == llp(LlpCode.INVALID_REQ_REP)


def test_reply_key_where_request_expected() -> None:
    wire = encode_start_frame(StartFrame(reply=True, ird=1, ord=1))
    assert_invalid(wire, reply=False)
    assert_invalid(encode_start_frame(StartFrame(reply=False)), reply=True)


def test_wrong_key_detected_before_the_header_is_complete() -> None:
    # "MPA ID Re" is common to both keys; the next byte tells them apart.
    assert parse_start_frame(b"MPA ID Re", reply=False) is None
    assert parse_start_frame(b"MPA ID Re", reply=True) is None
    assert_invalid(b"MPA ID Rep", reply=False)
    assert_invalid(b"MPA ID Req", reply=True)
    assert_invalid(b"G", reply=False)
    assert_invalid(b"GET / HTTP/1.1\r\n", reply=False)
    assert_invalid(b"MPA ID Req Fram!", reply=False)
    assert_invalid(b"MPA ID Req Fram!\x10\x02", reply=False)


def test_empty_input_needs_more() -> None:
    assert parse_start_frame(b"", reply=False) is None
    assert parse_start_frame(memoryview(b""), reply=True) is None


@pytest.mark.parametrize("revision", [0, 3, 4, 0x80, 0xFF])
def test_unsupported_revision(revision: int) -> None:
    assert_invalid(b"MPA ID Req Frame" + bytes([0x10, revision, 0, 4, 0, 1, 0, 1]), reply=False)
    # rejected as soon as the header is there, without the private data
    assert_invalid(b"MPA ID Req Frame" + bytes([0x10, revision, 0, 4]), reply=False)


@pytest.mark.parametrize("pd_len", [257, 0x200, 0xFFFF])
def test_private_data_length_over_limit(pd_len: int) -> None:
    header = b"MPA ID Rep Frame" + bytes([0x00, 0x01]) + pd_len.to_bytes(2, "big")
    assert_invalid(header, reply=True)  # no need to wait for the private data
    assert_invalid(header + bytes(pd_len), reply=True)


@pytest.mark.parametrize("pd_len", [0, 1, 2, 3])
def test_enhanced_frame_without_v2_block(pd_len: int) -> None:
    wire = b"MPA ID Req Frame" + bytes([0x10, 0x02, 0x00, pd_len]) + bytes(pd_len)
    for i in range(len(wire)):
        assert parse_start_frame(wire[:i], reply=False) is None
    assert_invalid(wire, reply=False)


def test_protocol_error_names_its_code() -> None:
    with pytest.raises(ProtocolError, match=r"LLP/MPA/INVALID_REQ_REP"):
        parse_start_frame(b"MPA ID Rep", reply=False)


# ---------------------------------------------------------------------------------------
# hypothesis: round trips
# ---------------------------------------------------------------------------------------

ird_ord = st.integers(min_value=0, max_value=mpa.IRD_ORD_MASK)
rtrs = st.builds(RTR, st.integers(min_value=0, max_value=7))


@st.composite
def start_frames(draw: st.DrawFn) -> StartFrame:
    revision = draw(st.sampled_from([1, 2]))
    enhanced = revision == 2 and draw(st.booleans())
    ird = ord_ = 0
    p2p = False
    rtr = RTR.NONE
    if enhanced:
        ird, ord_ = draw(ird_ord), draw(ird_ord)
        p2p = draw(st.booleans())
        rtr = draw(rtrs)
    limit = mpa.MAX_PRIVATE_DATA - (mpa.V2_BLOCK_LEN if enhanced else 0)
    return StartFrame(
        reply=draw(st.booleans()),
        revision=revision,
        markers=draw(st.booleans()),
        crc=draw(st.booleans()),
        reject=draw(st.booleans()),
        enhanced=enhanced,
        ird=ird,
        ord=ord_,
        p2p=p2p,
        rtr=rtr,
        private_data=draw(st.binary(max_size=limit)),
    )


@given(start_frames())
@settings(max_examples=200)
def test_start_frame_round_trip(frame: StartFrame) -> None:
    wire = encode_start_frame(frame)
    assert len(wire) == 20 + len(frame.private_data) + (4 if frame.enhanced else 0)
    assert wire[:16] == (mpa.REP_KEY if frame.reply else mpa.REQ_KEY)
    assert wire[17] == frame.revision
    assert int.from_bytes(wire[18:20], "big") == len(wire) - 20
    assert wire.endswith(frame.private_data)
    result = parse_start_frame(wire, reply=frame.reply)
    assert result == (frame, len(wire))
    assert isinstance(result[0].rtr, RTR)
    assert type(result[0].private_data) is bytes


@given(start_frames(), st.binary(max_size=40))
@settings(max_examples=50)
def test_start_frame_byte_by_byte(frame: StartFrame, trailing: bytes) -> None:
    wire = encode_start_frame(frame)
    tr(lambda b: parse_start_frame(b, reply=frame.reply), wire, frame)
    assert parse_start_frame(wire + trailing, reply=frame.reply) == (frame, len(wire))


@given(st.data())
@settings(max_examples=200)
def test_start_frame_any_split(data: st.DataObject) -> None:
    """Whatever the TCP segment boundaries, prefixes need more and the whole frame decodes."""
    frame = data.draw(start_frames())
    wire = encode_start_frame(frame)
    cut = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    assert parse_start_frame(wire[:cut], reply=frame.reply) is None
    assert parse_start_frame(bytearray(wire), reply=frame.reply) == (frame, len(wire))


@given(st.data())
def test_private_data_over_limit_never_encodes(data: st.DataObject) -> None:
    frame = data.draw(start_frames())
    extra = data.draw(st.integers(min_value=1, max_value=300))
    too_long = frame.max_private_data + extra
    bad = StartFrame(
        reply=frame.reply,
        revision=frame.revision,
        enhanced=frame.enhanced,
        ird=frame.ird,
        ord=frame.ord,
        private_data=bytes(too_long),
    )
    with pytest.raises(ValueError):
        encode_start_frame(bad)


# ---------------------------------------------------------------------------------------
# hypothesis: fuzzing
# ---------------------------------------------------------------------------------------

keys = st.sampled_from([mpa.REQ_KEY, mpa.REP_KEY])


@st.composite
def near_frames(draw: st.DrawFn) -> bytes:
    """Mostly well-formed headers with arbitrary flags, revision and length."""
    key = draw(keys)
    flags = draw(st.integers(0, 255))
    revision = draw(st.sampled_from([0, 1, 2, 3, 255]))
    pd_len = draw(st.one_of(st.integers(0, 8), st.integers(0, 0xFFFF)))
    body = draw(st.binary(max_size=300))
    return key + bytes([flags, revision]) + pd_len.to_bytes(2, "big") + body


fuzz_input = st.one_of(
    st.binary(max_size=300),
    st.tuples(keys, st.binary(max_size=30)).map(b"".join),
    near_frames(),
)


@given(fuzz_input, st.booleans())
@settings(max_examples=300)
def test_parse_start_frame_fuzz(data: bytes, reply: bool) -> None:
    try:
        result = parse_start_frame(data, reply=reply)
    except ProtocolError as exc:
        assert exc.code == llp(LlpCode.INVALID_REQ_REP)
        return
    if result is None:
        return
    frame, used = result
    assert 20 <= used <= len(data)
    assert frame.reply is reply
    assert frame.revision in (1, 2)
    assert 0 <= frame.ird <= 0x3FFF and 0 <= frame.ord <= 0x3FFF
    assert len(frame.private_data) <= frame.max_private_data
    # what parses re-encodes to the same bytes, bar the reserved flag bits
    again = encode_start_frame(frame)
    assert len(again) == used
    assert again[:16] == bytes(data[:16])
    assert again[16] == data[16] & (0xF0 if frame.enhanced else 0xE0)
    assert again[17:] == bytes(data[17:used])
