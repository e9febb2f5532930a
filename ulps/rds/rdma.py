"""RDMA by cookie: RDS messages that carry an RDMA Write or Read of a peer's buffer.

As in Linux RDS (``rds-rdma(7)``): a socket registers a buffer and gets a
*cookie* (R_Key in the low 32 bits, the region's address for the buffer's
first byte above them, ``rds_rdma_make_cookie``), and hands the cookie to a
peer in an ordinary message. Where the device takes an iova, the region is
addressed from the buffer's page offset and the cookie has Linux's 64 bits;
the kernel's siw ignores the iova and addresses every region by its virtual
address, so there the cookie holds the whole address and is wider (an ``int``
either way: send it as 16 bytes to be safe). The peer sends a message carrying
an :class:`RdmaOp` naming the cookie: its node first writes its local bytes
into the registered buffer (or reads them out of it), then sends the message,
whose first fragment carries ``RDS_EXTHDR_RDMA`` with the R_Key. The owner of
the buffer therefore finds the data in place when the message arrives (RDMAP
orders a Write before the Send that follows it; a Read's Send is fenced behind
the Read), and a use-once registration is released then.

The sender learns the outcome from :meth:`RdmaOp.wait` (Linux's
``RDS_CMSG_RDMA_STATUS``). On iWARP an RDMA Write completes locally as soon
as it is sent, so a Write counts as done when the peer acknowledges the
message that follows it. A message carrying an RDMA operation is never
retransmitted (Linux's rule: an RDMA error breaks the connection, so
retrying would break it again): if its connection breaks before the peer
acknowledged it, it is dropped and its status says so.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.ulps.rds.cookie import RdmaStatus, cookie_offset, cookie_rkey, make_cookie
from rdmashim.verbs import Access, WCStatus
from rdmashim.verbs.buffers import address_of
from rdmashim.verbs.errors import NotSupported

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.verbs.abc import MR, PD

__all__ = [
    "COOKIE_ACCESS",
    "RdmaOp",
    "RdmaStatus",
    "Registration",
    "Registrations",
    "Sources",
    "cookie_offset",
    "cookie_rkey",
    "make_cookie",
    "status_of",
]

COOKIE_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
_SOURCE_ACCESS = Access(0)
"""An RDMA Write's local buffer is only read (made once: an Enum call costs a microsecond)."""


_REMOTE_FAULTS = {WCStatus.REM_ACCESS_ERR, WCStatus.REM_INV_REQ_ERR, WCStatus.REM_OP_ERR}


def status_of(wc_status: WCStatus) -> RdmaStatus:
    """The RDMA status a failed work completion means for the operation."""
    return RdmaStatus.REMOTE_ERROR if wc_status in _REMOTE_FAULTS else RdmaStatus.OTHER_ERROR


