"""Connecting a queue pair over an established TCP stream: MPA setup, then the data path.

The rdma_cm connector builds on these; on their own they serve any code that
already has a connected ``trio.SocketStream``:

* initiator: ``result = await connect_qp(qp, stream, private_data=b"...")``
* responder: ``request = await read_request(stream)``, then
  ``await accept_qp(qp, stream, request, ...)`` or ``await reject(stream, request, ...)``.
"""

from __future__ import annotations

import contextlib
import logging
import socket as _stdlib_socket
from dataclasses import dataclass

import trio

from rdmashim.cm.types import RTR
from rdmashim.providers.softiwarp.ddp import Opcode
from rdmashim.providers.softiwarp.jobs import EngineConfig
from rdmashim.providers.softiwarp.mpa import StartFrame, encode_start_frame, parse_start_frame
from rdmashim.providers.softiwarp.negotiation import (
    MpaOptions,
    MpaRejected,
    MpaResult,
    answer_request,
    check_reply,
    make_request,
    reject_reply,
)
from rdmashim.providers.softiwarp.qp import QPBase
from rdmashim.providers.softiwarp.terminate import ProtocolError

log = logging.getLogger(__name__)

MPA_REPLY_TIMEOUT = 10.0
"""Seconds the initiator waits for the MPA Reply after sending its Request (Linux siw:
``MPAREQ_TIMEOUT``, 10 s)."""
MPA_REQUEST_TIMEOUT = 5.0
"""Seconds the responder waits for the MPA Request after accepting TCP (Linux siw:
``MPAREP_TIMEOUT``, 5 s)."""


class MpaTimeout(TimeoutError):
    """The peer did not complete MPA setup in time."""


@dataclass(frozen=True, slots=True)
class ConnectRequest:
    """An MPA Request received by the responder, and bytes that followed it."""

    frame: StartFrame
    leftover: bytes = b""

    @property
    def private_data(self) -> bytes:
        """The initiator's ULP private data."""
        return self.frame.private_data


async def _read_frame(stream: trio.SocketStream, *, reply: bool) -> tuple[StartFrame, bytes]:
    buf = bytearray()
    while True:
        parsed = parse_start_frame(buf, reply=reply)
        if parsed is not None:
            frame, used = parsed
            return frame, bytes(buf[used:])
        try:
            chunk = await stream.receive_some(4096)
        except trio.BrokenResourceError as exc:
            raise ConnectionResetError(f"connection broken during MPA setup: {exc}") from exc
        if not chunk:
            raise ConnectionResetError("connection closed during MPA setup")
        buf += chunk


async def _send_frame(stream: trio.SocketStream, frame: StartFrame) -> None:
    try:
        await stream.send_all(encode_start_frame(frame))
    except trio.BrokenResourceError as exc:
        raise ConnectionResetError(f"connection broken during MPA setup: {exc}") from exc


def _tune(stream: trio.SocketStream) -> None:
    stream.setsockopt(_stdlib_socket.IPPROTO_TCP, _stdlib_socket.TCP_NODELAY, True)


def _start(
    qp: QPBase,
    stream: trio.SocketStream,
    result: MpaResult,
    options: MpaOptions,
    *,
    initiator: bool,
    leftover: bytes,
) -> None:
    if qp._closed or qp.context._closed:  # closed while the MPA frame was on its way
        raise ConnectionAbortedError("the QP or its device was closed during connection setup")
    rtr_to_send = None
    if initiator and result.rtr is RTR.WRITE:
        rtr_to_send = Opcode.WRITE
    elif initiator and result.rtr is RTR.READ:
        rtr_to_send = Opcode.READ_REQUEST
    config = EngineConfig(
        max_fpdu=options.max_fpdu,
        crc=result.crc,
        ird=result.ird,
        ord=result.ord,
        rtr_to_send=rtr_to_send,
        wait_for_rtr=not initiator and result.rtr is not RTR.NONE,
    )
    qp.connect(config, stream.socket, leftover)
    log.debug(
        "QP %d connected (%s): CRC %s, MPA rev %d, IRD %d, ORD %d, RTR %s",
        qp.qp_num, "initiator" if initiator else "responder", result.crc, result.revision,
        result.ird, result.ord, result.rtr.name,
    )  # fmt: skip


async def connect_qp(
    qp: QPBase,
    stream: trio.SocketStream,
    *,
    private_data: bytes = b"",
    options: MpaOptions | None = None,
    reply_timeout: float = MPA_REPLY_TIMEOUT,
) -> MpaResult:
    """Run MPA setup as initiator on ``stream`` and put ``qp`` in RTS.

    Raises :class:`MpaRejected` (with the peer's private data), :class:`MpaTimeout`,
    or :class:`ProtocolError` for a Reply this side cannot accept.
    """
    options = options or MpaOptions()
    request = make_request(options, private_data)
    try:
        _tune(stream)
        await _send_frame(stream, request)
        with trio.move_on_after(reply_timeout) as scope:
            reply, leftover = await _read_frame(stream, reply=True)
        if scope.cancelled_caught:
            raise MpaTimeout(f"no MPA Reply within {reply_timeout} s")
        result = check_reply(request, reply, options)
        _start(qp, stream, result, options, initiator=True, leftover=leftover)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return result


async def read_request(
    stream: trio.SocketStream, *, request_timeout: float = MPA_REQUEST_TIMEOUT
) -> ConnectRequest:
    """Wait for the initiator's MPA Request (a responder's first step)."""
    _tune(stream)
    with trio.move_on_after(request_timeout) as scope:
        frame, leftover = await _read_frame(stream, reply=False)
    if scope.cancelled_caught:
        raise MpaTimeout(f"no MPA Request within {request_timeout} s")
    return ConnectRequest(frame, leftover)


async def accept_qp(
    qp: QPBase,
    stream: trio.SocketStream,
    request: ConnectRequest,
    *,
    private_data: bytes = b"",
    options: MpaOptions | None = None,
) -> MpaResult:
    """Answer ``request`` with an MPA Reply and put ``qp`` in RTS.

    A Request this side cannot serve (markers) is rejected and raises
    :class:`ProtocolError`.
    """
    options = options or MpaOptions()
    try:
        reply, result = answer_request(request.frame, options, private_data)
    except ProtocolError:
        await reject(stream, request, b"")
        raise
    await _send_frame(stream, reply)
    _start(qp, stream, result, options, initiator=False, leftover=request.leftover)
    return result


async def reject(
    stream: trio.SocketStream, request: ConnectRequest | None, private_data: bytes = b""
) -> None:
    """Send an MPA Reject carrying ``private_data`` and close the stream."""
    frame = reject_reply(request.frame if request is not None else None, private_data)
    try:
        await _send_frame(stream, frame)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_eof()
    finally:
        await stream.aclose()


__all__ = [
    "MPA_REPLY_TIMEOUT",
    "MPA_REQUEST_TIMEOUT",
    "ConnectRequest",
    "MpaOptions",
    "MpaRejected",
    "MpaResult",
    "MpaTimeout",
    "accept_qp",
    "connect_qp",
    "read_request",
    "reject",
]
