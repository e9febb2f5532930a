"""Receiving (siw's ``siw_qp_rx.c``): FPDUs reassembled from the TCP byte stream,
checked, placed and completed.

The driver reads into :meth:`Receiver.recv_buffer` (the staging buffer, or for a
large payload the target slice of registered memory) and reports with
:meth:`Receiver.received`. Whole runs of small Sends and of tagged FPDUs go to the
fast paths of :mod:`.rx_runs` first; anything else is parsed a header, a payload
piece and a trailer at a time here: Sends into the receive at the head of the
queue, Writes into the region their STag names, Read Responses through
:mod:`.reads`, Read Requests onto the IRQ, and a peer's Terminate.
"""

from __future__ import annotations

import logging

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import (
    QN,
    SEND_MIN,
    TAGGED_MIN,
    TO_LIMIT,
    U32_MAX,
    Opcode,
)
from rdmashim.providers.softiwarp.jobs import (
    EngineState,
    RxStep,
    slice_segments,
)
from rdmashim.providers.softiwarp.kernels import TAGGED_CTRLS
from rdmashim.providers.softiwarp.memory import AccessViolation, Violation
from rdmashim.providers.softiwarp.rx_runs import RunReceiver
from rdmashim.providers.softiwarp.terminate import (
    DDP_CATASTROPHIC,
    DdpTaggedCode,
    DdpUntaggedCode,
    LlpCode,
    ProtocolError,
    RdmapCode,
    RdmapType,
    ddp_tagged,
    ddp_untagged,
    llp,
    rdmap,
)
from rdmashim.verbs.enums import Access, WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.wr import WC

log = logging.getLogger(__name__)

STAGING_SIZE = 256 * 1024
DIRECT_MIN = 16 * 1024
"""Payload left to receive above which bytes go straight into the target region."""


