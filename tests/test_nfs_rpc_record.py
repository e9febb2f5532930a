"""RPC record marking (RFC 5531 §11): fragments split anywhere, bounds, encoding."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmashim.ulps.nfsrdma.record import RecordDecoder, RecordTooLarge, record_marks


def fragment(data: bytes, last: bool = True) -> bytes:
    return struct.pack(">I", len(data) | (0x8000_0000 if last else 0)) + data


def test_one_fragment_record() -> None:
    assert RecordDecoder().feed(fragment(b"\1\2\3\4")) == [b"\1\2\3\4"]


def test_a_whole_record_read_in_one_piece_is_a_view_of_it_not_a_copy() -> None:
    decoder = RecordDecoder(max_record=10)
    data = fragment(b"0123456789")
    (record,) = decoder.feed(data)
    assert isinstance(record, memoryview) and record.obj is data and record == b"0123456789"
    assert not decoder.pending
    with pytest.raises(RecordTooLarge):  # (the bound holds for a whole record too)
        decoder.feed(fragment(b"0123456789x"))
    decoder = RecordDecoder()
    assert decoder.feed(fragment(b"ab")[:3]) == [] and decoder.pending  # (a part: copied)
    assert decoder.feed(fragment(b"ab")[3:]) == [b"ab"] and not decoder.pending


def test_a_record_of_several_fragments_and_records_back_to_back() -> None:
    stream = fragment(b"ab", last=False) + fragment(b"", last=False) + fragment(b"cde")
    stream += fragment(b"") + fragment(b"xyz")
    assert RecordDecoder().feed(stream) == [b"abcde", b"", b"xyz"]


def test_split_at_every_byte_gives_the_same_records() -> None:
    stream = fragment(b"first", last=False) + fragment(b"-part") + fragment(b"2nd record")
    for cut in range(len(stream) + 1):
        decoder = RecordDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert got == [b"first-part", b"2nd record"], cut
        assert not decoder.pending
    decoder = RecordDecoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
        assert decoder.pending == (i + 1 not in (len(stream) - 14, len(stream))), i
    assert got == [b"first-part", b"2nd record"]


def test_an_oversized_record_fails_at_its_header() -> None:
    decoder = RecordDecoder(max_record=10)
    assert decoder.feed(fragment(b"0123456789")) == [b"0123456789"]
    with pytest.raises(RecordTooLarge):
        decoder.feed(struct.pack(">I", 0xFFFF_FFFF))  # 2 GiB announced, nothing sent
    decoder = RecordDecoder(max_record=10)
    with pytest.raises(RecordTooLarge):  # the bound is on the record, not each fragment
        decoder.feed(fragment(b"012345", last=False) + fragment(b"6789x"))


def test_empty_fragments_keep_a_record_pending() -> None:
    decoder = RecordDecoder()
    for _ in range(3):
        assert decoder.feed(fragment(b"", last=False)) == []
        assert decoder.pending


def test_record_marks_are_one_fragment_by_default() -> None:
    assert b"".join(record_marks([b"ab", memoryview(b"cd")])) == fragment(b"abcd")
    assert b"".join(record_marks([])) == fragment(b"")


def test_record_marks_split_into_fragments() -> None:
    marked = b"".join(record_marks([b"abc", b"defg"], max_fragment=3))
    assert marked == fragment(b"abc", False) + fragment(b"def", False) + fragment(b"g")
    assert b"".join(record_marks([b"abcdef"], max_fragment=3)) == (
        fragment(b"abc", False) + fragment(b"def")
    )
    with pytest.raises(ValueError):
        record_marks([b"a"], max_fragment=0)


@given(
    st.lists(st.binary(max_size=40), max_size=5),
    st.integers(1, 16),
    st.lists(st.integers(1, 50), min_size=1, max_size=8),
)
def test_round_trip(messages: list[bytes], max_fragment: int, chunk_sizes: list[int]) -> None:
    stream = b"".join(b"".join(record_marks([m], max_fragment)) for m in messages)
    decoder = RecordDecoder(max_record=64)
    got: list[bytes] = []
    pos = 0
    i = 0
    while pos < len(stream):
        size = chunk_sizes[i % len(chunk_sizes)]
        got += decoder.feed(memoryview(stream)[pos : pos + size])
        pos += size
        i += 1
    assert got == messages
    assert not decoder.pending
