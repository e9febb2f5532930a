"""The Network Lock Manager: its XDR byte by byte, the lock table, and the program over TCP.

End to end, an :class:`NlmProgram` over a real export is served by
:func:`serve_tcp`; clients call it with our RPC client over real TCP. For
blocking locks the test is the client host too: a small NLM program of its
own (it answers GRANTED callbacks) on a TCP port of its own, registered with
an rpcbind of its own, which the server asks where to call back, as it asks
a client host's rpcbind. :func:`serve_nfs` is checked to register NLM with
its rpcbind and to answer it on its TCP port.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from rdmashim.ulps.nfsrdma import nlm_types as n
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nlm import NlmProgram
from rdmashim.ulps.nfsrdma.nlm_locks import (
    TO_EOF,
    HeldLock,
    LockTable,
    NoLocks,
    RangeTooBig,
    Waiter,
    lock_range,
    wire_range,
)
from rdmashim.ulps.nfsrdma.rpc import ProcUnavail, RpcServer
from rdmashim.ulps.nfsrdma.rpcbind import Registry, Rpcbind, getport
from rdmashim.ulps.nfsrdma.server import ServerConfig, serve_nfs
from rdmashim.ulps.nfsrdma.service import CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.tcp import RpcTcpClient, connect_tcp, serve_tcp
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError

S = n.Nlm4Stat
FH = bytes(range(32))

# ---------------------------------------------------------------- codecs


def test_lockargs_v4_bytes() -> None:
    lock = n.Lock("host", b"\x01\x02\x03", b"oh", -2, 1 << 40, 0)
    p = Packer()
    n.pack_lockargs(p, n.LockArgs(b"ck", True, False, lock, reclaim=True, state=7), n.NLM_V4)
    want = (
        struct.pack(">I2s2x", 2, b"ck")  # cookie
        + struct.pack(">II", 1, 0)  # block, exclusive
        + struct.pack(">I4s", 4, b"host")  # caller_name
        + struct.pack(">I3sx", 3, b"\x01\x02\x03")  # fh
        + struct.pack(">I2s2x", 2, b"oh")
        + struct.pack(">i", -2)  # svid
        + struct.pack(">QQ", 1 << 40, 0)  # l_offset, l_len: 64 bits
        + struct.pack(">Ii", 1, 7)  # reclaim, state
    )
    assert p.getvalue() == want
    u = Unpacker(want)
    assert n.unpack_lockargs(u, n.NLM_V4) == n.LockArgs(b"ck", True, False, lock, True, 7)
    u.done()


def test_lock_v1_has_32_bit_offsets() -> None:
    lock = n.Lock("h", b"", b"", 5, 10, 20)
    p = Packer()
    n.pack_lock(p, lock, n.NLM_V1)
    assert p.getvalue()[-8:] == struct.pack(">II", 10, 20)
    assert len(p.getvalue()) == 8 + 4 + 4 + 4 + 8
    assert n.unpack_lock(Unpacker(p.getvalue()), n.NLM_V1) == lock


def test_testres_bytes_and_holder_clipped_before_v4() -> None:
    holder = n.Holder(True, 9, b"o", 1 << 33, 5)
    p = Packer()
    n.pack_testres(p, b"", S.DENIED, holder, n.NLM_V4)
    assert p.getvalue() == struct.pack(">IIIiI1s3xQQ", 0, 1, 1, 9, 1, b"o", 1 << 33, 5)
    assert n.unpack_testres(Unpacker(p.getvalue()), n.NLM_V4) == (b"", S.DENIED, holder)
    p = Packer()
    n.pack_testres(p, b"", S.DENIED, holder, n.NLM_V3)  # past 4 GiB: to the end from 2**32-1
    assert n.unpack_testres(Unpacker(p.getvalue()), n.NLM_V3)[2] == n.Holder(
        True, 9, b"o", 0xFFFF_FFFF, 0
    )
    p = Packer()
    n.pack_testres(p, b"c", S.GRANTED, None, n.NLM_V4)
    assert p.getvalue() == struct.pack(">I1s3xI", 1, b"c", 0)


def test_statuses_before_v4_are_cast() -> None:
    assert n.wire_stat(S.STALE_FH, n.NLM_V4) == 7
    assert n.wire_stat(S.STALE_FH, n.NLM_V3) == S.DENIED_NOLOCKS
    assert n.wire_stat(S.FBIG, n.NLM_V1) == S.DENIED_NOLOCKS
    assert n.wire_stat(S.DEADLCK, n.NLM_V3) == S.DENIED
    assert n.wire_stat(S.DENIED_GRACE_PERIOD, n.NLM_V1) == 4


def test_share_and_notify_codecs() -> None:
    share = n.Share("pc", FH, b"x", n.ShareMode.DENY_WRITE, n.ShareAccess.READ)
    p = Packer()
    n.pack_shareargs(p, n.ShareArgs(b"k", share, True))
    assert n.unpack_shareargs(Unpacker(p.getvalue())) == n.ShareArgs(b"k", share, True)
    bad = bytearray(p.getvalue())
    struct.pack_into(">I", bad, len(bad) - 12, 4)  # fsh4_mode 4 does not exist
    with pytest.raises(XdrError):
        n.unpack_shareargs(Unpacker(bytes(bad)))
    p = Packer()
    n.pack_notify(p, n.Notify("client", 3))
    assert p.getvalue() == struct.pack(">I6s2xi", 6, b"client", 3)
    p = Packer()
    n.pack_shareres(p, b"", S.DENIED, n.NLM_V4)
    assert p.getvalue() == struct.pack(">IIi", 0, 1, 0)


@given(
    st.sampled_from([n.NLM_V1, n.NLM_V3, n.NLM_V4]),
    st.binary(max_size=n.MAXNETOBJ_SZ),
    st.booleans(),
    st.booleans(),
    st.text(max_size=64),
    st.integers(-(2**31), 2**31 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
)
def test_args_round_trip_and_every_truncation_is_refused(
    vers: int, cookie: bytes, block: bool, excl: bool, name: str, svid: int, off: int, ln: int
) -> None:
    lock = n.Lock(name, FH, cookie[:8], svid, off, ln)
    for args, pack, unpack in (
        (n.LockArgs(cookie, block, excl, lock, excl, svid), n.pack_lockargs, n.unpack_lockargs),
        (n.TestArgs(cookie, excl, lock), n.pack_testargs, n.unpack_testargs),
        (n.CancArgs(cookie, block, excl, lock), n.pack_cancargs, n.unpack_cancargs),
        (n.UnlockArgs(cookie, lock), n.pack_unlockargs, n.unpack_unlockargs),
    ):
        p = Packer()
        pack(p, args, vers)  # type: ignore[operator]
        data = p.getvalue()
        assert unpack(Unpacker(data), vers) == args  # type: ignore[operator]
        with pytest.raises(XdrError):
            unpack(Unpacker(data[: len(data) - 4]), vers)  # type: ignore[operator]


def test_names_and_netobjs_are_bounded() -> None:
    p = Packer()
    n.pack_lock(p, n.Lock("h" * (n.LM_MAXSTRLEN + 1), FH, b"", 0, 0, 0), n.NLM_V4)
    with pytest.raises(XdrError):
        n.unpack_lock(Unpacker(p.getvalue()), n.NLM_V4)
    p = Packer()
    n.pack_lock(p, n.Lock("h", bytes(n.MAXNETOBJ_SZ + 1), b"", 0, 0, 0), n.NLM_V4)
    with pytest.raises(XdrError):
        n.unpack_lock(Unpacker(p.getvalue()), n.NLM_V4)


# ---------------------------------------------------------------- the lock table

A, B = ("a", 1), ("b", 1)


def spans(table: LockTable, file: object = "f") -> list[tuple[str, int, int, bool]]:
    return sorted((lk.owner[0], lk.start, lk.end, lk.exclusive) for lk in table.locks(file))


def test_ranges_and_64_bit_edges() -> None:
    assert lock_range(5, 0) == (5, TO_EOF)
    assert lock_range(2**64 - 1, 1) == (2**64 - 1, TO_EOF)
    assert lock_range(0, 2**64 - 1) == (0, 2**64 - 1)
    assert lock_range(1, 2**64 - 1) == (1, TO_EOF)
    with pytest.raises(RangeTooBig):
        lock_range(2**64 - 1, 2)
    with pytest.raises(RangeTooBig):
        lock_range(2, 2**64 - 1)
    assert wire_range(5, TO_EOF) == (5, 0)
    assert wire_range(5, 9) == (5, 4)


def test_shared_locks_share_exclusive_ones_conflict() -> None:
    t = LockTable()
    assert t.lock("f", A, b"", 0, 10, False) is None
    assert t.lock("f", B, b"", 5, 15, False) is None
    held = t.lock("f", B, b"", 9, 12, True)
    assert held == HeldLock(A, b"", 0, 10, False)
    assert t.conflict("f", B, 10, 20, True) is None  # A's ends where this starts
    assert t.lock("f", A, b"", 0, 10, True) == HeldLock(B, b"", 5, 15, False)
    assert t.lock("other", B, b"", 0, 10, True) is None  # another file
    assert t.conflict("f", ("a", 2), 0, 1, False) is None  # shared with shared
    assert t.conflict("f", ("a", 2), 0, 1, True) is not None  # same host, other svid


def test_own_locks_replace_merge_and_split() -> None:
    t = LockTable()
    assert t.lock("f", A, b"", 0, 10, False) is None
    assert t.lock("f", A, b"", 10, 20, False) is None  # adjacent: merged
    assert spans(t) == [("a", 0, 20, False)]
    assert t.lock("f", A, b"", 5, 8, True) is None  # upgrade the middle: three pieces
    assert spans(t) == [("a", 0, 5, False), ("a", 5, 8, True), ("a", 8, 20, False)]
    assert t.lock("f", A, b"", 5, 8, False) is None  # downgrade again: one lock
    assert spans(t) == [("a", 0, 20, False)]
    assert t.unlock("f", A, 5, 10)  # a hole: split
    assert spans(t) == [("a", 0, 5, False), ("a", 10, 20, False)]
    assert not t.unlock("f", A, 5, 10)  # nothing there
    assert not t.unlock("f", B, 0, TO_EOF)  # not B's
    assert t.lock("f", A, b"", 3, 0 + 12, False) is None  # bridges the hole
    assert spans(t) == [("a", 0, 20, False)]
    assert t.held("a") == 1
    assert t.unlock("f", A, 0, TO_EOF)
    assert spans(t) == [] and t.held() == 0


def test_to_eof_locks() -> None:
    t = LockTable()
    assert t.lock("f", A, b"", 100, TO_EOF, True) is None
    assert t.conflict("f", B, 2**64 - 1, TO_EOF, False) is not None
    assert t.conflict("f", B, 0, 100, True) is None
    assert t.unlock("f", A, 200, 300)
    assert spans(t) == [("a", 100, 200, True), ("a", 300, TO_EOF, True)]


def test_bounds() -> None:
    t = LockTable(max_total=3, max_per_host=2, max_waiters_per_host=1)
    assert t.lock("f", A, b"", 0, 10, True) is None
    assert t.lock("f", A, b"", 20, 30, True) is None
    with pytest.raises(NoLocks):
        t.lock("f", A, b"", 40, 50, True)  # a third for host a
    with pytest.raises(NoLocks):
        t.unlock("f", A, 2, 3)  # a split is one lock more
    assert spans(t) == [("a", 0, 10, True), ("a", 20, 30, True)]  # nothing changed
    assert t.lock("f", A, b"", 5, 25, True) is None  # merging all: fewer
    assert t.lock("f", B, b"", 40, 50, True) is None
    assert t.lock("g", ("c", 1), b"", 0, 1, True) is None
    with pytest.raises(NoLocks):
        t.lock("g", ("d", 1), b"", 5, 6, True)  # total
    t.wait(Waiter("f", B, b"", 0, 1, True))
    assert t.wait(Waiter("f", B, b"", 0, 1, True)) is t.waiters("f")[0]  # the same request
    with pytest.raises(NoLocks):
        t.wait(Waiter("f", B, b"", 1, 2, True))


def test_waiters_are_granted_in_order_when_free() -> None:
    t = LockTable()
    assert t.lock("f", A, b"", 0, TO_EOF, True) is None
    first = t.wait(Waiter("f", B, b"b", 0, 10, True))
    second = t.wait(Waiter("f", ("c", 1), b"c", 5, 6, False))
    third = t.wait(Waiter("f", ("d", 1), b"d", 50, 60, False))
    assert t.grant_waiters("f") == []
    t.unlock("f", A, 0, 40)
    assert t.grant_waiters("f") == [first]  # c still conflicts with b; d with a
    assert t.waiters("f") == [second, third]
    assert t.cancel("f", ("c", 1), 5, 6, False) is second
    assert t.cancel("f", ("c", 1), 5, 6, False) is None
    assert t.free_host("a") == ["f"]
    assert t.grant_waiters("f") == [third]
    assert spans(t) == [("b", 0, 10, True), ("d", 50, 60, False)]


def test_free_host_drops_locks_waiters_and_shares() -> None:
    t = LockTable()
    t.lock("f", A, b"", 0, 1, True)
    t.lock("g", ("a", 2), b"", 0, 1, True)
    t.wait(Waiter("f", ("a", 3), b"", 0, 1, True))
    assert t.share("h", "a", b"o", 0, 1)
    assert t.lock("g", B, b"", 5, 6, True) is None
    assert sorted(map(str, t.free_host("a"))) == ["f", "g", "h"]
    assert t.held("a") == 0 and t.waiters("f") == [] and spans(t, "g") == [("b", 5, 6, True)]
    assert t.share("h", "b", b"o", 3, 3)  # nothing of a's left in the way


def test_shares() -> None:
    t = LockTable()
    assert t.share("f", "a", b"1", n.ShareMode.DENY_WRITE, n.ShareAccess.READ)
    assert not t.share("f", "b", b"1", n.ShareMode.DENY_NONE, n.ShareAccess.WRITE)
    assert t.share("f", "b", b"1", n.ShareMode.DENY_NONE, n.ShareAccess.READ)
    assert not t.share("f", "c", b"1", n.ShareMode.DENY_READ, n.ShareAccess.NONE)
    assert t.share("f", "a", b"1", n.ShareMode.DENY_NONE, n.ShareAccess.READ)  # a changes its own
    assert t.share("f", "c", b"1", n.ShareMode.DENY_NONE, n.ShareAccess.WRITE)
    assert t.held() == 3
    assert t.unshare("f", "a", b"1") and not t.unshare("f", "a", b"1")
    assert t.held() == 2


# ---------------------------------------------------------------- over TCP


@dataclass
class Granted:
    """The test's own NLM program: it answers GRANTED callbacks with ``answer``."""

    answer: n.Nlm4Stat = S.GRANTED
    calls: list[tuple[str, n.TestArgs]] = field(default_factory=list)
    arrived: trio.Event = field(default_factory=trio.Event)
    number: int = n.NLM_PROG
    versions: tuple[int, int] = (n.NLM_V1, n.NLM_V4)

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        if ctx.proc != n.NLMPROC_GRANTED:
            raise ProcUnavailable(ctx.proc)
        granted = n.unpack_testargs(args, ctx.vers)
        self.calls.append((ctx.peer[0], granted))
        n.pack_res(reply.packer, granted.cookie, self.answer, ctx.vers)
        self.arrived.set()


