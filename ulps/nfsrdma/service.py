"""The seam between ONC RPC transports and the programs they serve (NFS, MOUNT, rpcbind).

A transport (RPC over TCP with record marking, or RPC-over-RDMA) decodes a
call's header, finds the :class:`Program` by number, and has it decode its
arguments from an :class:`~.xdr.Unpacker` and encode its results into a
:class:`Reply`. The program never sees the transport, except through
:class:`CallContext`: who called, over what.

DDP-eligible results (RFC 8267: the data of an NFS READ, the path of a
READLINK) are marked with :meth:`Reply.opaque_ddp`: over TCP they go inline
like any opaque; over RDMA the transport places them in the requester's Write
chunk and leaves only their length in the inline stream (RFC 8166 §3.4).
DDP-eligible arguments (the data of an NFS WRITE) arrive already in place:
the RDMA transport pulls Read chunks into the call's XDR stream before the
program decodes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, pad

if TYPE_CHECKING:
    from rdmashim.ulps.nfsrdma.rpc import PendingCall

AUTH_NONE = 0
AUTH_SYS = 1


@dataclass(frozen=True, slots=True)
class AuthSys:
    """An AUTH_SYS credential (RFC 5531 appendix A)."""

    stamp: int
    machinename: str
    uid: int
    gid: int
    gids: tuple[int, ...] = ()


class CallContext(NamedTuple):
    """One call as a program sees it: its header fields, credential and transport (a
    tuple: one is made for every call)."""

    xid: int
    prog: int
    vers: int
    proc: int
    cred: AuthSys | None
    """The AUTH_SYS credential, None for AUTH_NONE."""
    peer: tuple[str, int]
    """The caller's address and port."""
    transport: str
    """``"tcp"``, ``"udp"`` or ``"rdma"``."""
    local: str = ""
    """The server's own address the call came to ("" where the transport cannot say)."""


class ProcUnavailable(Exception):
    """The program has no such procedure (the transport answers PROC_UNAVAIL)."""


class Reply:
    """A program's encoded results, with its DDP-eligible items marked.

    ``packer`` holds the XDR stream without the bytes of DDP-eligible items
    (``Reply(head)`` starts it with the bytes ``head``); ``ddp`` lists, for
    each such item, the offset in ``packer.data`` where its bytes (and
    padding) belong, and the bytes.
    """

    __slots__ = ("ddp", "packer")

    def __init__(self, head: bytes = b"") -> None:
        self.packer = Packer(head)
        self.ddp: list[tuple[int, memoryview]] = []

    def opaque_ddp(self, data: bytes | bytearray | memoryview) -> None:
        """A DDP-eligible variable-length opaque: its length now, its bytes where placed."""
        view = memoryview(data).cast("B")
        self.packer.uint(len(view))
        self.ddp.append((len(self.packer.data), view))

    def inline(self) -> list[bytes | bytearray | memoryview]:
        """The whole stream with every item inline, as buffers to send in order (TCP)."""
        if not self.ddp:
            return [self.packer.data] if self.packer.data else []
        out: list[bytes | bytearray | memoryview] = []
        data = memoryview(self.packer.data)
        start = 0
        for offset, item in self.ddp:
            out.append(data[start:offset])
            out.append(item)
            if pad(len(item)):
                out.append(bytes(pad(len(item))))
            start = offset
        out.append(data[start:])
        return [b for b in out if len(b)]


class CallHandler(Protocol):
    """What a transport hands each call to: :class:`~.rpc.RpcServer`, or anything with
    its ``handle_call`` and ``call_now``."""

    def handle_call(
        self, message: memoryview, peer: tuple[str, int], transport: str, local: str = ""
    ) -> Awaitable[Reply | None]:
        """The reply to a whole RPC call message (None: no answer)."""

    def call_now(
        self, message: memoryview, peer: tuple[str, int], transport: str, local: str = ""
    ) -> Reply | PendingCall | None:
        """The reply now, or a :class:`~.rpc.PendingCall` to finish in a task."""


class Program(Protocol):
    """An ONC RPC program a transport serves (NFS v3, MOUNT v3, rpcbind)."""

    @property
    def number(self) -> int:
        """The program number (100003 for NFS, ...)."""

    @property
    def versions(self) -> tuple[int, int]:
        """The lowest and highest version served (PROG_MISMATCH reports them)."""

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Decode the arguments of ``ctx.proc``, do it, encode the results into ``reply``.

        Raise :class:`ProcUnavailable` for an unknown procedure and let
        :class:`~.xdr.XdrError` out for undecodable arguments (GARBAGE_ARGS);
        anything the program itself refuses is a result (an NFS status), not
        an exception.
        """


DispatchNow = Callable[[CallContext, Unpacker, Reply], bool]
"""A program's ``dispatch_now`` (see :class:`InlineProgram`)."""


class InlineProgram(Program, Protocol):
    """A :class:`Program` that can carry out some calls at once, without a task of their own.

    :class:`~.rpc.RpcServer` asks ``dispatch_now`` first, where the call came
    (the transport's receiving task): True means the call is done and
    ``reply`` holds its results; False leaves it (``args`` unread, ``reply``
    untouched) to :meth:`~Program.dispatch` in a task of its own. It never
    waits, and raises what ``dispatch`` would.
    """

    def dispatch_now(self, ctx: CallContext, args: Unpacker, reply: Reply) -> bool:
        """Carry out the call now if that needs no waiting (True), else leave it (False)."""
