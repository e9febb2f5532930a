"""ONC RPC version 2 (RFC 5531): call and reply messages, and the server core.

Codecs are pure: :func:`pack_call_header` / :func:`unpack_call_header` for the
call header, :func:`accepted_reply`, :func:`accepted_error`,
:func:`rpc_mismatch` and :func:`auth_error` for the server's replies,
:func:`encode_call` and :func:`decode_reply` for a client. Every undecodable
input is an :class:`~.xdr.XdrError`; a well-formed reply that is not SUCCESS
is an :class:`RpcError` subclass named after its status.

:class:`RpcServer` is what every transport (TCP with record marking,
RPC-over-RDMA) hands a received message to: it decodes the header, checks the
RPC version and the credential, finds the program and version and lets the
program decode its arguments and encode its results after the accepted-reply
header. Every failure becomes the reply RFC 5531 names for it; a call is never
dropped. The only messages without an answer are those that are not calls.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeVar

from rdmashim.ulps.nfsrdma.service import (
    AUTH_NONE,
    AUTH_SYS,
    AuthSys,
    CallContext,
    DispatchNow,
    ProcUnavailable,
    Program,
    Reply,
)
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError, pad

logger = logging.getLogger(__name__)
E = TypeVar("E", bound=IntEnum)

RPC_VERSION = 2
"""The only version of the RPC protocol (``rpcvers``)."""

MAX_AUTH_BODY = 400
"""The bound of an ``opaque_auth`` body."""
MAX_MACHINENAME = 255
"""The bound of an AUTH_SYS machine name."""
MAX_GIDS = 16
"""The bound of an AUTH_SYS list of supplementary groups."""


class MsgType(IntEnum):
    """``msg_type``: what a message is."""

    CALL = 0
    REPLY = 1


class ReplyStat(IntEnum):
    """``reply_stat``: whether the server accepted the call."""

    MSG_ACCEPTED = 0
    MSG_DENIED = 1


class AcceptStat(IntEnum):
    """``accept_stat``: the outcome of an accepted call."""

    SUCCESS = 0
    PROG_UNAVAIL = 1
    PROG_MISMATCH = 2
    PROC_UNAVAIL = 3
    GARBAGE_ARGS = 4
    SYSTEM_ERR = 5


class RejectStat(IntEnum):
    """``reject_stat``: why a call was denied."""

    RPC_MISMATCH = 0
    AUTH_ERROR = 1


class AuthStat(IntEnum):
    """``auth_stat``: why a credential or verifier was refused."""

    AUTH_OK = 0
    AUTH_BADCRED = 1
    AUTH_REJECTEDCRED = 2
    AUTH_BADVERF = 3
    AUTH_REJECTEDVERF = 4
    AUTH_TOOWEAK = 5
    AUTH_INVALIDRESP = 6
    AUTH_FAILED = 7


@dataclass(frozen=True, slots=True)
class OpaqueAuth:
    """An ``opaque_auth``: a flavor and its body (at most 400 bytes)."""

    flavor: int = AUTH_NONE
    body: bytes = b""

    @classmethod
    def sys(cls, cred: AuthSys) -> OpaqueAuth:
        """The AUTH_SYS credential ``cred``, encoded."""
        p = Packer()
        pack_auth_sys(p, cred)
        return cls(AUTH_SYS, p.getvalue())


NULL_AUTH = OpaqueAuth()
"""AUTH_NONE with an empty body: every verifier this module sends."""


@dataclass(frozen=True, slots=True)
class CallHeader:
    """The header of a call message, up to its arguments."""

    xid: int
    prog: int
    vers: int
    proc: int
    cred: OpaqueAuth = NULL_AUTH
    verf: OpaqueAuth = NULL_AUTH
    rpcvers: int = RPC_VERSION


# -- RPC errors a client sees (and AuthError, which a program may raise) ---------------------


class RpcError(Exception):
    """A reply that is not SUCCESS; the subclass names its status."""


class ProgUnavail(RpcError):
    """PROG_UNAVAIL: the server does not serve the program."""


class VersionMismatch(RpcError):
    """A mismatch of versions: only ``low`` to ``high`` are served."""

    def __init__(self, low: int, high: int) -> None:
        super().__init__(f"versions {low}..{high} only")
        self.low = low
        self.high = high


class ProgMismatch(VersionMismatch):
    """PROG_MISMATCH: the server serves versions ``low`` to ``high`` of the program only."""


class ProcUnavail(RpcError):
    """PROC_UNAVAIL: the program has no such procedure."""


class GarbageArgs(RpcError):
    """GARBAGE_ARGS: the server could not decode the arguments."""


class SystemErr(RpcError):
    """SYSTEM_ERR: the server failed while carrying out the call."""


class RpcMismatch(VersionMismatch):
    """Denied, RPC_MISMATCH: the server speaks RPC versions ``low`` to ``high`` only."""


class AuthError(RpcError):
    """Denied, AUTH_ERROR with ``stat``.

    A program may raise it from ``dispatch`` (say AUTH_TOOWEAK for an AUTH_NONE
    call it needs AUTH_SYS for); :class:`RpcServer` answers with the denial.
    """

    def __init__(self, stat: AuthStat) -> None:
        super().__init__(stat.name)
        self.stat = stat


# -- codecs -----------------------------------------------------------------------------------


def pack_opaque_auth(p: Packer, auth: OpaqueAuth) -> None:
    """An ``opaque_auth``."""
    p.uint(auth.flavor)
    p.opaque(auth.body)


def unpack_opaque_auth(u: Unpacker) -> OpaqueAuth:
    """An ``opaque_auth`` with a body of at most :data:`MAX_AUTH_BODY` bytes."""
    flavor = u.uint()
    return OpaqueAuth(flavor, u.opaque(MAX_AUTH_BODY))


def pack_auth_sys(p: Packer, cred: AuthSys) -> None:
    """The body of an AUTH_SYS credential (``authsys_parms``)."""
    p.uint(cred.stamp)
    p.string(cred.machinename)
    p.uint(cred.uid)
    p.uint(cred.gid)
    p.array(cred.gids, p.uint)


def unpack_auth_sys(body: bytes | bytearray | memoryview) -> AuthSys:
    """An AUTH_SYS body, all of it, within the RFC's bounds."""
    u = Unpacker(body)
    cred = AuthSys(
        stamp=u.uint(),
        machinename=u.string(MAX_MACHINENAME),
        uid=u.uint(),
        gid=u.uint(),
        gids=tuple(u.array(u.uint, MAX_GIDS)),
    )
    u.done()
    return cred


