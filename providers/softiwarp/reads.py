"""Read handling (siw's ORQ and IRQ): the Read Requests a peer sends, and the
Read Responses that answer ours.

A peer's Read Request is checked (IRD, TO wrap, the source's STag, PD, rights and
bounds) and its response queued on the IRQ, which :mod:`.tx` sends between
messages. A Read Response is placed into the sink of the Read at the head of the
ORQ, in order; the Read completes when its last byte is placed, in posting order
with the send queue's other work. Sending our Read Requests is :mod:`.tx`'s.
"""

from __future__ import annotations

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import QN, TO_LIMIT, U32_MAX
from rdmashim.providers.softiwarp.jobs import (
    ReadResponse,
)
from rdmashim.providers.softiwarp.memory import AccessViolation
from rdmashim.providers.softiwarp.qp_state import QPEngineState
from rdmashim.providers.softiwarp.terminate import (
    DDP_CATASTROPHIC,
    DdpTaggedCode,
    ProtocolError,
    RdmapCode,
    RdmapType,
    ddp_tagged,
    rdmap,
)
from rdmashim.verbs.enums import Access
from rdmashim.verbs.wr import SGE


class ReadQueues(QPEngineState):
    """The engine's Read handling: the IRQ (Read Requests to answer) and the ORQ (our
    Reads waiting for their response)."""

    def _read_response_targets(self, hdr: ddp.Header, payload: int) -> list[memoryview]:
        """Where the payload of a Read Response segment goes: the next bytes of the sink
        of the Read at the head of the ORQ (refused when it names another STag or
        offset, or overflows the sink)."""
        if not self._orq:
            raise ProtocolError(
                "Read Response with no Read outstanding", DDP_CATASTROPHIC, header=hdr
            )
        job = self._orq[0]
        sge = job.sges[0] if job.sges else SGE(0, 0, 0)
        expected_to = sge.addr + job.received
        if job.length and hdr.stag != sge.lkey:
            raise ProtocolError(
                f"Read Response to STag {hdr.stag:#x}, expected {sge.lkey:#x}",
                ddp_tagged(DdpTaggedCode.INVALID_STAG),
                header=hdr,
            )
        if (job.length and hdr.to != expected_to) or job.received + payload > job.length:
            raise ProtocolError(
                "Read Response outside the Read's sink",
                ddp_tagged(DdpTaggedCode.BASE_BOUNDS),
                header=hdr,
            )
        assert job.sink is not None
        view = job.sink[job.received : job.received + payload]
        job.received += payload
        return [view] if payload else []

    def _read_request(self, hdr: ddp.Header) -> None:
        """Accept a Read Request (its MSN checked): its source is resolved now and its
        response queued on the IRQ; more than IRD outstanding, a TO wrap or a source the
        peer may not read end the connection."""
        if self._responding >= self.config.ird:
            raise ProtocolError(
                f"more than IRD={self.config.ird} Read Requests outstanding",
                rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.CATASTROPHIC_STREAM),
                header=hdr,
                quote_rdmap=True,
            )
        self._rx_msn[QN.READ_REQUEST] = (self._rx_msn[QN.READ_REQUEST] + 1) & U32_MAX
        if hdr.sink_to + hdr.read_size > TO_LIMIT or hdr.src_to + hdr.read_size > TO_LIMIT:
            raise ProtocolError(
                f"Read of {hdr.read_size} bytes from TO {hdr.src_to:#x} to TO "
                f"{hdr.sink_to:#x} wraps",
                rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.TO_WRAP),
                header=hdr,
                quote_rdmap=True,
            )
        if hdr.read_size == 0:
            source = memoryview(b"")
            if self._rtr_pending:
                self._rtr_received()
        else:
            try:
                source = self.memory.resolve(
                    hdr.src_stag, self.pd, hdr.src_to, hdr.read_size, Access.REMOTE_READ
                )
            except AccessViolation as exc:
                raise ProtocolError(
                    str(exc), exc.violation.rdmap_code(), header=hdr, quote_rdmap=True
                ) from exc
        self._irq.append(ReadResponse(hdr.sink_stag, hdr.sink_to, source, hdr.src_stag))
        self._responding += 1

    def _read_done(self) -> None:
        """The Read at the head of the ORQ received all of its response."""
        job = self._orq.popleft()
        job.done = True
        job.sink = None  # placed: no view of the sink beyond its completion
        self._drain_sq_order()