class Receiver(RunReceiver):
    """The engine's receive side (see the module docstring)."""

    def recv_buffer(self) -> memoryview:
        """Where the driver should ``recv_into`` next."""
        if (
            self._rx is RxStep.PAYLOAD
            and self._start == self._end
            and self._remaining >= DIRECT_MIN
            and self._targets
        ):
            target = self._targets[0]
            direct = target[: self._remaining] if len(target) > self._remaining else target
            self._direct = direct
            return direct
        self._direct = None
        if not self._staging:
            self._staging = bytearray(STAGING_SIZE)
            self._sview = memoryview(self._staging)
        if self._start == self._end:
            self._start = self._end = 0
        elif STAGING_SIZE - self._end < 4096:
            n = self._end - self._start
            self._staging[:n] = self._sview[self._start : self._end]
            self._start, self._end = 0, n
        return self._sview[self._end :]

    def received(self, nbytes: int) -> None:
        """``nbytes`` arrived in the buffer :meth:`recv_buffer` returned."""
        self.bytes_received += nbytes
        if self._rx is RxStep.DISCARD:
            self._start = self._end = 0
            return
        direct = self._direct
        if direct is not None:
            self._direct = None
            if self.config.crc:
                self._crc = self._kernels.crc32c(direct[:nbytes], self._crc)
            self._remaining -= nbytes
            target = self._targets[0]
            if nbytes == len(target):
                self._targets.pop(0)
            else:
                self._targets[0] = target[nbytes:]
            if not self._remaining:
                self._rx = RxStep.TRAILER
            return
        start, end = self._start, self._end + nbytes
        self._end = end
        try:
            if self._rx is RxStep.HEADER and self._rx_send is None and end - start >= SEND_MIN:
                # Whole Sends first: when they are all the bytes (a ping-pong reads one),
                # no pass of the general loop.
                start = self._start = self._small_sends(self._sview, start, end)
                if start == end:
                    self._start = self._end = 0
                    return
            self._process()
        except ProtocolError as exc:
            self._protocol_error(exc)
        except Exception as exc:  # a bug of ours must not take the process down
            self._internal_error(exc)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copying them into place); for tests and tools."""
        view = memoryview(data)
        while view and not self._discarding():
            buf = self.recv_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.received(n)

    def _process(self) -> None:
        sview = self._sview
        crc_on = self.config.crc
        crc32c = self._kernels.crc32c
        while True:
            avail = self._end - self._start
            rx = self._rx
            if rx is RxStep.HEADER:
                # The fast paths, in turn while they make progress: the Sends after a
                # run of Writes (RDS's RDMA by cookie) need no general path either.
                while avail >= TAGGED_MIN:
                    start = self._start
                    ctrl = sview[start + 3]
                    if ctrl in TAGGED_CTRLS:
                        self._start = self._tagged_run(sview, start, self._end, ctrl)
                    elif self._rx_send is None:
                        self._start = self._small_sends(sview, start, self._end)
                    if self._start == start or self._discarding():
                        break
                    avail = self._end - self._start
                if self._discarding():
                    break
                if avail < 4:
                    break
                hdr = ddp.parse_header(sview, self._start, self._end)
                if hdr is None:
                    break
                hlen = ddp.HEADER_LEN_BY_OPCODE[hdr.opcode]
                if crc_on:
                    self._crc = crc32c(sview[self._start : self._start + hlen])
                self._hdr = hdr
                self._start += hlen
                self._begin_segment(hdr)
                if self._discarding():
                    break
            elif rx is RxStep.PAYLOAD:
                take = min(avail, self._remaining)
                if not take:
                    break
                src = sview[self._start : self._start + take]
                if crc_on:
                    self._crc = crc32c(src, self._crc)
                self._place(src)
                self._start += take
                self._remaining -= take
                if not self._remaining:
                    self._rx = RxStep.TRAILER
            elif rx is RxStep.TRAILER:
                hdr = self._hdr
                assert hdr is not None
                need = ddp.trailer_len(hdr.ulpdu_len)
                if avail < need:
                    break
                trailer = sview[self._start : self._start + need]
                if crc_on and not ddp.check_trailer(self._crc, trailer):
                    raise ProtocolError("received CRC mismatch", llp(LlpCode.CRC))
                self._start += need
                self._rx = RxStep.HEADER
                self._end_segment(hdr)
                if self._discarding():
                    break
            else:
                break
        if self._start == self._end:
            self._start = self._end = 0

    def _place(self, src: memoryview) -> None:
        targets = self._targets
        while src:
            target = targets[0]
            n = len(target)
            if n <= len(src):
                target[:] = src[:n]
                targets.pop(0)
                src = src[n:]
            else:
                k = len(src)
                target[:k] = src
                targets[0] = target[k:]
                return

    def _begin_segment(self, hdr: ddp.Header) -> None:
        if self.state is not EngineState.RTS:
            raise ProtocolError("FPDU before the connection reached RTS", DDP_CATASTROPHIC)
        payload = hdr.ulpdu_len + 2 - ddp.HEADER_LEN_BY_OPCODE[hdr.opcode]
        op = hdr.opcode
        self._targets = []
        if op is Opcode.WRITE:
            if payload:
                if hdr.to + payload > TO_LIMIT:
                    raise ProtocolError(
                        f"Write at TO {hdr.to:#x} + {payload} wraps",
                        ddp_tagged(DdpTaggedCode.TO_WRAP),
                        header=hdr,
                    )
                try:
                    view = self.memory.resolve(
                        hdr.stag, self.pd, hdr.to, payload, Access.REMOTE_WRITE
                    )
                except AccessViolation as exc:
                    raise ProtocolError(str(exc), exc.violation.ddp_code(), header=hdr) from exc
                self._targets = [view]
            elif self._rtr_pending:
                self._rtr_received()
        elif op is Opcode.READ_RESPONSE:
            self._targets = self._read_response_targets(hdr, payload)
        elif op in ddp.SEND_OPCODES:
            self._targets = self._send_targets(hdr, payload)
        elif op is Opcode.READ_REQUEST:
            if payload:
                raise ProtocolError("Read Request with payload", DDP_CATASTROPHIC)
        else:  # Terminate
            self._check_untagged(hdr, QN.TERMINATE)
            if hdr.mo != 0:
                raise ProtocolError(
                    f"Terminate with MO {hdr.mo}", ddp_untagged(DdpUntaggedCode.INVALID_MO)
                )
            self._term_body = bytearray(payload)
            self._targets = [memoryview(self._term_body)]
        self._remaining = payload
        self._rx = RxStep.PAYLOAD if payload else RxStep.TRAILER

    def _check_untagged(self, hdr: ddp.Header, qn: QN) -> None:
        if hdr.qn != qn:
            raise ProtocolError(
                f"{hdr.opcode.name} on queue {hdr.qn}",
                ddp_untagged(DdpUntaggedCode.INVALID_QN),
                header=hdr,
            )
        if hdr.msn != self._rx_msn[qn]:
            raise ProtocolError(
                f"MSN {hdr.msn} on queue {qn.name}, expected {self._rx_msn[qn]}",
                ddp_untagged(DdpUntaggedCode.MSN_RANGE),
                header=hdr,
            )

    def _send_targets(self, hdr: ddp.Header, payload: int) -> list[memoryview]:
        self._check_untagged(hdr, QN.SEND)
        msg = self._rx_send
        if msg is None:
            if hdr.mo != 0:
                raise ProtocolError(
                    f"first segment with MO {hdr.mo}",
                    ddp_untagged(DdpUntaggedCode.INVALID_MO),
                    header=hdr,
                )
            if self._rtr_pending:
                self._rtr_received()
            job = self.recv_queue.popleft() if self.recv_queue else None
            if job is None:
                raise ProtocolError(
                    "Send with no receive posted",
                    ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),
                    header=hdr,
                )
            msg = self._open_send(job, hdr)
        elif hdr.mo != msg.received:
            raise ProtocolError(
                f"MO {hdr.mo}, expected {msg.received}",
                ddp_untagged(DdpUntaggedCode.INVALID_MO),
                header=hdr,
            )
        self._fit_send(msg, hdr, payload)
        targets = slice_segments(msg.segments, msg.received, payload)
        msg.received += payload
        return targets

    def _end_segment(self, hdr: ddp.Header) -> None:
        op = hdr.opcode
        if op is Opcode.WRITE:
            return
        if op in ddp.SEND_OPCODES:
            if not hdr.last:
                return
            msg = self._rx_send
            assert msg is not None
            self._rx_send = None
            self._rx_msn[QN.SEND] = (self._rx_msn[QN.SEND] + 1) & U32_MAX
            flags = WCFlags.NONE
            inv = 0
            if op in (Opcode.SEND_INV, Opcode.SEND_SE_INV):
                violation = self.memory.invalidate(hdr.inv_stag, self.pd)
                if violation is not None:
                    self.outbox.append(
                        WC(
                            msg.job.wr_id,
                            WCStatus.REM_INV_REQ_ERR,
                            WCOpcode.RECV,
                            msg.received,
                            self.qp_num,
                        )
                    )
                    etype = (
                        RdmapType.REMOTE_OPERATION
                        if violation is Violation.INVALID_STAG
                        else RdmapType.REMOTE_PROTECTION
                    )
                    raise ProtocolError(
                        f"cannot invalidate STag {hdr.inv_stag:#x}: {violation.value}",
                        rdmap(etype, RdmapCode.CANNOT_INVALIDATE),
                        header=hdr,
                    )
                flags = WCFlags.WITH_INV
                inv = hdr.inv_stag
            self.outbox.append(
                WC(
                    msg.job.wr_id, WCStatus.SUCCESS, WCOpcode.RECV, msg.received, self.qp_num,
                    flags, inv, solicited=op in (Opcode.SEND_SE, Opcode.SEND_SE_INV),
                )
            )  # fmt: skip
        elif op is Opcode.READ_RESPONSE:
            if not hdr.last:
                return
            job = self._orq[0]
            if job.received != job.length:
                raise ProtocolError(
                    f"Read Response of {job.received} bytes for a {job.length}-byte Read",
                    ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
                    header=hdr,
                )
            self._read_done()
        elif op is Opcode.READ_REQUEST:
            self._check_untagged(hdr, QN.READ_REQUEST)
            self._read_request(hdr)
        elif op is Opcode.TERMINATE:
            assert self._term_body is not None
            term = ddp.parse_terminate(self._term_body)
            self.remote_terminate = term.code
            log.warning("QP %d: peer sent Terminate %s", self.qp_num, term.code)
            meaning = term.code.meaning
            message = (
                f"the peer ended the connection: {meaning}"
                if meaning
                else ("the peer ended the connection with a Terminate")
            )
            self._enter_error(ProtocolError(message, term.code), remote=term)