@dataclass
class Bed:
    """The server's NLM, a file of its export, and the client host's callback side."""

    nlm: NlmProgram
    port: int
    fh: bytes
    key: object
    """The file's key in the lock table."""
    path: Path
    callbacks: Granted


@asynccontextmanager
async def nlm_bed(
    tmp_path: Path, *, grace: float = 0.0, callbacks: bool = True
) -> AsyncIterator[Bed]:
    (tmp_path / "export").mkdir(parents=True)
    (tmp_path / "export" / "file").write_bytes(b"data")
    export = Export(tmp_path / "export", state_dir=tmp_path / "state")
    root = export.root()
    node = export.child(root, "file")
    fh = export.handle(node)
    for held in (root, node):
        os.close(held.fd)
    granted = Granted()
    registry = Registry()
    async with trio.open_nursery() as nursery:
        # the client host: its NLM (the callback side) and its rpcbind
        client_listeners = await nursery.start(serve_tcp, RpcServer([granted]), 0, "127.0.0.1")
        if callbacks:
            registry.add(n.NLM_PROG, n.NLM_V4, "tcp", client_listeners[0].socket.getsockname()[1])
            registry.add(n.NLM_PROG, n.NLM_V1, "tcp", client_listeners[0].socket.getsockname()[1])
        rpcbind = await nursery.start(serve_tcp, RpcServer([Rpcbind(registry)]), 0, "127.0.0.1")
        # the server
        nlm = NlmProgram(
            export, grace=grace, callback_rpcbind_port=rpcbind[0].socket.getsockname()[1]
        )
        await nursery.start(nlm.run)
        listeners = await nursery.start(serve_tcp, RpcServer([nlm]), 0, "127.0.0.1")
        try:
            port = listeners[0].socket.getsockname()[1]
            yield Bed(nlm, port, fh, export.codec.decode(fh), tmp_path, granted)
        finally:
            nursery.cancel_scope.cancel()
            export.close()


