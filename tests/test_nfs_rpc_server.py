"""RpcServer: the reply to every kind of call, good and bad, byte by byte."""

from __future__ import annotations

import struct

import pytest
from nfsecho import ECHO, ECHO_DDP, ECHO_PROG, FAIL, NULL, WEAK, WHOAMI, Echo

from rdmashim.ulps.nfsrdma.rpc import (
    NULL_AUTH,
    AuthError,
    AuthStat,
    CallHeader,
    GarbageArgs,
    OpaqueAuth,
    PendingCall,
    ProcUnavail,
    ProgMismatch,
    ProgUnavail,
    RpcMismatch,
    RpcServer,
    SystemErr,
    decode_reply,
    encode_call,
    pack_call_header,
)
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer

PEER = ("192.0.2.7", 871)
XID = 0x1234ABCD
ME = AuthSys(stamp=5, machinename="client", uid=1000, gid=100, gids=(100, 27))


def words(*values: int) -> bytes:
    return struct.pack(f">{len(values)}I", *values)


def opaque(data: bytes) -> bytes:
    return words(len(data)) + data + bytes(-len(data) & 3)


async def answer(message: bytes) -> bytes | None:
    reply = await RpcServer([Echo()]).handle_call(memoryview(message), PEER, "tcp")
    return None if reply is None else b"".join(reply.inline())


def call_bytes(
    proc: int,
    args: bytes = b"",
    *,
    prog: int = ECHO_PROG,
    vers: int = 1,
    cred: OpaqueAuth = NULL_AUTH,
    verf: OpaqueAuth = NULL_AUTH,
    rpcvers: int = 2,
) -> bytes:
    p = Packer()
    pack_call_header(p, CallHeader(XID, prog, vers, proc, cred, verf, rpcvers))
    return p.getvalue() + args


ACCEPTED = words(XID, 1, 0, 0, 0)  # xid, REPLY, MSG_ACCEPTED, verifier AUTH_NONE + empty body


async def test_success_is_the_accepted_header_then_the_results() -> None:
    assert await answer(call_bytes(ECHO, opaque(b"hello"))) == ACCEPTED + words(0) + opaque(
        b"hello"
    )
    assert await answer(call_bytes(NULL)) == ACCEPTED + words(0)


async def test_ddp_offsets_count_from_the_start_of_the_reply_message() -> None:
    server = RpcServer([Echo()])
    reply = await server.handle_call(memoryview(call_bytes(ECHO_DDP, opaque(b"abc"))), PEER, "rdma")
    assert reply is not None
    assert [(offset, bytes(item)) for offset, item in reply.ddp] == [(len(ACCEPTED) + 8, b"abc")]
    assert bytes(reply.packer.data) == ACCEPTED + words(0, 3)


async def test_the_program_sees_the_credential_and_the_transport() -> None:
    reply = await answer(call_bytes(WHOAMI, cred=OpaqueAuth.sys(ME)))
    assert reply == ACCEPTED + words(0) + opaque(b"tcp") + words(1000)
    assert await answer(call_bytes(WHOAMI)) == ACCEPTED + words(0) + opaque(b"tcp") + words(
        2**32 - 1
    )


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (call_bytes(NULL, prog=100003), ACCEPTED + words(1)),  # PROG_UNAVAIL
        (call_bytes(NULL, vers=3), ACCEPTED + words(2, 1, 2)),  # PROG_MISMATCH 1..2
        (call_bytes(NULL, vers=0), ACCEPTED + words(2, 1, 2)),
        (call_bytes(99), ACCEPTED + words(3)),  # PROC_UNAVAIL
        (call_bytes(ECHO, words(8) + b"abc"), ACCEPTED + words(4)),  # GARBAGE_ARGS: short
        (call_bytes(ECHO, opaque(b"abc") + b"more"), ACCEPTED + words(4)),  # left over
        (call_bytes(NULL, b"\0\0\0\0"), ACCEPTED + words(4)),
        (call_bytes(FAIL), ACCEPTED + words(5)),  # SYSTEM_ERR
        (call_bytes(NULL, rpcvers=3), words(XID, 1, 1, 0, 2, 2)),  # denied RPC_MISMATCH 2..2
        (words(XID, 0, 1), words(XID, 1, 1, 0, 2, 2)),
        (call_bytes(NULL, cred=OpaqueAuth(6, b"gss")), words(XID, 1, 1, 1, 1)),  # AUTH_BADCRED
        (call_bytes(NULL, cred=OpaqueAuth(1, b"junk")), words(XID, 1, 1, 1, 1)),
        (call_bytes(NULL, verf=OpaqueAuth(1, b"")), words(XID, 1, 1, 1, 3)),  # AUTH_BADVERF
        (call_bytes(WEAK), words(XID, 1, 1, 1, 5)),  # AUTH_TOOWEAK, from the program
    ],
)
async def test_every_failure_has_its_reply(message: bytes, expected: bytes) -> None:
    assert await answer(message) == expected


async def test_a_failing_program_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    await answer(call_bytes(FAIL))
    assert "the program failed" in caplog.text


async def test_a_message_cut_anywhere_after_the_message_type_is_still_answered() -> None:
    cred = OpaqueAuth.sys(ME)
    whole = call_bytes(ECHO, opaque(b"data"), cred=cred)
    cred_end = 32 + len(cred.body)
    for cut in range(8, len(whole)):
        if cut < 24 or cut >= cred_end + 8:  # the fixed header or the arguments
            expected = ACCEPTED + words(4)  # GARBAGE_ARGS
        elif cut < cred_end:
            expected = words(XID, 1, 1, 1, 1)  # AUTH_BADCRED
        else:
            expected = words(XID, 1, 1, 1, 3)  # AUTH_BADVERF
        assert await answer(whole[:cut]) == expected, cut


