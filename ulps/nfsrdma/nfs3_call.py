"""One NFSv3 call as its procedure sees it, the server state it shares, the procedure table.

A procedure is a function ``(call, args) -> body``: it decodes its arguments
(an :class:`~.xdr.XdrError` is GARBAGE_ARGS), does its work, and returns a
function that only encodes the successful result. When it fails it raises
:class:`~.nfs3_types.NfsError`; the result then carries the status and the
failure arm, which for NFSv3 is always a sequence of ``post_op_attr`` and
``wcc_data`` items: :attr:`Call.fail` holds them, absent until the procedure
fills in what it knows (a directory's node, its pre-operation attributes),
and their post-operation attributes are taken when they are encoded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from rdmashim.ulps.nfsrdma.export import Caller, Export, Node
from rdmashim.ulps.nfsrdma.handles import handle_export_id
from rdmashim.ulps.nfsrdma.nfs3_types import (
    NFS3ERR_ACCES,
    NFS3ERR_BADHANDLE,
    NFS3ERR_XDEV,
    Fattr3,
    NfsError,
    WccAttr,
    pack_post_op_attr,
    pack_wcc_data,
)
from rdmashim.ulps.nfsrdma.pool import BufferPool
from rdmashim.ulps.nfsrdma.service import CallContext, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker

log = logging.getLogger(__name__)

RTMAX: Final = 1 << 20
"""The largest READ (FSINFO rtmax); larger counts are cut to it."""
WTMAX: Final = 1 << 20
"""The largest WRITE (FSINFO wtmax); larger data is GARBAGE_ARGS."""
DTPREF: Final = 64 << 10
"""The preferred and largest READDIR size (FSINFO dtpref); larger counts are cut to it."""
MAXFILESIZE: Final = (1 << 63) - 1
READ_BUFFERS: Final = 16
"""READ buffers (of RTMAX bytes) a server keeps for reuse: its worker threads' READs and
the replies being sent (more may be out at once, made afresh)."""


@dataclass(slots=True)
class PostOp:
    """A ``post_op_attr`` of a node, taken when encoded."""

    node: Node | None = None

    def pack(self, p: Packer, export: Export | None) -> None:
        """Encode it (absent if the node or its attributes are not to be had)."""
        pack_post_op_attr(p, attrs_now(self.node, export))


@dataclass(slots=True)
class Wcc:
    """A ``wcc_data`` of a node: its attributes before, and (when encoded) after."""

    node: Node | None = None
    pre: WccAttr | None = None

    def pack(self, p: Packer, export: Export | None) -> None:
        """Encode it."""
        pack_wcc_data(p, self.pre, attrs_now(self.node, export))


Tail = PostOp | Wcc


def attrs_now(node: Node | None, export: Export | None) -> Fattr3 | None:
    """A node's attributes now, None if there is none or it cannot be stat'ed."""
    if node is None or export is None:
        return None
    try:
        return export.fattr(node.restat())
    except OSError:
        return None


@dataclass(slots=True)
class ServerState:
    """What every call of one NFS program instance shares."""

    exports: Sequence[Export]
    write_verifier: bytes = field(default_factory=lambda: os.urandom(8))
    """Changes with every start, so clients resend what an earlier instance did not commit."""
    read_buffers: BufferPool = field(default_factory=lambda: BufferPool(READ_BUFFERS))
    """READ's data, read into a buffer of these (not a new megabyte per call)."""

    def export_of(self, fh: bytes) -> Export:
        """The export a handle belongs to (BADHANDLE if none)."""
        export_id = handle_export_id(fh)
        for export in self.exports:
            if export.export_id == export_id:
                return export
        raise NfsError(NFS3ERR_BADHANDLE, "unknown export")


