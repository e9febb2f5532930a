"""The Network Lock Manager (NLM, program 100021) for the NFSv3 exports: versions 1, 3 and 4.

A Linux NFSv3 client mounted without ``nolock`` sends every ``fcntl``,
``lockf`` and ``flock`` lock to the server's NLM, over TCP even when NFS
itself runs over RDMA (``nfs_start_lockd`` picks TCP for every transport
but UDP). :class:`NlmProgram` answers TEST, LOCK (non-blocking and
blocking), CANCEL, UNLOCK, SHARE, UNSHARE, NM_LOCK and FREE_ALL, keeping
the locks in a :class:`~.nlm_locks.LockTable` in this process: they are
advisory, between NLM clients only (no ``fcntl`` lock is taken on the
exported file, so local processes on the server do not see them), and
they are lost when the server stops.

Files are named by their NFS handles, checked as NFS checks them (the
export's handle key, the caller's address against the export's clients):
a handle that is not ours or whose object is gone is NLM4_STALE_FH.

**Blocking locks.** A LOCK with ``block`` set that conflicts is queued and
answered NLM4_BLOCKED. When a release (UNLOCK, CANCEL of a granted
request, FREE_ALL) lets a queued request through, its lock is taken at
once and the server calls the client's NLM back with GRANTED: the
client's address is the one the LOCK came from, its NLM port whatever the
rpcbind there names for the LOCK's version over TCP. A client that
answers DENIED (it no longer waits) has the lock released again; one that
cannot be reached keeps it, and finds it granted when it sends the LOCK
again (Linux clients re-send every 30 s). The asynchronous ``_MSG`` and
``_RES`` procedures are not served (PROC_UNAVAIL): the Linux client never
sends them.

**Grace period.** For ``grace`` seconds after the program is made, LOCK,
NM_LOCK, SHARE and TEST are refused with NLM4_DENIED_GRACE_PERIOD unless
they reclaim a lock (``reclaim``). The default is 0: no status monitor
(NSM, ``rpc.statd``) runs on the server's side, so no client is ever told
that the server restarted and no client reclaims; a grace period would only
delay new locks. FREE_ALL (sent by a client's status monitor when the
client restarted) drops all that host's state; SM_NOTIFY itself is not
received.

Bounds (NLM4_DENIED_NOLOCKS past them): ``caller_name`` at most
:data:`MAX_CALLER_NAME` bytes, and the table's locks, shares and waiters
per host and in all.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Hashable, Sequence
from dataclasses import dataclass, replace

import trio

from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nfs3_call import ServerState
from rdmashim.ulps.nfsrdma.nfs3_types import (
    NFS3ERR_ACCES,
    NFS3ERR_BADHANDLE,
    NFS3ERR_STALE,
    NfsError,
)
from rdmashim.ulps.nfsrdma.nlm_locks import (
    LockTable,
    NoLocks,
    RangeTooBig,
    Waiter,
    lock_range,
    wire_range,
)
from rdmashim.ulps.nfsrdma.nlm_types import (
    NLM_PROG,
    NLM_V1,
    NLM_V3,
    NLM_V4,
    NLMPROC_CANCEL,
    NLMPROC_FREE_ALL,
    NLMPROC_GRANTED,
    NLMPROC_LOCK,
    NLMPROC_NM_LOCK,
    NLMPROC_NULL,
    NLMPROC_SHARE,
    NLMPROC_TEST,
    NLMPROC_UNLOCK,
    NLMPROC_UNSHARE,
    Holder,
    Lock,
    LockArgs,
    Nlm4Stat,
    ShareArgs,
    TestArgs,
    pack_res,
    pack_shareres,
    pack_testargs,
    pack_testres,
    unpack_cancargs,
    unpack_lockargs,
    unpack_notify,
    unpack_res,
    unpack_shareargs,
    unpack_testargs,
    unpack_unlockargs,
)
from rdmashim.ulps.nfsrdma.rpc import RpcError
from rdmashim.ulps.nfsrdma.rpcbind import RPCBIND_PORT, getport
from rdmashim.ulps.nfsrdma.service import CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.tcp import connect_tcp
from rdmashim.ulps.nfsrdma.xdr import Unpacker, XdrError

log = logging.getLogger(__name__)

MAX_CALLER_NAME = 255
"""The longest ``caller_name`` taken (a host name); longer is NLM4_DENIED_NOLOCKS."""
CALLBACK_TIMEOUT = 10.0
"""Seconds a GRANTED callback (rpcbind lookup, connect, call) may take."""


class _Refused(Exception):
    """A call's NLM status other than GRANTED, decided before the lock table is asked."""

    def __init__(self, stat: Nlm4Stat) -> None:
        super().__init__(stat.name)
        self.stat = stat


