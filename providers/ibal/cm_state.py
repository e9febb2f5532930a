"""The IB CM connection state machine, without I/O: which call is allowed when, and what follows.

One :class:`CmMachine` per connection, on either side. The application's
calls (``ib_cm_req``, ``ib_cm_rep``, ...) go in as methods that check the
state and the private data and return the :class:`Send` steps the transport
must take; what the transport reports (established, rejected, disconnected)
goes in as methods that return the :class:`Notify` callbacks to raise. The
states are the IB CM's (IBTA vol. 1 ch. 12, as WinOF's CEP layer names them):

=============  ==========================================================
IDLE           active side before ``ib_cm_req``
REQ_SENT       active: REQ sent, waiting for REP (or REJ, or a timeout)
REQ_RCVD       passive: REQ delivered to the listen's callback
MRA_REQ_SENT   passive: the REQ was acknowledged with an MRA
REP_SENT       passive: REP sent, waiting for the connection (RTU)
REP_RCVD       active: REP delivered to the REP callback, RTU or REJ owed
MRA_REP_SENT   active: the REP was acknowledged with an MRA
ESTABLISHED    connected
DREQ_SENT      ``ib_cm_dreq`` called, waiting for the disconnection (DREP)
DREQ_RCVD      the peer disconnected, ``ib_cm_drep`` owed
TIMEWAIT       disconnected on both sides
REJECTED       ended by a REJ (either side) before it was established
DESTROYED      the QP or the access layer went away: no more callbacks
=============  ==========================================================

A call in any other state fails with IB_INVALID_STATE. Private data longer
than IBAL's limit for the message (``IB_*_PDATA_SIZE`` in ``ib_types.h``)
fails with IB_INVALID_SETTING, as IBAL's message formatting does; private data
for a message the transport has no wire message for (on iWARP: RTU, MRA, DREQ,
DREP, an active side's REJ of a REP, and any REJ's additional rejection
information) fails with IB_UNSUPPORTED rather than vanish.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from enum import Enum, IntEnum, auto

from rdmashim.providers.ibal.status import IbError, IbStatus


class CmMsg(Enum):
    """The IB CM messages this facade models (LAP/APR are not: iWARP has no alternate path)."""

    REQ = auto()
    REP = auto()
    RTU = auto()
    REJ = auto()
    MRA = auto()
    DREQ = auto()
    DREP = auto()


PDATA_SIZE: dict[CmMsg, int] = {
    CmMsg.REQ: 92,
    CmMsg.REP: 196,
    CmMsg.REJ: 148,
    CmMsg.RTU: 224,
    CmMsg.MRA: 222,
    CmMsg.DREQ: 220,
    CmMsg.DREP: 224,
}
"""``IB_REQ_PDATA_SIZE`` ... ``IB_DREP_PDATA_SIZE`` from WinOF's ``ib_types.h``."""

IB_ARI_SIZE = 72
"""Bytes of additional rejection information a REJ holds."""

IWARP_CARRIES = frozenset({CmMsg.REQ, CmMsg.REP, CmMsg.REJ})
"""The messages whose private data an iWARP connection setup carries (MPA Request,
Reply, Reject); the others have no wire message on iWARP."""


class ib_rej_status_t(IntEnum):
    """``ib_rej_status_t``: a REJ's reason, value for value (IBAL keeps them in network
    order, ``CL_HTON16(n)``; here they are the host numbers n)."""

    IB_REJ_INSUF_QP = 1
    IB_REJ_INSUF_EEC = 2
    IB_REJ_INSUF_RESOURCES = 3
    IB_REJ_TIMEOUT = 4
    IB_REJ_UNSUPPORTED = 5
    IB_REJ_INVALID_COMM_ID = 6
    IB_REJ_INVALID_COMM_INSTANCE = 7
    IB_REJ_INVALID_SID = 8
    IB_REJ_INVALID_XPORT = 9
    IB_REJ_STALE_CONN = 10
    IB_REJ_RDC_NOT_EXIST = 11
    IB_REJ_INVALID_GID = 12
    IB_REJ_INVALID_LID = 13
    IB_REJ_INVALID_SL = 14
    IB_REJ_INVALID_TRAFFIC_CLASS = 15
    IB_REJ_INVALID_HOP_LIMIT = 16
    IB_REJ_INVALID_PKT_RATE = 17
    IB_REJ_INVALID_ALT_GID = 18
    IB_REJ_INVALID_ALT_LID = 19
    IB_REJ_INVALID_ALT_SL = 20
    IB_REJ_INVALID_ALT_TRAFFIC_CLASS = 21
    IB_REJ_INVALID_ALT_HOP_LIMIT = 22
    IB_REJ_INVALID_ALT_PKT_RATE = 23
    IB_REJ_PORT_REDIRECT = 24
    IB_REJ_INVALID_MTU = 26
    IB_REJ_INSUFFICIENT_RESP_RES = 27
    IB_REJ_USER_DEFINED = 28
    IB_REJ_INVALID_RNR_RETRY = 29
    IB_REJ_DUPLICATE_LOCAL_COMM_ID = 30
    IB_REJ_INVALID_CLASS_VER = 31
    IB_REJ_INVALID_FLOW_LBL = 32
    IB_REJ_INVALID_ALT_FLOW_LBL = 33
    IB_REJ_SERVICE_HANDOFF = 65535