@dataclass
class Host:
    """An NLM client host calling the server: LOCK, TEST, CANCEL, UNLOCK for its owners."""

    rpc: RpcTcpClient
    name: str
    fh: bytes
    vers: int = n.NLM_V4

    def lock_of(self, svid: int, offset: int, length: int, fh: bytes | None = None) -> n.Lock:
        return n.Lock(
            self.name, self.fh if fh is None else fh, f"{svid}@x".encode(), svid, offset, length
        )

    async def _res(self, proc: int, pack: object, args: object) -> n.Nlm4Stat:
        r = Reply()
        pack(r.packer, args, self.vers)  # type: ignore[operator]
        u = await self.rpc.call(n.NLM_PROG, self.vers, proc, r)
        cookie, stat = n.unpack_res(u)
        assert cookie == b"cookie"
        return stat

    async def lock(
        self, svid: int, offset: int, length: int, *, excl: bool = True, block: bool = False,
        reclaim: bool = False, fh: bytes | None = None,
    ) -> n.Nlm4Stat:  # fmt: skip
        args = n.LockArgs(b"cookie", block, excl, self.lock_of(svid, offset, length, fh), reclaim)
        return await self._res(n.NLMPROC_LOCK, n.pack_lockargs, args)

    async def unlock(self, svid: int, offset: int, length: int) -> n.Nlm4Stat:
        args = n.UnlockArgs(b"cookie", self.lock_of(svid, offset, length))
        return await self._res(n.NLMPROC_UNLOCK, n.pack_unlockargs, args)

    async def cancel(self, svid: int, offset: int, length: int, *, excl: bool = True) -> n.Nlm4Stat:
        args = n.CancArgs(b"cookie", True, excl, self.lock_of(svid, offset, length))
        return await self._res(n.NLMPROC_CANCEL, n.pack_cancargs, args)

    async def test(
        self, svid: int, offset: int, length: int, *, excl: bool = True
    ) -> tuple[n.Nlm4Stat, n.Holder | None]:
        r = Reply()
        n.pack_testargs(
            r.packer, n.TestArgs(b"cookie", excl, self.lock_of(svid, offset, length)), self.vers
        )
        u = await self.rpc.call(n.NLM_PROG, self.vers, n.NLMPROC_TEST, r)
        cookie, stat, holder = n.unpack_testres(u, self.vers)
        assert cookie == b"cookie"
        return stat, holder


