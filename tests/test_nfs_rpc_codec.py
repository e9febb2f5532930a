"""ONC RPC codecs byte by byte: every field, every truncation, round trips."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rdmashim.ulps.nfsrdma.rpc import (
    AcceptStat,
    AuthError,
    AuthStat,
    CallHeader,
    OpaqueAuth,
    RpcError,
    accepted_error,
    accepted_reply,
    auth_error,
    decode_reply,
    encode_call,
    pack_call_header,
    rpc_mismatch,
    unpack_auth_sys,
    unpack_call_header,
)
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError


def words(*values: int) -> bytes:
    return struct.pack(f">{len(values)}I", *values)


CRED = AuthSys(stamp=0x01020304, machinename="abcde", uid=1000, gid=100, gids=(4, 24))
CRED_BODY = words(0x01020304, 5) + b"abcde\0\0\0" + words(1000, 100, 2, 4, 24)


def test_auth_sys_fields() -> None:
    assert OpaqueAuth.sys(CRED) == OpaqueAuth(1, CRED_BODY)
    assert unpack_auth_sys(CRED_BODY) == CRED


def test_call_header_fields() -> None:
    p = Packer()
    header = CallHeader(0xDEADBEEF, 100003, 3, 6, OpaqueAuth.sys(CRED))
    pack_call_header(p, header)
    assert p.getvalue() == (
        words(0xDEADBEEF, 0, 2, 100003, 3, 6, 1, len(CRED_BODY)) + CRED_BODY + words(0, 0)
    )
    u = Unpacker(p.getvalue() + b"args")
    assert unpack_call_header(u) == header
    assert bytes(u.rest_view()) == b"args"


def test_encode_call_shifts_ddp_marks_past_the_header() -> None:
    args = Reply()
    args.packer.uhyper(7)
    args.opaque_ddp(b"write data")
    call = encode_call(9, 100003, 3, 7, CRED, args)
    header = len(call.packer.data) - 12
    assert [(offset, bytes(item)) for offset, item in call.ddp] == [(header + 12, b"write data")]
    u = Unpacker(b"".join(call.inline()))
    assert unpack_call_header(u) == CallHeader(9, 100003, 3, 7, OpaqueAuth.sys(CRED))
    assert (u.uhyper(), u.opaque()) == (7, b"write data")
    assert encode_call(1, 2, 3, 4, None, Reply()).packer.data == words(1, 0, 2, 2, 3, 4, 0, 0, 0, 0)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (accepted_reply(5), words(5, 1, 0, 0, 0, 0)),
        (accepted_error(5, AcceptStat.PROG_UNAVAIL), words(5, 1, 0, 0, 0, 1)),
        (accepted_error(5, AcceptStat.PROG_MISMATCH, 2, 4), words(5, 1, 0, 0, 0, 2, 2, 4)),
        (accepted_error(5, AcceptStat.PROC_UNAVAIL), words(5, 1, 0, 0, 0, 3)),
        (accepted_error(5, AcceptStat.GARBAGE_ARGS), words(5, 1, 0, 0, 0, 4)),
        (accepted_error(5, AcceptStat.SYSTEM_ERR), words(5, 1, 0, 0, 0, 5)),
        (rpc_mismatch(5), words(5, 1, 1, 0, 2, 2)),
        (auth_error(5, AuthStat.AUTH_TOOWEAK), words(5, 1, 1, 1, 5)),
    ],
)
def test_reply_fields(reply: Reply, expected: bytes) -> None:
    assert bytes(reply.packer.data) == expected


def test_success_needs_results() -> None:
    with pytest.raises(ValueError):
        accepted_error(5, AcceptStat.SUCCESS)


def test_decode_reply_reads_results_and_names_errors() -> None:
    xid, results = decode_reply(words(5, 1, 0, 1, 4, 7, 0, 42))  # an AUTH_SYS verifier is skipped
    assert (xid, results.uint()) == (5, 42)
    with pytest.raises(AuthError) as denied:
        decode_reply(words(5, 1, 1, 1, 2))
    assert denied.value.stat is AuthStat.AUTH_REJECTEDCRED
    for bad in (
        words(5, 0),
        words(5, 1, 2),
        words(5, 1, 0, 0, 0, 9),
        words(5, 1, 1, 2),
        words(5, 1, 1, 1, 99),
    ):
        with pytest.raises(XdrError):
            decode_reply(bad)


REPLIES = [
    words(5, 1, 0, 0, 0, 2, 2, 4),
    words(5, 1, 1, 0, 2, 2),
    words(5, 1, 1, 1, 5),
    words(5, 1, 0, 1, 4, 7, 0, 42),
]


@pytest.mark.parametrize("message", REPLIES)
def test_every_truncated_reply_is_an_xdr_error(message: bytes) -> None:
    for cut in range(len(message)):
        with pytest.raises(XdrError):
            try:
                decode_reply(message[:cut])[1].uint()
            except RpcError:
                pytest.fail(f"cut at {cut} decoded as an RPC error")


def test_every_truncated_call_header_is_an_xdr_error() -> None:
    p = Packer()
    pack_call_header(p, CallHeader(1, 2, 3, 4, OpaqueAuth.sys(CRED), OpaqueAuth(0, b"v")))
    whole = p.getvalue()
    for cut in range(len(whole)):
        with pytest.raises(XdrError):
            unpack_call_header(Unpacker(whole[:cut]))
    for cut in range(len(CRED_BODY)):
        with pytest.raises(XdrError):
            unpack_auth_sys(CRED_BODY[:cut])
    with pytest.raises(XdrError):
        unpack_auth_sys(CRED_BODY + b"\0\0\0\0")  # left over


def test_not_a_call_is_an_xdr_error() -> None:
    with pytest.raises(XdrError):
        unpack_call_header(Unpacker(words(1, 1, 2, 3, 4, 5, 0, 0, 0, 0)))


u32 = st.integers(0, 2**32 - 1)
auth_sys = st.builds(
    AuthSys,
    stamp=u32,
    machinename=st.text(max_size=60).filter(
        lambda s: len(s.encode("utf-8", "surrogateescape")) <= 255
    ),
    uid=u32,
    gid=u32,
    gids=st.lists(u32, max_size=16).map(tuple),
)
opaque_auth = st.builds(OpaqueAuth, flavor=u32, body=st.binary(max_size=400))


@given(auth_sys)
def test_auth_sys_round_trip(cred: AuthSys) -> None:
    assert unpack_auth_sys(OpaqueAuth.sys(cred).body) == cred


@given(
    u32,
    u32,
    u32,
    u32,
    st.one_of(opaque_auth, auth_sys.map(OpaqueAuth.sys)),
    opaque_auth,
    st.binary(max_size=64),
)
def test_call_round_trip(
    xid: int, prog: int, vers: int, proc: int, cred: OpaqueAuth, verf: OpaqueAuth, args: bytes
) -> None:
    header = CallHeader(xid, prog, vers, proc, cred, verf)
    p = Packer()
    pack_call_header(p, header)
    u = Unpacker(p.getvalue() + args)
    assert unpack_call_header(u) == header
    assert bytes(u.rest_view()) == args


@given(u32, st.sampled_from(list(AcceptStat)[1:]), u32, u32)
def test_error_reply_round_trip(xid: int, stat: AcceptStat, low: int, high: int) -> None:
    reply = bytes(accepted_error(xid, stat, low, high).packer.data)
    with pytest.raises(RpcError) as error:
        decode_reply(reply)
    if stat is AcceptStat.PROG_MISMATCH:
        assert (error.value.low, error.value.high) == (low, high)  # type: ignore[attr-defined]