R = ib_rej_status_t


class CmState(Enum):
    """Where a connection is (see the module docstring)."""

    IDLE = auto()
    REQ_SENT = auto()
    REQ_RCVD = auto()
    MRA_REQ_SENT = auto()
    REP_SENT = auto()
    REP_RCVD = auto()
    MRA_REP_SENT = auto()
    ESTABLISHED = auto()
    DREQ_SENT = auto()
    DREQ_RCVD = auto()
    TIMEWAIT = auto()
    REJECTED = auto()
    DESTROYED = auto()


class Wire(Enum):
    """What the transport must do."""

    CONNECT = auto()
    ACCEPT = auto()
    REJECT = auto()
    DISCONNECT = auto()


@dataclass(frozen=True, slots=True)
class Send:
    """A transport step a call asks for, with the private data it carries."""

    wire: Wire
    private_data: bytes = b""


@dataclass(frozen=True, slots=True)
class Notify:
    """A callback to raise: ``msg`` names it (REP, RTU, REJ, DREQ, DREP)."""

    msg: CmMsg
    private_data: bytes = b""
    rej_status: ib_rej_status_t | None = None
    cm_status: IbStatus = IbStatus.IB_SUCCESS


_CALLS: dict[CmMsg, str] = {msg: f"ib_cm_{msg.name.lower()}" for msg in CmMsg}

S = CmState
GONE_BEFORE_ESTABLISHED = R.IB_REJ_TIMEOUT
"""The REJ reason reported when the transport connection ends before the connection is
established on this side (the peer gave up or went away without a REJ of its own)."""


def check_private_data(msg: CmMsg, private_data: bytes, carries: frozenset[CmMsg]) -> None:
    """IBAL's length limit for ``msg``, then whether the transport can carry it at all."""
    call = _CALLS[msg]
    if len(private_data) > PDATA_SIZE[msg]:
        raise IbError(
            IbStatus.IB_INVALID_SETTING,
            call,
            f"{len(private_data)} bytes of private data > IB_{msg.name}_PDATA_SIZE "
            f"({PDATA_SIZE[msg]})",
        )
    if private_data and msg not in carries:
        raise IbError(
            IbStatus.IB_UNSUPPORTED,
            call,
            f"this transport has no {msg.name} message to carry private data",
        )


def timeout_seconds(resp_timeout: int, retries: int = 0) -> float:
    """An IB CM timeout field (4.096 us * 2^n) over ``retries`` resends, in seconds."""
    return 4.096e-6 * (1 << min(resp_timeout, 31)) * (retries + 1)


def rej_status_for(refused: bool, status: int, private_data: bytes) -> ib_rej_status_t:
    """The REJ reason an active side reports for a connection setup that failed.

    ``refused`` says the peer answered (a reject or a refused TCP connection) rather than
    fail to (a timeout, no route, a broken exchange); ``status`` is the negative errno
    the portable CM gave. Mapping (iWARP):

    * a TCP connection refused without private data (no listener on the service's
      port) and a connection closed before any MPA answer (no listen whose compare
      buffer matched) -> IB_REJ_INVALID_SID;
    * an MPA Reject (the peer's ``ib_cm_rej``) -> IB_REJ_USER_DEFINED, its private data kept;
    * no answer in time, no route -> IB_REJ_TIMEOUT.
    """
    err = -status if status < 0 else status
    if err in (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH):
        return R.IB_REJ_TIMEOUT
    if refused:
        if err == errno.ECONNREFUSED and not private_data:
            return R.IB_REJ_INVALID_SID
        return R.IB_REJ_USER_DEFINED
    return R.IB_REJ_INVALID_SID