def _credential(cred: OpaqueAuth | AuthSys | None) -> OpaqueAuth:
    if cred is None:
        return NULL_AUTH
    return OpaqueAuth.sys(cred) if isinstance(cred, AuthSys) else cred


def pack_call_header(p: Packer, header: CallHeader) -> None:
    """A call message up to its arguments."""
    p.uint(header.xid)
    p.uint(MsgType.CALL)
    p.uint(header.rpcvers)
    p.uint(header.prog)
    p.uint(header.vers)
    p.uint(header.proc)
    pack_opaque_auth(p, header.cred)
    pack_opaque_auth(p, header.verf)


def unpack_call_header(u: Unpacker) -> CallHeader:
    """A call message's header (any ``rpcvers``); the arguments are what ``u`` has left."""
    xid = u.uint()
    if u.uint() != MsgType.CALL:
        raise XdrError("not a call message")
    return CallHeader(
        xid=xid,
        rpcvers=u.uint(),
        prog=u.uint(),
        vers=u.uint(),
        proc=u.uint(),
        cred=unpack_opaque_auth(u),
        verf=unpack_opaque_auth(u),
    )


def encode_call(
    xid: int,
    prog: int,
    vers: int,
    proc: int,
    cred: OpaqueAuth | AuthSys | None,
    args: Reply,
) -> Reply:
    """A whole call message: header then ``args``, its DDP-eligible items kept marked.

    ``args`` is a :class:`~.service.Reply` because it carries the same thing a
    reply does: an XDR stream with DDP-eligible items (an NFS WRITE's data),
    which an RPC-over-RDMA requester moves to a Read chunk. ``cred`` None is
    AUTH_NONE.
    """
    out = Reply()
    pack_call_header(out.packer, CallHeader(xid, prog, vers, proc, _credential(cred)))
    start = len(out.packer.data)
    out.packer.data += args.packer.data
    out.ddp = [(start + offset, item) for offset, item in args.ddp]
    return out