class Call:
    """One call in progress: its context, the descriptors it holds open, its failure arm.

    ``search`` False (a call on the event loop): a handle whose object must be
    searched for raises :class:`~.handles.SearchNeeded` instead.
    """

    __slots__ = ("_caller", "_fds", "ctx", "export", "fail", "search", "state")

    def __init__(
        self, state: ServerState, ctx: CallContext, fail: list[Tail], *, search: bool = True
    ) -> None:
        self.state = state
        self.ctx = ctx
        self.fail = fail
        """The failure arm (the call's own list: procedures fill it in)."""
        self.search = search
        self.export: Export | None = None
        self._caller: Caller | None = None
        self._fds: list[int] = []

    def close(self) -> None:
        """The call ended: close what it held open."""
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            os.close(fd)

    @property
    def ex(self) -> Export:
        """The export of this call's (first) handle."""
        assert self.export is not None, "no handle resolved yet"
        return self.export

    @property
    def caller(self) -> Caller:
        """The identity the call acts as."""
        if self._caller is None:
            self._caller = self.ex.caller(self.ctx.cred)
        return self._caller

    def hold(self, node: Node) -> Node:
        """Keep ``node`` open until the call ends."""
        self._fds.append(node.fd)
        return node

    def fd(self, fd: int) -> int:
        """Keep a descriptor open until the call ends."""
        self._fds.append(fd)
        return fd

    def node(self, fh: bytes) -> Node:
        """The object of a handle; its export becomes the call's (all must share it: XDEV)."""
        return self.hold(self._export_of(fh).node(fh, search=self.search))

    def stat(self, fh: bytes) -> os.stat_result:
        """The attributes now of the object of a handle, as :meth:`node` finds it, holding
        nothing open."""
        return self._export_of(fh).stat(fh, search=self.search)

    def _export_of(self, fh: bytes) -> Export:
        """A handle's export, which becomes the call's (all must share it: XDEV)."""
        export = self.state.export_of(fh)
        if self.export is None:
            if not export.allows(self.ctx.peer[0]):
                raise NfsError(NFS3ERR_ACCES, f"{self.ctx.peer[0]} not allowed")
            self.export = export
        elif export is not self.export:
            raise NfsError(NFS3ERR_XDEV)
        return export

    def child(self, parent: Node, name: str) -> Node:
        """``name`` in ``parent`` (LOOKUP semantics)."""
        try:
            return self.hold(self.ex.child(parent, name))
        except OSError as exc:
            raise NfsError.of(exc) from exc

    def wcc(self, node: Node) -> Wcc:
        """A ``wcc_data`` of ``node`` with its attributes now as the pre-operation ones."""
        return Wcc(node, self.ex.fattr(node.st).wcc())

    def fattr(self, node: Node) -> Fattr3:
        """A node's attributes as last stat'ed."""
        return self.ex.fattr(node.st)

    def pack_fail(self, p: Packer) -> None:
        """The failure arm."""
        for tail in self.fail:
            tail.pack(p, self.export)


Body = Callable[[Reply], None]
Procedure = Callable[[Call, Unpacker], Body]


@dataclass(frozen=True, slots=True)
class Entry:
    """A procedure and the shape of its failure arm (``"a"``: post_op_attr, ``"w"``: wcc_data).

    ``inline``: the procedure only looks (stat, open ``O_PATH``, read a
    link or a file system's figures), so it may run on the event loop.
    """

    run: Procedure
    fail: str
    inline: bool = False

    def fresh_fail(self) -> list[Tail]:
        """The failure arm with every item absent."""
        return [PostOp() if kind == "a" else Wcc() for kind in self.fail]


PROCEDURES: dict[int, Entry] = {}


def procedure(number: int, fail: str, *, inline: bool = False) -> Callable[[Procedure], Procedure]:
    """Register an NFSv3 procedure, the shape of its failure arm, and whether it may run
    on the event loop (see :class:`Entry`)."""

    def register(run: Procedure) -> Procedure:
        PROCEDURES[number] = Entry(run, fail, inline)
        return run

    return register
