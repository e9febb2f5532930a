"""RPC-over-RDMA v1 headers and RFC 8797 private data, byte by byte."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmashim.ulps.nfsrdma.rpcrdma import (
    MAX_CHUNK_SEGMENTS,
    MAX_READ_SEGMENTS,
    MAX_WRITE_CHUNKS,
    PLAIN_LEN,
    ConnectPrivate,
    ErrCode,
    ErrorHeader,
    Header,
    Message,
    Proc,
    ReadSegment,
    Segment,
    VersionMismatch,
    decode,
    peek_fixed,
    peek_plain,
    peer_sizes,
    plain_header,
    read_chunks,
)
from rdmashim.ulps.nfsrdma.xdr import XdrError

W = bytes.fromhex


def words(*values: int) -> bytes:
    return b"".join(v.to_bytes(4, "big") for v in values)


SEG = Segment(0x11223344, 0x1000, 0x0102030405060708)
SEG_BYTES = W("11223344 00001000 0102030405060708")


def test_short_message_header_is_seven_words() -> None:
    h = Header(0xDEADBEEF, 32)
    data = h.encode()
    assert data == words(0xDEADBEEF, 1, 32, 0, 0, 0, 0)
    assert decode(data + b"rpc") == (h, 28)


def test_every_list_on_the_wire() -> None:
    h = Header(
        7, 1, Proc.RDMA_NOMSG,
        read_list=(ReadSegment(0, SEG), ReadSegment(0, Segment(1, 2, 3)), ReadSegment(96, SEG)),
        write_list=((SEG,), (SEG, Segment(5, 6, 7))),
        reply_chunk=(Segment(9, 10, 11),),
    )  # fmt: skip
    expected = (
        words(7, 1, 1, 1)
        + words(1, 0) + SEG_BYTES
        + words(1, 0) + words(1, 2) + (3).to_bytes(8, "big")
        + words(1, 96) + SEG_BYTES
        + words(0)
        + words(1, 1) + SEG_BYTES
        + words(1, 2) + SEG_BYTES + words(5, 6) + (7).to_bytes(8, "big")
        + words(0)
        + words(1, 1, 9, 10) + (11).to_bytes(8, "big")
    )  # fmt: skip
    assert h.encode() == expected
    assert decode(expected) == (h, len(expected))
    assert read_chunks(h.read_list) == [(0, (SEG, Segment(1, 2, 3))), (96, (SEG,))]


def test_errors_on_the_wire() -> None:
    vers = ErrorHeader(5, 0, ErrCode.ERR_VERS, 1, 1)
    chunk = ErrorHeader(6, 3, ErrCode.ERR_CHUNK)
    assert vers.encode() == words(5, 1, 0, 4, 1, 1, 1)
    assert chunk.encode() == words(6, 1, 3, 4, 2)
    assert decode(vers.encode()) == (vers, 28)
    assert decode(chunk.encode()) == (chunk, 20)
    with pytest.raises(XdrError, match="unknown error code 3"):
        decode(words(6, 1, 3, 4, 3))


def test_other_version_keeps_its_xid() -> None:
    with pytest.raises(VersionMismatch) as info:
        decode(words(0xABC, 2, 1, 0, 0, 0, 0))
    assert (info.value.xid, info.value.vers) == (0xABC, 2)
    assert peek_fixed(words(0xABC, 2, 1, 0)) == (0xABC, 2, 1, 0)
    with pytest.raises(XdrError):
        peek_fixed(words(0xABC, 2, 1))


@pytest.mark.parametrize("proc", [2, 3, 5, 0xFFFFFFFF])
def test_msgp_done_and_unknown_procedures_are_refused(proc: int) -> None:
    with pytest.raises(XdrError, match="not supported"):
        decode(words(1, 1, 1, proc, 0, 0, 0))
    with pytest.raises(ValueError):
        Header(1, 1, Proc.RDMA_MSGP).encode()


def test_bad_list_discriminants_are_errors() -> None:
    with pytest.raises(XdrError, match="boolean 2"):
        decode(words(1, 1, 1, 0, 2, 0, 0))
    with pytest.raises(XdrError, match="boolean"):
        decode(words(1, 1, 1, 0, 0, 0, 7))


def test_list_bounds() -> None:
    reads = words(1, 1, 1, 0) + (words(1, 0) + SEG_BYTES) * (MAX_READ_SEGMENTS + 1)
    with pytest.raises(XdrError, match="Read list over"):
        decode(reads + words(0, 0, 0))
    writes = words(1, 1, 1, 0, 0) + (words(1, 1) + SEG_BYTES) * (MAX_WRITE_CHUNKS + 1)
    with pytest.raises(XdrError, match="Write list over"):
        decode(writes + words(0, 0))
    many = words(1, 1, 1, 0, 0, 1, MAX_CHUNK_SEGMENTS + 1)
    with pytest.raises(XdrError, match="at most"):
        decode(many + SEG_BYTES * (MAX_CHUNK_SEGMENTS + 1) + words(0, 0))
    # a count the rest of the header cannot hold is refused before anything is built
    with pytest.raises(XdrError, match="in 4 bytes"):
        decode(words(1, 1, 1, 0, 0, 0, 1, 200, 0))
    # at the bounds: accepted
    full = Header(1, 1, write_list=((SEG,) * MAX_CHUNK_SEGMENTS,) * MAX_WRITE_CHUNKS)
    assert decode(full.encode())[0] == full


segments = st.builds(
    Segment, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
)
headers = st.builds(
    Header,
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.sampled_from([Proc.RDMA_MSG, Proc.RDMA_NOMSG]),
    st.lists(st.builds(ReadSegment, st.integers(0, 2**32 - 1), segments), max_size=5).map(tuple),
    st.lists(st.lists(segments, max_size=4).map(tuple), max_size=4).map(tuple),
    st.none() | st.lists(segments, max_size=4).map(tuple),
)
errors = st.builds(
    ErrorHeader,
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.sampled_from(list(ErrCode)),
).map(lambda e: e if e.code == ErrCode.ERR_VERS else ErrorHeader(e.xid, e.credit, e.code))


@given(headers | errors, st.binary(max_size=12))
def test_round_trip_and_every_truncation_is_an_error(h: Message, rest: bytes) -> None:
    data = h.encode()
    assert decode(data + rest) == (h, len(data))
    assert decode(memoryview(bytearray(b"x" + data))[1:]) == (h, len(data))
    for n in range(len(data)):
        with pytest.raises(XdrError):
            decode(data[:n])


@given(st.binary(max_size=200))
def test_garbage_is_an_xdr_error_or_a_header(data: bytes) -> None:
    try:
        h, n = decode(data)
    except XdrError:
        return
    assert n <= len(data)
    assert h.encode() == data[:n]


# ---------------------------------------------------------------- RFC 8797


def test_private_data_bytes() -> None:
    cp = ConnectPrivate(4096, 65536, remote_invalidate=True)
    assert cp.encode() == W("f6ab0e18 01 01 03 3f")
    assert ConnectPrivate.decode(cp.encode()) == cp
    assert ConnectPrivate.decode(W("f6ab0e18 01 00 00 ff") + b"pad") == ConnectPrivate(
        1024, 256 * 1024
    )
    assert ConnectPrivate.decode(W("f6ab0e18 01 fe 00 00")).remote_invalidate is False


@pytest.mark.parametrize("size", [0, 512, 1000, 4097, 257 * 1024])
def test_private_data_sizes_must_be_whole_kib(size: int) -> None:
    with pytest.raises(ValueError):
        ConnectPrivate(size, 1024).encode()


def test_private_data_refusals_and_defaults() -> None:
    good = ConnectPrivate(2048, 8192).encode()
    for n in range(len(good)):
        with pytest.raises(XdrError):
            ConnectPrivate.decode(good[:n])
        assert peer_sizes(good[:n]) == ConnectPrivate(1024, 1024)
    with pytest.raises(XdrError, match="magic"):
        ConnectPrivate.decode(W("f6ab0e19 01 00 00 00"))
    with pytest.raises(XdrError, match="version 2"):
        ConnectPrivate.decode(W("f6ab0e18 02 00 00 00"))
    assert peer_sizes(b"") == ConnectPrivate(1024, 1024)
    assert peer_sizes(good) == ConnectPrivate(2048, 8192)


@given(st.integers(1, 256), st.integers(1, 256), st.booleans())
def test_private_data_round_trip(send: int, recv: int, inv: bool) -> None:
    cp = ConnectPrivate(send * 1024, recv * 1024, inv)
    assert ConnectPrivate.decode(cp.encode()) == cp


@given(headers | errors)
def test_a_plain_header_is_told_apart_and_encodes_as_the_codec_does(h: Message) -> None:
    """``peek_plain`` says xid and credit exactly for an RDMA_MSG without chunks (the
    responder's fast path), and ``plain_header`` is that header's encoding."""
    data = h.encode()
    plain = (
        isinstance(h, Header)
        and h.proc == Proc.RDMA_MSG
        and not (h.read_list or h.write_list or h.reply_chunk is not None)
    )
    assert peek_plain(data + b"rpc") == ((h.xid, h.credit) if plain else None)
    if plain:
        assert plain_header(h.xid, h.credit) == data
        assert len(data) == PLAIN_LEN