def _reply_start(xid: int, stat: ReplyStat) -> Reply:
    reply = Reply()
    reply.packer.uint(xid)
    reply.packer.uint(MsgType.REPLY)
    reply.packer.uint(stat)
    return reply


_REPLY, _MSG_ACCEPTED = int(MsgType.REPLY), int(ReplyStat.MSG_ACCEPTED)
_ACCEPTED = struct.Struct(">6I")
"""An accepted reply's header: xid, REPLY, MSG_ACCEPTED, the verifier (AUTH_NONE, no
body), accept_stat."""


def accepted_reply(xid: int, stat: AcceptStat = AcceptStat.SUCCESS) -> Reply:
    """An accepted reply's header with ``stat`` (results, if any, are appended after it)."""
    return Reply(_ACCEPTED.pack(xid, _REPLY, _MSG_ACCEPTED, AUTH_NONE, 0, stat))


def accepted_error(xid: int, stat: AcceptStat, low: int = 0, high: int = 0) -> Reply:
    """A whole accepted reply that is not SUCCESS (``low``/``high`` for PROG_MISMATCH)."""
    if stat is AcceptStat.SUCCESS:
        raise ValueError("SUCCESS carries results: use accepted_reply")
    reply = accepted_reply(xid, stat)
    if stat is AcceptStat.PROG_MISMATCH:
        reply.packer.uint(low)
        reply.packer.uint(high)
    return reply


def rpc_mismatch(xid: int, low: int = RPC_VERSION, high: int = RPC_VERSION) -> Reply:
    """A denied reply, RPC_MISMATCH: the RPC versions served."""
    reply = _reply_start(xid, ReplyStat.MSG_DENIED)
    reply.packer.uint(RejectStat.RPC_MISMATCH)
    reply.packer.uint(low)
    reply.packer.uint(high)
    return reply


def auth_error(xid: int, stat: AuthStat) -> Reply:
    """A denied reply, AUTH_ERROR with ``stat``."""
    reply = _reply_start(xid, ReplyStat.MSG_DENIED)
    reply.packer.uint(RejectStat.AUTH_ERROR)
    reply.packer.uint(stat)
    return reply


def _enum(kind: type[E], value: int) -> E:
    try:
        return kind(value)
    except ValueError:
        raise XdrError(f"{kind.__name__} {value}") from None


_ACCEPT_ERRORS: dict[AcceptStat, type[RpcError]] = {
    AcceptStat.PROG_UNAVAIL: ProgUnavail,
    AcceptStat.PROC_UNAVAIL: ProcUnavail,
    AcceptStat.GARBAGE_ARGS: GarbageArgs,
    AcceptStat.SYSTEM_ERR: SystemErr,
}


def decode_reply(message: bytes | bytearray | memoryview) -> tuple[int, Unpacker]:
    """A reply message: its xid and an Unpacker positioned at its results.

    A reply that is not SUCCESS raises the :class:`RpcError` subclass of its
    status; bytes that are not a reply raise :class:`~.xdr.XdrError`.
    """
    u = Unpacker(message)
    xid = u.uint()
    if u.uint() != MsgType.REPLY:
        raise XdrError("not a reply message")
    if _enum(ReplyStat, u.uint()) is ReplyStat.MSG_DENIED:
        if _enum(RejectStat, u.uint()) is RejectStat.RPC_MISMATCH:
            raise RpcMismatch(u.uint(), u.uint())
        raise AuthError(_enum(AuthStat, u.uint()))
    unpack_opaque_auth(u)  # the verifier: AUTH_NONE or a flavor this client did not ask for
    stat = _enum(AcceptStat, u.uint())
    if stat is AcceptStat.SUCCESS:
        return xid, u
    if stat is AcceptStat.PROG_MISMATCH:
        raise ProgMismatch(u.uint(), u.uint())
    raise _ACCEPT_ERRORS[stat](stat.name)


# -- the server core --------------------------------------------------------------------------


