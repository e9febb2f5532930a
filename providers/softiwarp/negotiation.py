"""MPA connection setup rules (RFC 5044 §7, RFC 6581), free of I/O.

:func:`make_request` builds the initiator's Request, :func:`answer_request`
decides the responder's Reply (or Reject), and :func:`check_reply` settles the
initiator's view of the Reply. Both sides end with the same :class:`MpaResult`
values: CRC on when either side asked for it, the responder's IRD/ORD no larger
than what the initiator can use, and the RTR message when peer-to-peer is on.
"""

from __future__ import annotations

from dataclasses import dataclass

from rdmashim.cm.types import RTR
from rdmashim.providers.softiwarp.mpa import StartFrame
from rdmashim.providers.softiwarp.terminate import LlpCode, ProtocolError, llp


class MpaRejected(Exception):
    """The peer rejected the connection; ``private_data`` is what it said."""

    def __init__(self, private_data: bytes) -> None:
        super().__init__(f"MPA Reject ({len(private_data)} bytes of private data)")
        self.private_data = private_data


@dataclass(frozen=True, slots=True)
class MpaOptions:
    """What this side asks for or accepts during MPA setup.

    ``crc``: request CRC (on whenever either side asks). ``revision``: 2 (RFC 6581
    IRD/ORD exchange) or 1. ``p2p``: peer-to-peer mode; the initiator offers
    ``rtr`` types and the responder picks one. ``ird``/``ord``: RDMA Reads served
    and issued at once (verbs' responder_resources / initiator_depth).
    """

    crc: bool = True
    revision: int = 2
    p2p: bool = False
    rtr: RTR = RTR.WRITE | RTR.READ
    ird: int = 16
    ord: int = 16
    max_fpdu: int = 65536
    """Largest FPDU this side sends, in bytes (not negotiated: receivers take any size)."""


@dataclass(frozen=True, slots=True)
class MpaResult:
    """What both sides run with after setup."""

    crc: bool
    revision: int
    ird: int
    ord: int
    rtr: RTR
    """The RTR message of peer-to-peer mode (NONE without it)."""
    private_data: bytes
    """The peer's ULP private data."""


def make_request(options: MpaOptions, private_data: bytes) -> StartFrame:
    """The initiator's MPA Request."""
    enhanced = options.revision == 2
    return StartFrame(
        reply=False,
        revision=options.revision,
        crc=options.crc,
        enhanced=enhanced,
        ird=options.ird if enhanced else 0,
        ord=options.ord if enhanced else 0,
        p2p=options.p2p and enhanced,
        rtr=options.rtr if options.p2p and enhanced else RTR.NONE,
        private_data=private_data,
    )


def answer_request(
    request: StartFrame, options: MpaOptions, private_data: bytes
) -> tuple[StartFrame, MpaResult]:
    """The responder's Reply to an acceptable Request, and the result it settles.

    Raises :class:`ProtocolError` for a Request this side must reject (markers);
    the caller sends :func:`reject_reply` then.
    """
    if request.markers:
        raise ProtocolError("peer requested MPA markers", llp(LlpCode.INVALID_REQ_REP))
    crc = request.crc or options.crc
    enhanced = request.enhanced
    ird = ord_ = 0
    rtr = RTR.NONE
    if enhanced:
        # Relaxed negotiation (as Linux siw): the responder lowers to what the peer can take.
        ird = min(options.ird, request.ord)
        ord_ = min(options.ord, request.ird)
        if request.p2p and options.p2p:
            offered = request.rtr
            rtr = RTR.WRITE if offered & RTR.WRITE or not offered & RTR.READ else RTR.READ
    reply = StartFrame(
        reply=True,
        revision=request.revision,
        crc=crc,
        enhanced=enhanced,
        ird=ird,
        ord=ord_,
        p2p=rtr is not RTR.NONE,
        rtr=rtr,
        private_data=private_data,
    )
    if not enhanced:
        ird, ord_ = options.ird, options.ord
    return reply, MpaResult(crc, request.revision, ird, ord_, rtr, request.private_data)


def reject_reply(request: StartFrame | None, private_data: bytes) -> StartFrame:
    """An MPA Reply with the Reject bit, answering ``request`` (or a bad one)."""
    revision = request.revision if request is not None else 2
    enhanced = request.enhanced if request is not None else revision == 2
    return StartFrame(
        reply=True, revision=revision, reject=True, enhanced=enhanced, private_data=private_data
    )


def check_reply(request: StartFrame, reply: StartFrame, options: MpaOptions) -> MpaResult:
    """The initiator's result from the responder's Reply.

    Raises :class:`MpaRejected` for a Reject and :class:`ProtocolError` for a
    Reply the initiator cannot run with.
    """
    if reply.reject:
        raise MpaRejected(reply.private_data)
    if reply.markers:
        raise ProtocolError("responder turned MPA markers on", llp(LlpCode.INVALID_REQ_REP))
    if reply.revision > request.revision:
        raise ProtocolError(
            f"reply revision {reply.revision} above request's {request.revision}",
            llp(LlpCode.INVALID_REQ_REP),
        )
    if request.enhanced and reply.revision == 2 and not reply.enhanced:
        raise ProtocolError("MPA v2 reply without its IRD/ORD block", llp(LlpCode.INVALID_REQ_REP))
    crc = request.crc or reply.crc
    ird, ord_ = options.ird, options.ord
    rtr = RTR.NONE
    if reply.enhanced:
        if reply.ord > options.ird:
            raise ProtocolError(
                f"responder's ORD {reply.ord} exceeds our IRD {options.ird}",
                llp(LlpCode.INSUFFICIENT_IRD),
            )
        ord_ = min(options.ord, reply.ird)
        if reply.p2p:
            rtr = reply.rtr
            if not request.p2p or rtr not in (RTR.WRITE, RTR.READ) or not rtr & request.rtr:
                raise ProtocolError(
                    f"no matching RTR (offered {request.rtr!r}, chosen {rtr!r})",
                    llp(LlpCode.NO_MATCHING_RTR),
                )
    return MpaResult(crc, reply.revision, ird, ord_, rtr, reply.private_data)
