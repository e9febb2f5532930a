"""XDR (RFC 4506) byte by byte: the encodings, and every way bad input is refused."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError


def test_integers_and_booleans_are_big_endian_words() -> None:
    p = Packer()
    p.uint(1)
    p.int32(-2)
    p.uhyper(0x0102030405060708)
    p.hyper(-1)
    p.boolean(True)
    assert p.getvalue() == bytes.fromhex("00000001fffffffe0102030405060708ffffffffffffffff00000001")
    u = Unpacker(p.getvalue())
    assert (u.uint(), u.int32(), u.uhyper(), u.hyper(), u.boolean()) == (
        1, -2, 0x0102030405060708, -1, True,
    )  # fmt: skip
    u.done()


def test_opaque_and_string_are_padded_to_four_bytes() -> None:
    p = Packer()
    p.opaque(b"abcde")
    p.string("hi")
    p.fopaque(b"xyz", 3)
    assert p.getvalue() == (b"\0\0\0\x05abcde\0\0\0" + b"\0\0\0\x02hi\0\0" + b"xyz\0")
    u = Unpacker(p.getvalue())
    assert (u.opaque(), u.string(), u.fopaque(3)) == (b"abcde", "hi", b"xyz")
    u.done()


def test_arrays_and_optionals() -> None:
    p = Packer()
    p.array([1, 2, 3], p.uint)
    p.optional(None, p.uint)
    p.optional(7, p.uint)
    u = Unpacker(p.getvalue())
    assert u.array(u.uint) == [1, 2, 3]
    assert u.optional(u.uint) is None
    assert u.optional(u.uint) == 7


@pytest.mark.parametrize(
    ("data", "read", "words"),
    [
        (b"\0\0\0", lambda u: u.uint(), "wanted"),
        (b"\0\0\0\x02", lambda u: u.boolean(), "boolean 2"),
        (b"\0\0\0\x05abcd", lambda u: u.opaque(), "wanted"),
        (b"\0\0\0\x01a\0\0\x01", lambda u: u.opaque(), "padding"),
        (b"\0\0\0\x09abcdefghi\0\0\0", lambda u: u.opaque(limit=8), "at most 8"),
        (b"\xff\xff\xff\xff", lambda u: u.array(u.uint), "at most"),
        (b"\0\0\x10\0", lambda u: u.array(u.uint), "items in"),
        (b"\0\0\0\x03\0\0\0\x01", lambda u: u.array(u.uint, limit=2), "at most 2"),
    ],
)
def test_bad_input_is_an_xdr_error(data: bytes, read: object, words: str) -> None:
    with pytest.raises(XdrError, match=words):
        read(Unpacker(data))  # type: ignore[operator]


def test_left_over_bytes_are_reported() -> None:
    u = Unpacker(b"\0\0\0\x01\0\0\0\x02")
    u.uint()
    with pytest.raises(XdrError, match="4 bytes left over"):
        u.done()


def test_a_fixed_opaque_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(XdrError):
        Packer().fopaque(b"ab", 3)


@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(0, 2**64 - 1))
def test_round_trip(blobs: list[bytes], number: int) -> None:
    p = Packer()
    p.array(blobs, p.opaque)
    p.uhyper(number)
    u = Unpacker(p.getvalue())
    assert u.array(u.opaque) == blobs and u.uhyper() == number
    u.done()


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_xdr_error(data: bytes) -> None:
    u = Unpacker(data)
    with contextlib.suppress(XdrError):
        u.array(lambda: (u.opaque(limit=32), u.optional(u.hyper)), limit=16)