@dataclass(eq=False)
class RdmaOp:
    """An RDMA Write or Read of the peer buffer named by ``cookie``, sent with a message.

    Build one with :meth:`write_to` or :meth:`read_into`, pass it to
    :meth:`RdsSocket.sendto(..., rdma=op) <rdmashim.ulps.rds.RdsSocket.sendto>`
    and ``await op.wait()`` for its :class:`RdmaStatus`. ``remote_offset`` is
    the byte offset into the peer's registered buffer; ``token`` is yours
    (Linux's ``user_token``).
    """

    cookie: int
    buffer: Buffer
    write: bool
    remote_offset: int = 0
    token: int = 0
    status: RdmaStatus | None = None
    detail: str = ""
    """Why it failed, when it did."""
    _done: trio.Event | None = field(default=None, repr=False)
    """Set when the operation settles; made by the first :meth:`wait` (most operations
    are never waited for: their status is read)."""
    _mr: MR | None = field(default=None, repr=False)
    _sources: Sources | None = field(default=None, repr=False)
    """Where :attr:`_mr` came from and goes back to, when it is a kept one."""
    _watch: Callable[[], None] | None = field(default=None, repr=False)
    """Set when its session sent it from C: the first :meth:`wait` calls it, and the
    session settles what C took and asks to be told of the acknowledgement that ends
    it. (Unwaited, its status comes when the session next folds: within its backstop.)"""

    @classmethod
    def write_to(cls, cookie: int, data: Buffer, *, offset: int = 0, token: int = 0) -> RdmaOp:
        """Write ``data`` (any buffer) into the peer's buffer at ``offset``."""
        return cls(cookie, data, True, offset, token)

    @classmethod
    def read_into(cls, cookie: int, buffer: Buffer, *, offset: int = 0, token: int = 0) -> RdmaOp:
        """Read ``len(buffer)`` bytes from the peer's buffer at ``offset`` into ``buffer``."""
        return cls(cookie, buffer, False, offset, token)

    @property
    def rkey(self) -> int:
        """The peer region's R_Key."""
        return cookie_rkey(self.cookie)

    @property
    def remote_addr(self) -> int:
        """Where in the peer's region the operation starts."""
        return cookie_offset(self.cookie) + self.remote_offset

    @property
    def length(self) -> int:
        """Bytes written or read."""
        return memoryview(self.buffer).nbytes

    @property
    def done(self) -> bool:
        """Whether the operation has its status."""
        return self.status is not None

    def _begin(self, sources: Sources) -> None:
        """Register the local buffer for the operation's lifetime (a Write's ``bytes`` on
        the node's kept :class:`Sources`)."""
        if why := self._unsendable():
            raise ValueError(why)
        if not self._kept(sources):
            access = _SOURCE_ACCESS if self.write else Access.LOCAL_WRITE
            self._mr = sources.pd.reg_mr(self.buffer, access)

    def _begin_kept(self, sources: Sources) -> MR | None:
        """:meth:`_begin` for a new Write from ``bytes`` whose registration the node keeps
        (a socket's ``sendto`` in one call into C takes only those): its registration, or
        None and nothing changed (it is not one: :meth:`_begin` says what)."""
        if not self._unsendable() and self._kept(sources):
            return self._mr
        return None

    def _c_write(self, mr: MR) -> tuple[int, int, int, int, int]:
        """What RDS's C takes of a Write from ``mr`` (``rp_send_write``, ``rp_sendto_write``):
        its local address, key and length, the peer's address and R_Key."""
        sge = mr.sge()
        return sge.addr, sge.lkey, sge.length, self.remote_addr, self.rkey

    def _unsendable(self) -> str:
        """Why the operation cannot be sent ("": it can)."""
        if self._mr is not None or self.done:
            return "this RDMA operation was already sent"
        if not 0 <= self.remote_offset < 1 << 32:
            return f"remote offset {self.remote_offset} outside 0..2**32-1"
        if not 0 <= self.remote_addr < 1 << 64:
            return f"cookie {self.cookie:#x} (+ offset) names no 64-bit address"
        return ""

    def _kept(self, sources: Sources) -> bool:
        """Take the node's kept registration of a Write's ``bytes`` (:class:`Sources`)."""
        buffer = self.buffer
        if self.write and buffer.__class__ is bytes:
            self._mr = sources.take(buffer)
            if self._mr is not None:
                self._sources = sources
                return True
        return False

    def _unbegin(self) -> None:
        """Let go of a kept registration (:meth:`_begin_kept` undone when the operation did
        not go: it may be sent again)."""
        if self._sources is not None:
            self._sources.give_back(self.buffer)  # type: ignore[arg-type]
        self._mr = self._sources = None

    def _finish(self, status: RdmaStatus, detail: str = "") -> None:
        """Settle the operation (once) and let go of its local registration."""
        if self.done:
            return
        self.status, self.detail = status, detail
        self._watch = None
        if self._mr is not None:
            if self._sources is None:
                self._mr.close()
            self._unbegin()
        if self._done is not None:
            self._done.set()

    async def wait(self) -> RdmaStatus:
        """Wait for the outcome."""
        while self.status is None and (watch := self._watch) is not None:
            self._watch = None
            watch()  # (one sent in a socket's call into C is brought in first: it then
            # has the watch a session's own send gives it, which runs next)
        if self.status is None:
            if self._done is None:
                self._done = trio.Event()
            await self._done.wait()
        else:
            await trio.lowlevel.checkpoint()
        assert self.status is not None
        return self.status


SOURCES_KEPT = 16
"""Write sources a node keeps registered (:class:`Sources`)."""