class CmMachine:
    """One connection's IB CM state (see the module docstring).

    ``carries`` are the messages whose private data the transport can carry
    (:data:`IWARP_CARRIES`). A passive machine starts in REQ_RCVD, an active one in IDLE.
    """

    def __init__(self, *, passive: bool, carries: frozenset[CmMsg] = IWARP_CARRIES) -> None:
        self.passive = passive
        self.carries = carries
        self.state = S.REQ_RCVD if passive else S.IDLE
        self.svc_timeout: int | None = None
        """The service timeout of the last MRA this side sent (None: none sent)."""

    def __repr__(self) -> str:
        return f"<CmMachine {'passive' if self.passive else 'active'} {self.state.name}>"

    def _require(self, msg: CmMsg, *states: CmState) -> None:
        if self.state not in states:
            names = " or ".join(s.name for s in states)
            raise IbError(
                IbStatus.IB_INVALID_STATE,
                _CALLS[msg],
                f"the connection is {self.state.name}, needs {names}",
            )

    def _begin(self, msg: CmMsg, private_data: bytes, *states: CmState) -> None:
        self._require(msg, *states)
        check_private_data(msg, private_data, self.carries)

    # ------------------------------------------------------------------ calls
    def req(self, private_data: bytes) -> list[Send]:
        """``ib_cm_req``: connect with the REQ's private data."""
        self._begin(CmMsg.REQ, private_data, S.IDLE)
        self.state = S.REQ_SENT
        return [Send(Wire.CONNECT, private_data)]

    def rep(self, private_data: bytes) -> list[Send]:
        """``ib_cm_rep``: accept with the REP's private data."""
        self._begin(CmMsg.REP, private_data, S.REQ_RCVD, S.MRA_REQ_SENT)
        self.state = S.REP_SENT
        return [Send(Wire.ACCEPT, private_data)]

    def rtu(self, private_data: bytes) -> list[Send]:
        """``ib_cm_rtu``: the active side's last step; the connection is ready."""
        self._begin(CmMsg.RTU, private_data, S.REP_RCVD, S.MRA_REP_SENT)
        self.state = S.ESTABLISHED
        return []

    def rej(self, private_data: bytes, ari: bytes = b"") -> list[Send]:
        """``ib_cm_rej``: refuse a REQ (passive) or a REP (active)."""
        self._require(CmMsg.REJ, S.REQ_RCVD, S.MRA_REQ_SENT, S.REP_RCVD, S.MRA_REP_SENT)
        if len(ari) > IB_ARI_SIZE:
            raise IbError(IbStatus.IB_INVALID_SETTING, "ib_cm_rej", f"{len(ari)} bytes of ARI > 72")
        check_private_data(CmMsg.REJ, private_data, self.carries)
        if ari:
            raise IbError(
                IbStatus.IB_UNSUPPORTED, "ib_cm_rej", "the transport's reject carries no ARI"
            )
        passive_answer = self.state in (S.REQ_RCVD, S.MRA_REQ_SENT)
        if not passive_answer and private_data:
            # The active side's REJ of a REP ends a transport connection that is already
            # up: there is no message left to carry it in.
            raise IbError(
                IbStatus.IB_UNSUPPORTED, "ib_cm_rej", "a REJ of a REP carries no private data"
            )
        self.state = S.REJECTED
        if passive_answer:
            return [Send(Wire.REJECT, private_data)]
        return [Send(Wire.DISCONNECT)]

    def mra(self, private_data: bytes, svc_timeout: int) -> list[Send]:
        """``ib_cm_mra``: acknowledge a REQ or REP that needs time to answer."""
        self._begin(CmMsg.MRA, private_data, S.REQ_RCVD, S.REP_RCVD)
        self.svc_timeout = svc_timeout
        self.state = S.MRA_REQ_SENT if self.state is S.REQ_RCVD else S.MRA_REP_SENT
        return []

    def dreq(self, private_data: bytes) -> list[Send]:
        """``ib_cm_dreq``: disconnect."""
        self._begin(CmMsg.DREQ, private_data, S.ESTABLISHED)
        self.state = S.DREQ_SENT
        return [Send(Wire.DISCONNECT)]

    def drep(self, private_data: bytes) -> list[Send]:
        """``ib_cm_drep``: answer the peer's disconnection; the connection is over."""
        self._begin(CmMsg.DREP, private_data, S.DREQ_RCVD)
        self.state = S.TIMEWAIT
        return []

    # ------------------------------------------------------------------ transport events
    def established(self, private_data: bytes = b"") -> list[Notify]:
        """The transport connection is up (active: the REP arrived; passive: the RTU)."""
        if self.state is S.REQ_SENT:
            self.state = S.REP_RCVD
            return [Notify(CmMsg.REP, private_data)]
        if self.state is S.REP_SENT:
            self.state = S.ESTABLISHED
            return [Notify(CmMsg.RTU)]
        return []

    def rejected(self, rej_status: ib_rej_status_t, private_data: bytes = b"") -> list[Notify]:
        """Connection setup failed with ``rej_status`` (a REJ, a refusal or a timeout)."""
        if self.state in (S.REQ_SENT, S.REP_SENT):
            self.state = S.REJECTED
            return [Notify(CmMsg.REJ, private_data, rej_status)]
        return []

    def disconnected(self) -> list[Notify]:
        """The transport connection ended."""
        if self.state is S.ESTABLISHED:
            self.state = S.DREQ_RCVD
            return [Notify(CmMsg.DREQ)]
        if self.state is S.DREQ_SENT:
            self.state = S.TIMEWAIT
            return [Notify(CmMsg.DREP)]
        if self.state in (S.REQ_SENT, S.REP_SENT, S.REP_RCVD, S.MRA_REP_SENT):
            self.state = S.REJECTED
            return [Notify(CmMsg.REJ, b"", GONE_BEFORE_ESTABLISHED)]
        return []

    def destroyed(self) -> None:
        """The connection's QP or access layer is gone: nothing more is reported."""
        self.state = S.DESTROYED

    @property
    def finished(self) -> bool:
        """Whether nothing more can happen on this connection."""
        return self.state in (S.TIMEWAIT, S.REJECTED, S.DESTROYED)