@asynccontextmanager
async def host(bed: Bed, name: str, vers: int = n.NLM_V4) -> AsyncIterator[Host]:
    async with connect_tcp("127.0.0.1", bed.port) as rpc:
        yield Host(rpc, name, bed.fh, vers)


async def settled(done: Callable[[], bool]) -> None:
    """Until ``done()``: the server acts on a callback's outcome after the callback returns."""
    while not done():  # noqa: ASYNC110 (state of the server under test, no event to wait on)
        await trio.sleep(0.01)


async def test_two_owners_contend(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a, host(bed, "beta") as b:
            assert await a.lock(1, 0, 100) is S.GRANTED
            assert await b.lock(7, 50, 10) is S.DENIED
            assert await b.lock(7, 50, 10, excl=False) is S.DENIED
            stat, holder = await b.test(7, 99, 0)
            assert (stat, holder) == (S.DENIED, n.Holder(True, 1, b"1@x", 0, 100))
            assert await b.test(7, 100, 0) == (S.GRANTED, None)
            assert await b.lock(7, 100, 0, excl=False) is S.GRANTED  # beyond a's: to EOF
            assert await a.lock(2, 150, 1) is S.DENIED  # a's other owner meets b's
            assert await a.lock(1, 100, 1) is S.DENIED  # a's own owner too
            assert await a.lock(1, 0, 100, excl=False) is S.GRANTED  # downgrade
            assert await b.lock(7, 10, 10, excl=False) is S.GRANTED  # shared now
            assert await a.unlock(1, 0, 0) is S.GRANTED
            assert await b.unlock(7, 0, 0) is S.GRANTED
            assert bed.nlm.table.held() == 0
            assert await a.lock(1, 2**64 - 1, 2) is S.FBIG


async def test_blocked_lock_is_granted_by_callback(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a, host(bed, "beta") as b:
            assert await a.lock(1, 0, 0) is S.GRANTED
            assert await b.lock(7, 10, 5, block=True) is S.BLOCKED
            assert await b.lock(7, 10, 5, block=True) is S.BLOCKED  # asked again: one waiter
            assert len(bed.nlm.table.waiters(bed.key)) == 1
            assert not bed.callbacks.calls
            assert await a.unlock(1, 0, 0) is S.GRANTED
            await bed.callbacks.arrived.wait()
            ((caller, granted),) = bed.callbacks.calls
            assert caller == "127.0.0.1"
            assert granted.exclusive and granted.lock.fh == bed.fh
            assert (granted.lock.svid, granted.lock.offset, granted.lock.length) == (7, 10, 5)
            assert granted.lock.oh == b"7@x" and granted.cookie == b"cookie"
            assert await a.lock(1, 12, 1) is S.DENIED  # b holds it now
            assert await b.lock(7, 10, 5) is S.GRANTED  # b asking again finds it its own
            assert await b.unlock(7, 10, 5) is S.GRANTED
            assert await a.lock(1, 12, 1) is S.GRANTED


async def test_a_downgrade_grants_shared_waiters(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a, host(bed, "beta") as b:
            assert await a.lock(1, 0, 0) is S.GRANTED
            assert await b.lock(7, 0, 1, excl=False, block=True) is S.BLOCKED
            assert await a.lock(1, 0, 0, excl=False) is S.GRANTED
            await bed.callbacks.arrived.wait()
            assert not bed.callbacks.calls[0][1].exclusive
            assert await a.lock(1, 0, 0) is S.DENIED  # b shares it now


async def test_client_that_no_longer_waits_has_the_grant_released(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a, host(bed, "beta") as b:
            bed.callbacks.answer = S.DENIED
            assert await a.lock(1, 0, 10) is S.GRANTED
            assert await b.lock(7, 0, 10, block=True) is S.BLOCKED
            assert await a.unlock(1, 0, 10) is S.GRANTED
            await bed.callbacks.arrived.wait()
            await settled(lambda: not bed.nlm.table.held())  # released on the answer
            assert await a.lock(1, 0, 10) is S.GRANTED


async def test_unreachable_client_keeps_its_grant(tmp_path: Path) -> None:
    """No NLM registered at the client's rpcbind: the grant stands; its LOCK again gets it."""
    with trio.fail_after(20):
        async with (
            nlm_bed(tmp_path, callbacks=False) as bed,
            host(bed, "alpha") as a,
            host(bed, "beta") as b,
        ):
            assert await a.lock(1, 0, 10) is S.GRANTED
            assert await b.lock(7, 0, 10, block=True) is S.BLOCKED
            assert await a.unlock(1, 0, 10) is S.GRANTED
            await settled(lambda: not bed.nlm._granting)  # the callback has failed
            assert await a.lock(1, 0, 10) is S.DENIED
            assert await b.lock(7, 0, 10, block=True) is S.GRANTED
            assert not bed.callbacks.calls


async def test_cancel(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a, host(bed, "beta") as b:
            assert await a.lock(1, 0, 10) is S.GRANTED
            assert await b.lock(7, 0, 10, block=True) is S.BLOCKED
            assert await b.cancel(7, 0, 10, excl=False) is S.DENIED  # not that request
            assert await b.cancel(7, 0, 10) is S.GRANTED
            assert await b.cancel(7, 0, 10) is S.DENIED  # nothing left to cancel
            assert await a.unlock(1, 0, 10) is S.GRANTED
            assert bed.nlm.table.held() == 0  # nobody was granted
            assert await a.lock(1, 0, 10) is S.GRANTED
            assert not bed.callbacks.calls


async def test_free_all_releases_a_host_and_grants_the_waiters(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a, host(bed, "beta") as b:
            assert await a.lock(1, 0, 10) is S.GRANTED
            assert await a.lock(2, 20, 10) is S.GRANTED
            assert await b.lock(7, 5, 20, block=True) is S.BLOCKED
            r = Reply()
            n.pack_notify(r.packer, n.Notify("alpha", 5))
            u = await a.rpc.call(n.NLM_PROG, n.NLM_V4, n.NLMPROC_FREE_ALL, r)
            assert u.remaining() == 0  # void
            await bed.callbacks.arrived.wait()
            assert bed.callbacks.calls[0][1].lock.svid == 7
            assert bed.nlm.table.held("alpha") == 0 and bed.nlm.table.held("beta") == 1


async def test_stale_and_foreign_handles(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a:
            assert await a.lock(1, 0, 1, fh=b"\x00" * len(bed.fh)) is S.STALE_FH
            forged = bytearray(bed.fh)
            forged[-1] ^= 1
            assert await a.lock(1, 0, 1, fh=bytes(forged)) is S.STALE_FH
            assert await a.lock(1, 0, 1, fh=b"short") is S.STALE_FH
            (bed.path / "export" / "file").unlink()
            assert await a.lock(1, 0, 1) is S.STALE_FH
            assert (await a.test(1, 0, 1))[0] is S.STALE_FH
            assert await a.unlock(1, 0, 1) is S.STALE_FH
        async with nlm_bed(tmp_path / "v3") as bed, host(bed, "alpha", n.NLM_V3) as a3:
            assert await a3.lock(1, 0, 1, fh=b"short") is S.DENIED_NOLOCKS  # no STALE_FH in v3


async def test_grace_period(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with (
            nlm_bed(tmp_path, grace=1.0) as bed,
            host(bed, "alpha") as a,
            host(bed, "b") as b,
        ):
            assert await a.lock(1, 0, 10) is S.DENIED_GRACE_PERIOD
            assert (await a.test(1, 0, 10))[0] is S.DENIED_GRACE_PERIOD
            assert await a.lock(1, 0, 10, reclaim=True) is S.GRANTED
            assert await b.lock(2, 0, 10, reclaim=True) is S.DENIED  # reclaims still conflict
            await trio.sleep(max(0.0, bed.nlm.grace_ends - time.monotonic()) + 0.01)
            assert not bed.nlm.in_grace()
            assert await b.lock(2, 20, 10) is S.GRANTED


async def test_version_1_and_bounds(tmp_path: Path) -> None:
    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha", n.NLM_V1) as a1:
            assert await a1.lock(1, 2**32 - 10, 0) is S.GRANTED
            async with host(bed, "beta") as b:
                stat, holder = await b.test(7, 2**40, 1)
                assert stat is S.DENIED and holder == n.Holder(True, 1, b"1@x", 2**32 - 10, 0)
                long = Host(b.rpc, "x" * 256, bed.fh)
                assert await long.lock(1, 0, 1) is S.DENIED_NOLOCKS  # caller_name too long
            with pytest.raises(ProcUnavail):  # SHARE is not in version 1
                await a1.rpc.call(n.NLM_PROG, n.NLM_V1, n.NLMPROC_SHARE, Reply())
            with pytest.raises(ProcUnavail):  # LOCK_MSG: never sent by Linux, not served
                await a1.rpc.call(n.NLM_PROG, n.NLM_V4, 7, Reply())


async def test_share_and_unshare(tmp_path: Path) -> None:
    async def share(rpc: RpcTcpClient, proc: int, name: str, mode: int, access: int) -> n.Nlm4Stat:
        r = Reply()
        args = n.ShareArgs(
            b"s", n.Share(name, bed.fh, b"o", n.ShareMode(mode), n.ShareAccess(access))
        )
        n.pack_shareargs(r.packer, args)
        return n.unpack_shareres(await rpc.call(n.NLM_PROG, n.NLM_V4, proc, r))[1]

    with trio.fail_after(20):
        async with nlm_bed(tmp_path) as bed, host(bed, "alpha") as a:
            assert await share(a.rpc, n.NLMPROC_SHARE, "pc1", 2, 1) is S.GRANTED  # read, deny write
            assert await share(a.rpc, n.NLMPROC_SHARE, "pc2", 0, 2) is S.DENIED
            assert await share(a.rpc, n.NLMPROC_UNSHARE, "pc1", 0, 0) is S.GRANTED
            assert await share(a.rpc, n.NLMPROC_SHARE, "pc2", 0, 2) is S.GRANTED


async def test_serve_nfs_registers_and_serves_nlm(tmp_path: Path) -> None:
    (tmp_path / "export").mkdir()
    config = ServerConfig(
        tmp_path / "export", host="127.0.0.1", tcp_port=0, rdma_port=None, rpcbind_port=0,
        state_dir=tmp_path / "state",
    )  # fmt: skip
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            serving = await nursery.start(serve_nfs, config)
            assert serving.rpcbind_port is not None
            for vers in n.SERVED_VERSIONS:
                port = await getport("127.0.0.1", n.NLM_PROG, vers, "tcp", serving.rpcbind_port)
                assert port == serving.tcp_port
            assert serving.tcp_port is not None
            async with connect_tcp("127.0.0.1", serving.tcp_port) as rpc:
                assert (await rpc.call(n.NLM_PROG, n.NLM_V4, n.NLMPROC_NULL)).remaining() == 0
                r = Reply()
                args = n.LockArgs(b"c", False, True, n.Lock("h", b"junk", b"", 1, 0, 0))
                n.pack_lockargs(r.packer, args, n.NLM_V4)
                u = await rpc.call(n.NLM_PROG, n.NLM_V4, n.NLMPROC_LOCK, r)
                assert n.unpack_res(u) == (b"c", S.STALE_FH)
            nursery.cancel_scope.cancel()