class Sources:
    """The registrations of a node's RDMA Write sources, kept for the next Write from the
    same buffer (a pool of MRs, as Linux RDS keeps one for its regions): an immutable
    ``bytes`` written from again and again (a reply's template; rds-stress writes one
    pattern) is registered once, not once per operation. A registration and its end cost
    the native engine about 45 us (rds stress -D 64K, a loaded machine) and start a new
    memory epoch, after which every post checks its keys again.

    Only ``bytes`` are kept: the pool holds the object, so it is never freed (its ``id``
    is no other object's) and nobody can change or resize it; a ``bytearray``, a view or
    a Read's buffer is registered for its operation alone. At most :data:`SOURCES_KEPT`
    are kept; one that no operation in flight uses makes room for a new one."""

    def __init__(self, pd: PD) -> None:
        self.pd = pd
        self._kept: dict[int, list[Any]] = {}
        """By ``id`` of the buffer: [the buffer (held), its registration, the operations in
        flight on it]."""

    def take(self, buffer: bytes) -> MR | None:
        """The kept registration of ``buffer`` (made if need be) for one more operation
        in flight, or None when the pool is full of registrations in use."""
        kept = self._kept.get(id(buffer))
        if kept is None:
            if len(self._kept) >= SOURCES_KEPT and not self._make_room():
                return None
            kept = self._kept[id(buffer)] = [buffer, self.pd.reg_mr(buffer, _SOURCE_ACCESS), 0]
        kept[2] += 1
        mr: MR = kept[1]
        return mr

    def give_back(self, buffer: bytes) -> None:
        """An operation on ``buffer``'s registration (from :meth:`take`) ended."""
        self._kept[id(buffer)][2] -= 1

    def _make_room(self) -> bool:
        idle = [key for key, kept in self._kept.items() if not kept[2]]
        for key in idle:
            self._kept.pop(key)[1].close()
        return bool(idle)

    def __len__(self) -> int:
        return len(self._kept)

    def close(self) -> None:
        """Deregister everything (the node ends: no operation is in flight any more)."""
        for kept in self._kept.values():
            kept[1].close()
        self._kept.clear()


@dataclass(eq=False)
class Registration:
    """A buffer a socket registered for peers to RDMA into or out of."""

    mr: MR
    cookie: int
    use_once: bool


class Registrations:
    """A socket's registered buffers, by R_Key (``RDS_GET_MR`` / ``RDS_FREE_MR``).

    ``counts`` (the socket's :attr:`.Inbox.counts`) is where it keeps ``use_once``, how
    many use-once registrations are live: only then does a message chasing an RDMA
    operation on the socket have anything to end (:meth:`used`), and the receive path,
    in C too, reads it there before it hands such a message on."""

    def __init__(self, counts: Any) -> None:
        self._by_rkey: dict[int, Registration] = {}
        self.counts = counts

    def add(self, pd: PD, buffer: Buffer, *, use_once: bool) -> int:
        """Register ``buffer`` and return its cookie.

        The region is addressed from the buffer's offset in its first page (the
        cookie's offset, as in Linux; the kernel's verbs want an iova with the
        buffer's page offset), or by its virtual address on a device that
        ignores the iova.
        """
        try:
            mr = pd.reg_mr(buffer, COOKIE_ACCESS, iova=address_of(buffer) % mmap.PAGESIZE)
        except NotSupported:
            mr = pd.reg_mr(buffer, COOKIE_ACCESS)
        cookie = make_cookie(mr.rkey, mr.iova)
        self._by_rkey[mr.rkey] = Registration(mr, cookie, use_once)
        self.counts.use_once += use_once
        return cookie

    def free(self, cookie: int) -> bool:
        """Deregister the buffer of ``cookie`` (False if there is none); peers' accesses
        fail from now on."""
        if cookie not in self:
            return False
        reg = self._by_rkey.pop(cookie_rkey(cookie))
        reg.mr.close()
        self.counts.use_once -= reg.use_once
        return True

    def used(self, rkey: int) -> None:
        """A message chasing an RDMA operation on ``rkey`` arrived: drop a use-once region."""
        reg = self._by_rkey.get(rkey)
        if reg is not None and reg.use_once:
            self.free(reg.cookie)

    def __contains__(self, cookie: object) -> bool:
        reg = self._by_rkey.get(cookie_rkey(cookie)) if isinstance(cookie, int) else None
        return reg is not None and reg.cookie == cookie

    def __len__(self) -> int:
        return len(self._by_rkey)

    def close(self) -> None:
        """Deregister everything."""
        for reg in self._by_rkey.values():
            reg.mr.close()
        self._by_rkey.clear()
        self.counts.use_once = 0