async def test_auth_bodies_over_their_bounds_are_bad_credentials() -> None:
    long_name = AuthSys(0, "m" * 256, 0, 0)
    many_gids = AuthSys(0, "m", 0, 0, tuple(range(17)))
    too_long = OpaqueAuth(1, bytes(404))
    for cred in (OpaqueAuth.sys(long_name), OpaqueAuth.sys(many_gids), too_long):
        assert await answer(call_bytes(NULL, cred=cred)) == words(XID, 1, 1, 1, 1)
    at_bounds = AuthSys(0, "m" * 255, 0, 0, tuple(range(16)))
    assert await answer(call_bytes(NULL, cred=OpaqueAuth.sys(at_bounds))) == ACCEPTED + words(0)


async def test_messages_that_are_not_calls_get_no_reply(caplog: pytest.LogCaptureFixture) -> None:
    assert await answer(b"") is None
    assert await answer(words(XID)) is None
    assert await answer(words(XID, 1, 0, 0, 0, 0)) is None  # a reply
    assert await answer(words(XID, 7)) is None
    assert "not a call" in caplog.text


def test_programs_must_have_distinct_numbers() -> None:
    with pytest.raises(ValueError, match="given twice"):
        RpcServer([Echo(), Echo()])


async def test_the_client_helpers_read_every_reply_the_server_makes() -> None:
    server = RpcServer([Echo()])

    async def roundtrip(
        prog: int, vers: int, proc: int, args: bytes, cred: OpaqueAuth | None = None
    ) -> bytes:
        request = Reply()
        request.packer.data += args
        call = encode_call(XID, prog, vers, proc, cred, request)
        reply = await server.handle_call(memoryview(b"".join(call.inline())), PEER, "tcp")
        assert reply is not None
        xid, results = decode_reply(b"".join(reply.inline()))
        assert xid == XID
        return bytes(results.rest_view())

    assert await roundtrip(ECHO_PROG, 2, ECHO, opaque(b"xy")) == opaque(b"xy")
    with pytest.raises(ProgUnavail):
        await roundtrip(1, 1, NULL, b"")
    with pytest.raises(ProgMismatch) as mismatch:
        await roundtrip(ECHO_PROG, 7, NULL, b"")
    assert (mismatch.value.low, mismatch.value.high) == (1, 2)
    with pytest.raises(ProcUnavail):
        await roundtrip(ECHO_PROG, 1, 42, b"")
    with pytest.raises(GarbageArgs):
        await roundtrip(ECHO_PROG, 1, ECHO, b"\0")
    with pytest.raises(SystemErr):
        await roundtrip(ECHO_PROG, 1, FAIL, b"")
    with pytest.raises(AuthError) as denied:
        await roundtrip(ECHO_PROG, 1, NULL, b"", OpaqueAuth(3, b""))
    assert denied.value.stat is AuthStat.AUTH_BADCRED
    reply = await server.handle_call(memoryview(call_bytes(NULL, rpcvers=1)), PEER, "tcp")
    assert reply is not None
    with pytest.raises(RpcMismatch) as rpcvers:
        decode_reply(bytes(reply.packer.data))
    assert (rpcvers.value.low, rpcvers.value.high) == (2, 2)


async def test_a_credential_seen_before_decodes_the_same() -> None:
    """The server keeps decoded credentials by their bytes: a second call with the same
    bytes is the same caller, other bytes another, a bad credential never kept."""
    server = RpcServer([Echo()])
    other = AuthSys(stamp=5, machinename="client", uid=1001, gid=100, gids=(100, 27))

    async def uid(cred: OpaqueAuth) -> int:
        reply = await server.handle_call(memoryview(call_bytes(WHOAMI, cred=cred)), PEER, "tcp")
        assert reply is not None
        results = decode_reply(b"".join(reply.inline()))[1]
        results.string()
        return results.uint()

    for _ in range(2):
        assert await uid(OpaqueAuth.sys(ME)) == 1000
        assert await uid(OpaqueAuth.sys(other)) == 1001
        assert await uid(NULL_AUTH) == 0xFFFFFFFF
        with pytest.raises(AuthError) as bad:
            await uid(OpaqueAuth(1, OpaqueAuth.sys(ME).body[:-4]))  # AUTH_SYS cut short
        assert bad.value.stat == AuthStat.AUTH_BADCRED


async def test_call_now_answers_at_once_what_needs_no_task() -> None:
    """``call_now`` gives every error reply at once, a call its program cannot carry out
    at once as a PendingCall, whose ``finish`` is the reply ``handle_call`` gives."""
    server = RpcServer([Echo()])
    unavailable = server.call_now(memoryview(call_bytes(NULL, prog=7)), PEER, "tcp")
    assert isinstance(unavailable, Reply)
    with pytest.raises(ProgUnavail):
        decode_reply(b"".join(unavailable.inline()))
    now = server.call_now(memoryview(call_bytes(NULL)), PEER, "tcp")  # Echo's dispatch_now
    assert isinstance(now, Reply)
    assert b"".join(now.inline()) == ACCEPTED + words(0)
    echo = call_bytes(ECHO, opaque(b"later"))
    pending = server.call_now(memoryview(echo), PEER, "tcp")
    assert isinstance(pending, PendingCall)
    assert b"".join((await pending.finish()).inline()) == await answer(echo)