@dataclass(frozen=True, slots=True)
class _Blocked:
    """What a GRANTED callback needs of the blocked LOCK: where from, in which version, what."""

    host: str
    vers: int
    cookie: bytes
    exclusive: bool
    lock: Lock


class NlmProgram:
    """NLM versions 1 to 4 over ``exports`` (the objects NFS serves); version 2, never a
    protocol of its own, is taken as version 1.

    Run :meth:`run` (``nursery.start``) for GRANTED callbacks; without it a
    blocked client learns of its lock only when it asks again.
    """

    number = NLM_PROG
    versions = (NLM_V1, NLM_V4)

    def __init__(
        self,
        exports: Export | Sequence[Export],
        *,
        grace: float = 0.0,
        table: LockTable | None = None,
        callback_rpcbind_port: int = RPCBIND_PORT,
        callback_timeout: float = CALLBACK_TIMEOUT,
    ) -> None:
        self.state = ServerState([exports] if isinstance(exports, Export) else list(exports))
        self.table = table or LockTable()
        self.grace_ends = time.monotonic() + grace
        self.callback_rpcbind_port = callback_rpcbind_port
        """The port of the clients' rpcbind, asked for their NLM's port (111)."""
        self.callback_timeout = callback_timeout
        self.hostname = socket.gethostname()[:MAX_CALLER_NAME]
        self._granting: list[Waiter] = []
        """Requests granted whose GRANTED callback has not finished."""
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Make GRANTED callbacks until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def in_grace(self) -> bool:
        """Whether the grace period still runs."""
        return time.monotonic() < self.grace_ends

    # -- dispatch

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Decode, do, encode one NLM call (see :class:`~.service.Program`)."""
        proc, vers, out = ctx.proc, ctx.vers, reply.packer
        if proc == NLMPROC_NULL:
            return
        if proc == NLMPROC_TEST:
            targs = unpack_testargs(args, vers)
            stat, holder = await self._test(ctx, targs)
            pack_testres(out, targs.cookie, stat, holder, vers)
        elif proc in (NLMPROC_LOCK, NLMPROC_NM_LOCK) and (proc == NLMPROC_LOCK or vers >= NLM_V3):
            largs = unpack_lockargs(args, vers)
            if proc == NLMPROC_NM_LOCK:  # a non-monitored client (a PC): never blocks
                largs = replace(largs, block=False)
            pack_res(out, largs.cookie, await self._guarded(self._lock(ctx, largs)), vers)
        elif proc == NLMPROC_CANCEL:
            cargs = unpack_cancargs(args, vers)
            lock, exclusive = cargs.lock, cargs.exclusive
            pack_res(
                out, cargs.cookie, await self._guarded(self._cancel(ctx, lock, exclusive)), vers
            )
        elif proc == NLMPROC_UNLOCK:
            uargs = unpack_unlockargs(args, vers)
            pack_res(out, uargs.cookie, await self._guarded(self._unlock(ctx, uargs.lock)), vers)
        elif proc == NLMPROC_GRANTED:  # a client's procedure: no lock of ours waits for it
            pack_res(out, unpack_testargs(args, vers).cookie, Nlm4Stat.DENIED, vers)
        elif proc in (NLMPROC_SHARE, NLMPROC_UNSHARE) and vers >= NLM_V3:
            sargs = unpack_shareargs(args)
            stat = await self._guarded(self._share(ctx, sargs, proc == NLMPROC_SHARE))
            pack_shareres(out, sargs.cookie, stat, vers)
        elif proc == NLMPROC_FREE_ALL and vers >= NLM_V3:
            notify = unpack_notify(args)
            log.info("nlm: FREE_ALL from %s for %r", ctx.peer[0], notify.name)
            self._free_host(notify.name)
        else:  # the _MSG and _RES procedures, and those a version does not have
            raise ProcUnavailable(proc)

    @staticmethod
    async def _guarded(outcome: Awaitable[Nlm4Stat]) -> Nlm4Stat:
        """The status of a procedure, its refusals and the table's bounds included."""
        try:
            return await outcome
        except _Refused as exc:
            return exc.stat
        except NoLocks as exc:
            log.info("nlm: out of locks: %s", exc)
            return Nlm4Stat.DENIED_NOLOCKS

    # -- the arguments every procedure checks

    def _check_grace(self, reclaim: bool) -> None:
        if not reclaim and self.in_grace():
            raise _Refused(Nlm4Stat.DENIED_GRACE_PERIOD)

    @staticmethod
    def _owner(lock: Lock) -> tuple[str, int]:
        if len(lock.caller_name.encode("utf-8", "surrogateescape")) > MAX_CALLER_NAME:
            raise _Refused(Nlm4Stat.DENIED_NOLOCKS)
        return lock.caller_name, lock.svid

    @staticmethod
    def _range(lock: Lock) -> tuple[int, int]:
        try:
            return lock_range(lock.offset, lock.length)
        except RangeTooBig:
            raise _Refused(Nlm4Stat.FBIG) from None

    async def _file(self, ctx: CallContext, fh: bytes) -> Hashable:
        """The identity of the object ``fh`` names, checked in a worker thread as NFS does."""
        try:
            return await trio.to_thread.run_sync(self._resolve, ctx.peer[0], fh)
        except NfsError as exc:
            stale = exc.status in (NFS3ERR_STALE, NFS3ERR_BADHANDLE)
            log.debug("nlm: %s: handle refused: %s", ctx.peer[0], exc)
            raise _Refused(Nlm4Stat.STALE_FH if stale else Nlm4Stat.FAILED) from None
        except OSError as exc:
            stale = exc.errno in (errno.ENOENT, errno.ESTALE)
            raise _Refused(Nlm4Stat.STALE_FH if stale else Nlm4Stat.FAILED) from None

    def _resolve(self, peer: str, fh: bytes) -> Hashable:
        export = self.state.export_of(fh)
        if not export.allows(peer):
            raise NfsError(NFS3ERR_ACCES, f"{peer} may not use {export.name}")
        node = export.node(fh)
        os.close(node.fd)
        return export.codec.decode(fh)

    # -- procedures

    async def _test(self, ctx: CallContext, args: TestArgs) -> tuple[Nlm4Stat, Holder | None]:
        try:
            self._check_grace(False)
            owner, (start, end) = self._owner(args.lock), self._range(args.lock)
            file = await self._file(ctx, args.lock.fh)
        except _Refused as exc:
            return exc.stat, None
        found = self.table.conflict(file, owner, start, end, args.exclusive)
        if found is None:
            return Nlm4Stat.GRANTED, None
        offset, length = wire_range(found.start, found.end)
        return Nlm4Stat.DENIED, Holder(found.exclusive, found.owner[1], found.oh, offset, length)

    async def _lock(self, ctx: CallContext, args: LockArgs) -> Nlm4Stat:
        self._check_grace(args.reclaim)
        lock = args.lock
        owner, (start, end) = self._owner(lock), self._range(lock)
        file = await self._file(ctx, lock.fh)
        self._forget_granting(file, owner, start, end, args.exclusive)
        found = self.table.lock(file, owner, lock.oh, start, end, args.exclusive)
        if found is None:
            self.table.cancel(file, owner, start, end, args.exclusive)
            self._grant(file)  # a downgrade (exclusive to shared) may let waiters through
            return Nlm4Stat.GRANTED
        if not args.block:
            return Nlm4Stat.DENIED
        blocked = _Blocked(ctx.peer[0], ctx.vers, args.cookie, args.exclusive, lock)
        self.table.wait(Waiter(file, owner, lock.oh, start, end, args.exclusive, blocked))
        log.debug("nlm: %s waits for %r [%d, %d)", owner, file, start, end)
        return Nlm4Stat.BLOCKED

    async def _cancel(self, ctx: CallContext, lock: Lock, exclusive: bool) -> Nlm4Stat:
        owner, (start, end) = self._owner(lock), self._range(lock)
        file = await self._file(ctx, lock.fh)
        if self.table.cancel(file, owner, start, end, exclusive) is not None:
            return Nlm4Stat.GRANTED
        if self._forget_granting(file, owner, start, end, exclusive):
            # granted while the client gave up: the callback is in flight; release it
            self.table.unlock(file, owner, start, end)
            self._grant(file)
            return Nlm4Stat.GRANTED
        return Nlm4Stat.DENIED

    async def _unlock(self, ctx: CallContext, lock: Lock) -> Nlm4Stat:
        owner, (start, end) = self._owner(lock), self._range(lock)
        file = await self._file(ctx, lock.fh)
        if self.table.unlock(file, owner, start, end):
            self._grant(file)
        return Nlm4Stat.GRANTED

    async def _share(self, ctx: CallContext, args: ShareArgs, take: bool) -> Nlm4Stat:
        share = args.share
        host = self._owner(Lock(share.caller_name, share.fh, share.oh, 0, 0, 0))[0]
        if take:
            self._check_grace(args.reclaim)
        file = await self._file(ctx, share.fh)
        if not take:
            self.table.unshare(file, host, share.oh)
            return Nlm4Stat.GRANTED
        granted = self.table.share(file, host, share.oh, share.mode, share.access)
        return Nlm4Stat.GRANTED if granted else Nlm4Stat.DENIED

    def _free_host(self, host: str) -> None:
        self._granting = [w for w in self._granting if w.owner[0] != host]
        for file in self.table.free_host(host):
            self._grant(file)

    # -- granting waiters

    def _forget_granting(
        self, file: Hashable, owner: tuple[str, int], start: int, end: int, exclusive: bool
    ) -> bool:
        """Drop the granted request of ``owner`` whose callback is in flight; whether one was."""
        for waiter in self._granting:
            if waiter.file == file and waiter.same_request(owner, start, end, exclusive):
                self._granting.remove(waiter)
                return True
        return False

    def _grant(self, file: Hashable) -> None:
        """Give the waiters of ``file`` their locks where they can have them; call them back."""
        for waiter in self.table.grant_waiters(file):
            log.info("nlm: granted %s [%d, %d) of %r", waiter.owner, waiter.start, waiter.end, file)
            if self._nursery is not None:
                self._granting.append(waiter)
                self._nursery.start_soon(self._call_back, waiter)

    async def _call_back(self, waiter: Waiter) -> None:
        """Tell the client of ``waiter`` its lock is granted (GRANTED); act on its answer."""
        blocked = waiter.context
        assert isinstance(blocked, _Blocked)
        try:
            with trio.fail_after(self.callback_timeout):
                stat = await self._granted_call(blocked)
        except (OSError, RpcError, XdrError, trio.TooSlowError) as exc:  # lost links: OSError
            log.warning(
                "nlm: GRANTED callback to %s failed (%s): the lock stays theirs; they will ask",
                blocked.host, exc or type(exc).__name__,
            )  # fmt: skip
            self._forget(waiter)
            return
        if not self._forget(waiter):
            return  # cancelled or freed meanwhile: whatever that did stands
        if stat is not Nlm4Stat.GRANTED:
            log.info("nlm: %s no longer waits (%s): releasing", blocked.host, stat.name)
            if self.table.unlock(waiter.file, waiter.owner, waiter.start, waiter.end):
                self._grant(waiter.file)

    def _forget(self, waiter: Waiter) -> bool:
        if waiter in self._granting:
            self._granting.remove(waiter)
            return True
        return False

    async def _granted_call(self, blocked: _Blocked) -> Nlm4Stat:
        port = await getport(
            blocked.host, NLM_PROG, blocked.vers, "tcp", self.callback_rpcbind_port
        )
        if port is None:
            raise OSError(f"no NLM version {blocked.vers} over tcp registered at {blocked.host}")
        args = Reply()
        lock = replace(blocked.lock, caller_name=self.hostname)
        pack_testargs(args.packer, TestArgs(blocked.cookie, blocked.exclusive, lock), blocked.vers)
        async with connect_tcp(blocked.host, port) as client:
            results = await client.call(NLM_PROG, blocked.vers, NLMPROC_GRANTED, args)
        return unpack_res(results)[1]
