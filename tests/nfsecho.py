"""A small ONC RPC program for the RPC, TCP and rpcbind tests: echo, sleep, fail."""

from __future__ import annotations

import trio

from rdmashim.ulps.nfsrdma.rpc import AuthError, AuthStat
from rdmashim.ulps.nfsrdma.service import CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker

ECHO_PROG = 0x20000099
"""In the range RFC 5531 leaves to local use."""

NULL, ECHO, ECHO_DDP, SLEEP, FAIL, WEAK, WHOAMI = range(7)


class Echo:
    """Program ``ECHO_PROG`` versions 1..2.

    NULL is answered at once (``dispatch_now``), the others in a task of their own.
    ECHO returns its opaque argument, ECHO_DDP the same as a DDP-eligible item,
    SLEEP waits its argument in milliseconds and returns it, FAIL raises,
    WEAK refuses the credential, WHOAMI returns the transport and the uid
    (``0xFFFFFFFF`` for AUTH_NONE).
    """

    number = ECHO_PROG
    versions = (1, 2)

    def dispatch_now(self, ctx: CallContext, args: Unpacker, reply: Reply) -> bool:
        """NULL at once (see :class:`~rdmashim.ulps.nfsrdma.service.InlineProgram`)."""
        if ctx.proc != NULL:
            return False
        args.done()
        return True

    async def dispatch(self, ctx: CallContext, args: Unpacker, reply: Reply) -> None:
        """Carry out ``ctx.proc``."""
        if ctx.proc == NULL:
            args.done()
        elif ctx.proc in (ECHO, ECHO_DDP):
            data = args.opaque_view(1 << 20)
            args.done()
            if ctx.proc == ECHO:
                reply.packer.opaque(data)
            else:
                reply.opaque_ddp(data)
        elif ctx.proc == SLEEP:
            ms = args.uint()
            await trio.sleep(ms / 1000)
            reply.packer.uint(ms)
        elif ctx.proc == FAIL:
            raise RuntimeError("the program failed")
        elif ctx.proc == WEAK:
            raise AuthError(AuthStat.AUTH_TOOWEAK)
        elif ctx.proc == WHOAMI:
            reply.packer.string(ctx.transport)
            reply.packer.uint(0xFFFFFFFF if ctx.cred is None else ctx.cred.uid)
        else:
            raise ProcUnavailable(ctx.proc)