_U32 = struct.Struct(">I")
_CALL_HEAD = struct.Struct(">6I")
"""A call's first six words: xid, msg_type, rpcvers, prog, vers, proc."""
_CALL_HEAD_LEN = _CALL_HEAD.size
CREDENTIALS_CACHE = 256
"""Credentials (with their verifiers) :class:`RpcServer` keeps decoded, by their bytes."""
_UNKNOWN: Any = object()
"""What :class:`RpcServer` finds for a credential it has not kept (None is AUTH_NONE's)."""
_new_context = tuple.__new__
"""Makes a :class:`~.service.CallContext` from a tuple of all its fields (no Python call)."""
Route = tuple[Program, int, int, DispatchNow | None]
"""How :class:`RpcServer` serves a program: it, its lowest and highest version, its
``dispatch_now`` (None if it has none)."""


class RpcServer:
    """Answers ONC RPC calls for a set of programs, over any transport.

    A client sends the same credential with every call: the decoded
    credential is kept by its bytes (up to :data:`CREDENTIALS_CACHE` of them),
    so its next calls are not decoded again.
    """

    def __init__(self, programs: Iterable[Program]) -> None:
        self.programs: dict[int, Program] = {}
        for program in programs:
            if program.number in self.programs:
                raise ValueError(f"program {program.number} given twice")
            self.programs[program.number] = program
        self._credentials: dict[bytes, AuthSys | None] = {}
        self._routes: dict[int, Route] = {
            number: (program, *program.versions, getattr(program, "dispatch_now", None))
            for number, program in self.programs.items()
        }

    async def handle_call(
        self, message: memoryview, peer: tuple[str, int], transport: str, local: str = ""
    ) -> Reply | None:
        """The reply to the call ``message`` from ``peer`` over ``transport``, sent to
        our address ``local`` (see :attr:`~.service.CallContext.local`).

        The returned :class:`~.service.Reply` holds the whole reply message
        (its DDP offsets count from the message's first byte). None only for
        a message that is not a call (a reply, or too short to say).
        """
        answer = self.call_now(message, peer, transport, local)
        return await answer.finish() if isinstance(answer, PendingCall) else answer

    def call_now(
        self, message: memoryview, peer: tuple[str, int], transport: str, local: str = ""
    ) -> Reply | PendingCall | None:
        """:meth:`handle_call` without waiting: the reply (or None), or, for a call its
        program cannot carry out at once, a :class:`PendingCall` to ``await finish()``.

        A program answers at once where it has a ``dispatch_now`` (see
        :class:`~.service.InlineProgram`) that says so; every error reply is
        made at once. A credential and verifier seen before are found by their
        bytes, where the message says they end (else they are decoded).
        """
        if len(message) < _CALL_HEAD_LEN:
            return _short_call(message, peer, transport)
        xid, msg_type, rpcvers, prog, vers, proc = _CALL_HEAD.unpack_from(message)
        if msg_type != MsgType.CALL:
            _not_a_call(xid, msg_type, peer, transport)
            return None
        if rpcvers != RPC_VERSION:
            return rpc_mismatch(xid)
        u = Unpacker(message, _CALL_HEAD_LEN)
        end = _auth_end(message, _auth_end(message, _CALL_HEAD_LEN))  # (the verifier's)
        key = bytes(message[_CALL_HEAD_LEN:end]) if end >= 0 else b""
        cred = self._credentials.get(key, _UNKNOWN)
        if cred is _UNKNOWN:
            try:
                cred = self._authenticate(u, key)
            except AuthError as exc:
                return auth_error(xid, exc.stat)
        else:
            u.pos = end
        route = self._routes.get(prog)
        if route is None:
            return accepted_error(xid, AcceptStat.PROG_UNAVAIL)
        program, low, high, now = route
        if not low <= vers <= high:
            return accepted_error(xid, AcceptStat.PROG_MISMATCH, low, high)
        ctx: CallContext = _new_context(
            CallContext, (xid, prog, vers, proc, cred, peer, transport, local)
        )
        reply = Reply(_ACCEPTED.pack(xid, _REPLY, _MSG_ACCEPTED, AUTH_NONE, 0, AcceptStat.SUCCESS))
        if now is not None:
            try:
                if now(ctx, u, reply):
                    return reply
            except Exception as exc:
                return _failed(ctx, exc)
        return PendingCall(program, ctx, u, reply)

    def _authenticate(self, u: Unpacker, key: bytes) -> AuthSys | None:
        """:func:`_authenticate`, kept by ``key``: the bytes of the credential and the
        verifier (empty when the message does not hold them: the decoder says what is
        wrong, and nothing is kept)."""
        cred = _authenticate(u)  # AuthError for a bad one, which is not kept
        if key:
            if len(self._credentials) >= CREDENTIALS_CACHE:
                self._credentials.clear()
            self._credentials[key] = cred
        return cred


def _short_call(message: memoryview, peer: tuple[str, int], transport: str) -> Reply | None:
    """The answer to a message too short for a call header (none if not even a call's)."""
    u = Unpacker(message)
    try:
        xid = u.uint()
        msg_type = u.uint()
    except XdrError:
        logger.warning("%s %s: message of %d bytes without a header", transport, peer, len(message))
        return None
    if msg_type != MsgType.CALL:
        _not_a_call(xid, msg_type, peer, transport)
        return None
    if u.remaining() >= 4 and u.uint() != RPC_VERSION:
        return rpc_mismatch(xid)
    return accepted_error(xid, AcceptStat.GARBAGE_ARGS)


def _not_a_call(xid: int, msg_type: int, peer: tuple[str, int], transport: str) -> None:
    """A message that is not a call gets no answer, only a log line."""
    logger.warning("%s %s: xid %#x is not a call (msg_type %d)", transport, peer, xid, msg_type)


def _auth_end(message: memoryview, at: int) -> int:
    """Where the ``opaque_auth`` at offset ``at`` ends; -1 if the message does not hold it."""
    if at < 0 or at + 8 > len(message):
        return -1
    end = at + 8 + _U32.unpack_from(message, at + 4)[0]
    end += pad(end)
    return end if end <= len(message) else -1


def _authenticate(u: Unpacker) -> AuthSys | None:
    """The call's credential and verifier: AUTH_SYS decoded, AUTH_NONE None, else AuthError."""
    try:
        cred = unpack_opaque_auth(u)
    except XdrError:
        raise AuthError(AuthStat.AUTH_BADCRED) from None
    try:
        verf = unpack_opaque_auth(u)
    except XdrError:
        raise AuthError(AuthStat.AUTH_BADVERF) from None
    if cred.flavor == AUTH_NONE:
        parsed = None
    elif cred.flavor == AUTH_SYS:
        try:
            parsed = unpack_auth_sys(cred.body)
        except XdrError:
            raise AuthError(AuthStat.AUTH_BADCRED) from None
    else:  # AUTH_SHORT, AUTH_DH, RPCSEC_GSS, ...: not spoken here
        raise AuthError(AuthStat.AUTH_BADCRED)
    if verf.flavor != AUTH_NONE:  # AUTH_NONE and AUTH_SYS calls carry a null verifier
        raise AuthError(AuthStat.AUTH_BADVERF)
    return parsed


@dataclass(slots=True)
class PendingCall:
    """A call its program carries out asynchronously (from :meth:`RpcServer.call_now`)."""

    program: Program
    ctx: CallContext
    args: Unpacker
    reply: Reply
    """The accepted reply's header, which the results follow."""

    async def finish(self) -> Reply:
        """Run the program for the call; every exception becomes its reply."""
        try:
            await self.program.dispatch(self.ctx, self.args, self.reply)
        except Exception as exc:
            return _failed(self.ctx, exc)
        return self.reply


def _failed(ctx: CallContext, exc: Exception) -> Reply:
    """The reply to a call its program raised ``exc`` for."""
    if isinstance(exc, ProcUnavailable):
        return accepted_error(ctx.xid, AcceptStat.PROC_UNAVAIL)
    if isinstance(exc, XdrError):
        logger.info(
            "%s %s: garbage arguments to %d.%d.%d: %s",
            ctx.transport,
            ctx.peer,
            ctx.prog,
            ctx.vers,
            ctx.proc,
            exc,
        )
        return accepted_error(ctx.xid, AcceptStat.GARBAGE_ARGS)
    if isinstance(exc, AuthError):
        return auth_error(ctx.xid, exc.stat)
    logger.error(
        "%s %s: %d.%d.%d failed",
        ctx.transport,
        ctx.peer,
        ctx.prog,
        ctx.vers,
        ctx.proc,
        exc_info=exc,
    )
    return accepted_error(ctx.xid, AcceptStat.SYSTEM_ERR)
