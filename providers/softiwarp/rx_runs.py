"""The receive fast paths: runs of whole FPDUs in the staging buffer, handled by
one kernel call each.

Whole one-segment Sends with the expected MSNs are checked and placed into the
receives at the head of the queue and completed together (one :class:`RecvRun`);
whole tagged FPDUs bound for one region (an RDMA Write) or for the sink of the
Read at the head of the ORQ (a Read Response) are checked and placed together.
A run ends before the first FPDU that is anything else or would fail a check,
before any state changes for it: the general path of :mod:`.rx` then handles and
reports it. Opening a receive for a Send (its SGEs resolved and checked) is here
too, for both paths.
"""

from __future__ import annotations

from collections.abc import Sequence

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import QN, TO_LIMIT, U32_MAX
from rdmashim.providers.softiwarp.jobs import (
    EngineState,
    RecvJob,
    RecvRun,
    RxMessage,
)
from rdmashim.providers.softiwarp.kernels import (
    MSG_WORDS,
    SPAN,
    Targets,
)
from rdmashim.providers.softiwarp.memory import AccessViolation, Region
from rdmashim.providers.softiwarp.reads import ReadQueues
from rdmashim.providers.softiwarp.terminate import (
    DDP_CATASTROPHIC,
    DdpUntaggedCode,
    ProtocolError,
    ddp_untagged,
)
from rdmashim.verbs.enums import Access, WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.wr import WC


class RunReceiver(ReadQueues):
    """The engine's receive fast paths (see the module docstring)."""

    def _small_sends(self, sview: memoryview, start: int, end: int) -> int:
        """Complete the whole one-segment Sends at ``sview[start:end]``; the new start.

        The fast path of :meth:`_process` for the common case: untagged Sends or
        Sends with SE whose FPDUs (header, payload, trailer) are all in the staging
        buffer, with the expected MSNs, no message in progress and good CRCs. The
        kernels find that run and place the payloads; this takes a receive for each
        and completes it. The run ends at the first FPDU that is anything else or
        would fail a check, before any state changes for it: the general path then
        handles (and reports) that FPDU.
        """
        if (
            self.state is not EngineState.RTS
            or self._rtr_pending
            or sview[start + 2] != ddp.DDP_UNTAGGED_LAST
            or (sview[start + 3] != ddp.CTRL_SEND and sview[start + 3] != ddp.CTRL_SEND_SE)
        ):
            return start  # not a Send (a bulk FPDU, say): no kernel call for nothing
        kernels = self._kernels
        stop, msgs = kernels.scan_sends(sview, start, end, self._rx_msn[QN.SEND], self.config.crc)
        if not msgs:
            return start  # the general path reports what is wrong, or waits for the rest
        if len(msgs) == MSG_WORDS and self._lone_send(sview, msgs):
            return stop
        queue = self.recv_queue
        count = min(len(msgs) // MSG_WORDS, len(queue))
        jobs = [queue.popleft() for _ in range(count)]
        pd = self.pd
        # What the checks of this run's receives are kept under (none for one message:
        # a ping-pong costs less without).
        token = self.memory.token(pd) if count > 1 else None
        if token is not None and self._place_checked(sview, jobs, msgs, token):
            self._complete_small_sends(jobs, msgs)
            return stop if count * MSG_WORDS == len(msgs) else self._fpdu_at(msgs, count)
        locate = self.memory.locate
        handle = kernels.handle
        regions: dict[int, Region] = {}
        """The regions of the SGEs met in this run, checked once each (no user code
        runs during a run: none is deregistered meanwhile)."""
        segments: list[tuple[object, int, int, int]] = []
        nsegs: list[int] = []
        refused: RecvJob | None = None
        for k, job in enumerate(jobs):
            if msgs[k * MSG_WORDS + 1] > job.length:
                refused = job
                break
            sges = job.sges
            if len(sges) == 1 and sges[0].length:
                s = sges[0]
                region = regions.get(s.lkey)
                off = s.addr - region.addr if region is not None else -1
                if region is None or off < 0 or off + s.length > region.length:
                    try:
                        region, off = locate(s.lkey, pd, s.addr, s.length, Access.LOCAL_WRITE)
                    except AccessViolation:
                        refused = job
                        break
                    regions[s.lkey] = region
                if token is not None:
                    job.checked = self._checked_in(token, region)
                    job.span = SPAN.pack(off, s.length)
                segments.append((region.handle or handle(region), region.length, off, s.length))
                nsegs.append(1)
            else:
                try:
                    spans = self._recv_spans(job)
                except AccessViolation:
                    refused = job
                    break
                for region, off, n in spans:
                    segments.append((region.handle or handle(region), region.length, off, n))
                nsegs.append(len(spans))
        else:
            k = len(jobs)
        if k < len(jobs):
            # Back to the queue, in order: the refused one goes to the general path.
            queue.extendleft(reversed(jobs[k + 1 if refused is not None else k :]))
            del jobs[k:]
        if jobs:
            kernels.place(sview, msgs, Targets(segments, nsegs))
        if jobs:
            self._complete_small_sends(jobs, msgs)
        if len(jobs) * MSG_WORDS == len(msgs):
            return stop
        fpdu = self._fpdu_at(msgs, len(jobs))
        if refused is not None:
            # The general path reports it (LOC_PROT_ERR or LOC_LEN_ERR, Terminate).
            self._start = fpdu + ddp.UNTAGGED_HDR_LEN
            hdr = ddp.parse_header(sview, fpdu, end)
            assert hdr is not None
            self._fit_send(self._open_send(refused, hdr), hdr, hdr.payload_len)
            raise AssertionError("a refused Send passed the general checks")
        return fpdu

    def _lone_send(self, sview: memoryview, msgs: Sequence[int]) -> bool:
        """Complete the one scanned Send ``msgs`` into the receive at the head of the
        queue when that has one non-empty SGE of a region that holds it (the ping-pong
        case, or the Send after an RDMA Write: no run's bookkeeping); False, nothing
        changed, otherwise (the run's general loop then takes it and reports what
        fails)."""
        queue = self.recv_queue
        if not queue:
            return False
        job = queue[0]
        sges = job.sges
        src, length, solicited = msgs[:MSG_WORDS]
        if len(sges) != 1 or length > job.length or not sges[0].length:
            return False
        s = sges[0]
        try:
            region, off = self.memory.locate(s.lkey, self.pd, s.addr, s.length, Access.LOCAL_WRITE)
        except AccessViolation:
            return False
        queue.popleft()
        region.view[off : off + length] = sview[src : src + length]
        self._complete_recv(job.wr_id, length, solicited == 1)
        return True

    def _place_checked(
        self, sview: memoryview, jobs: list[RecvJob], msgs: Sequence[int], token: object
    ) -> bool:
        """Place the scanned messages ``msgs`` into the receives ``jobs`` (one each) when
        every receive was checked under ``token`` and holds its message; False (nothing
        placed) when one was not (the general loop then checks them, and finds which
        fails)."""
        # (No object per receive here: a run of thousands made that many for the garbage
        # collector, 180 ns a message in send-rate's receiver.)
        checks = [job.checked for job in jobs]
        first = checks[0]
        kernels = self._kernels
        if first is not None and first[0] is token and checks.count(first) == len(checks):
            region = first[1]  # the usual: one region
            handle = region.handle or kernels.handle(region)
            try:
                kernels.place_in(sview, msgs, handle, b"".join(job.span for job in jobs))
            except ValueError:
                return False  # a Send longer than its receive: the general loop reports it
            return True
        if None in checks:
            return False
        tokens, regions = zip(*checks, strict=True)
        if tokens.count(token) != len(tokens):
            return False
        offs, lens = zip(*(SPAN.unpack(job.span) for job in jobs), strict=True)
        if any(
            m > n for m, n in zip(msgs[1 : len(jobs) * MSG_WORDS : MSG_WORDS], lens, strict=True)
        ):
            return False
        make_handle = kernels.handle
        segments = [
            (r.handle or make_handle(r), r.length, off, n)
            for r, off, n in zip(regions, offs, lens, strict=True)
        ]
        kernels.place(sview, msgs, Targets(segments, [1] * len(jobs)))
        return True

    def _checked_in(self, token: object, region: Region) -> tuple[object, Region]:
        """The (token, region) tuple every receive checked under ``token`` in ``region``
        shares; those of an older token are dropped when a new one comes (a region
        deregistered since is not kept)."""
        pairs = self._checked_pairs
        if self._pairs_token is not token:
            pairs.clear()
            self._pairs_token = token
        pair = pairs.get(region)
        if pair is None:
            pair = pairs[region] = (token, region)
        return pair

    def _complete_small_sends(self, jobs: list[RecvJob], msgs: Sequence[int]) -> None:
        """Complete the receives ``jobs`` with the first scanned messages of ``msgs``."""
        if len(jobs) == 1:  # a completion costs less than a run of one
            self._complete_recv(jobs[0].wr_id, msgs[1], msgs[2] == 1)
            return
        rx_msn = self._rx_msn
        rx_msn[QN.SEND] = (rx_msn[QN.SEND] + len(jobs)) & U32_MAX
        words = len(jobs) * MSG_WORDS
        solicited = msgs[2:words:MSG_WORDS]
        self.outbox.append(
            RecvRun(
                [job.wr_id for job in jobs], msgs[1:words:MSG_WORDS],
                [word == 1 for word in solicited] if any(solicited) else None, self.qp_num,
            )
        )  # fmt: skip

    def _complete_recv(self, wr_id: int, length: int, solicited: bool) -> None:
        """Complete one receive with the next Send (``length`` bytes) of the fast paths."""
        rx_msn = self._rx_msn
        rx_msn[QN.SEND] = (rx_msn[QN.SEND] + 1) & U32_MAX
        self.outbox.append(
            WC(
                wr_id,
                WCStatus.SUCCESS,
                WCOpcode.RECV,
                length,
                self.qp_num,
                WCFlags.NONE,
                0,
                0,
                solicited,
            )
        )

    @staticmethod
    def _fpdu_at(msgs: Sequence[int], k: int) -> int:
        """Where the FPDU of scanned message ``k`` starts."""
        return msgs[k * MSG_WORDS] - ddp.UNTAGGED_HDR_LEN

    def _tagged_run(self, sview: memoryview, start: int, end: int, ctrl: int) -> int:
        """Place the whole tagged FPDUs at ``sview[start:end]`` bound for one region;
        the new start.

        The fast path of :meth:`_process` for bulk data in FPDUs too small for direct
        placement (MSS-sized, as siw sends them): this resolves and checks the first
        FPDU's target once, a region of the PD with remote write access for an RDMA
        Write, the sink of the Read at the head of the ORQ for a Read Response; the
        kernels place the run of FPDUs with that STag inside it (Read Responses in
        order, up to the one that ends the Read, which completes here). The run ends
        before the first FPDU that is anything else or would fail a check: the
        general path then handles (and reports) it.
        """
        if self.state is not EngineState.RTS or self._rtr_pending:
            return start
        stag = int.from_bytes(sview[start + 4 : start + 8], "big")
        kernels = self._kernels
        if ctrl == ddp.CTRL_WRITE:
            region = self.memory.lookup(stag)
            if (
                region is None
                or region.pd is not self.pd
                or not region.rights & Access.REMOTE_WRITE
                or region.addr + region.length > TO_LIMIT
            ):
                return start
            target = region.handle or kernels.handle(region)
            stop, _, _ = kernels.place_tagged(
                sview, start, end, ctrl, stag, region.addr, target, 0, self.config.crc, False
            )
            return stop
        if not self._orq:
            return start
        job = self._orq[0]
        sink = job.sink
        if not job.length or sink is None or len(sink) != job.length or stag != job.sges[0].lkey:
            return start
        to = job.sges[0].addr + job.received
        stop, after, last = kernels.place_tagged(
            sview, start, end, ctrl, stag, to, sink, job.received, self.config.crc, True
        )
        job.received += after - to
        if last:
            self._read_done()
        return stop

    def _recv_spans(self, job: RecvJob) -> list[tuple[Region, int, int]]:
        """Region, offset and length of each piece of registered memory a receive's
        SGEs name (raises AccessViolation)."""
        locate = self.memory.locate
        pd = self.pd
        sges = job.sges
        if len(sges) == 1:  # the common case, without the comprehension
            s = sges[0]
            if s.length:
                return [(*locate(s.lkey, pd, s.addr, s.length, Access.LOCAL_WRITE), s.length)]
            return []
        return [
            (*locate(s.lkey, pd, s.addr, s.length, Access.LOCAL_WRITE), s.length)
            for s in sges
            if s.length
        ]

    def _recv_segments(self, job: RecvJob) -> list[memoryview]:
        """The registered memory a receive's SGEs name (raises AccessViolation)."""
        return [region.view[off : off + n] for region, off, n in self._recv_spans(job)]

    def _open_send(self, job: RecvJob, hdr: ddp.Header) -> RxMessage:
        """Start receiving a Send into ``job``; a receive naming bad memory is refused."""
        msg = RxMessage(job, [])
        self._rx_send = msg
        try:
            msg.segments = self._recv_segments(job)
        except AccessViolation as exc:
            msg.status = WCStatus.LOC_PROT_ERR
            raise ProtocolError(str(exc), DDP_CATASTROPHIC, header=hdr) from exc
        return msg

    def _fit_send(self, msg: RxMessage, hdr: ddp.Header, payload: int) -> None:
        """Refuse a Send segment that overflows the receive it is placed into."""
        if msg.received + payload > msg.job.length:
            # Linux siw (siw_qp_rx.c, siw_send_check_ntoh) reports "MSN: no buffer" here,
            # not RFC 5041's "message too long"; we send what siw sends.
            msg.status = WCStatus.LOC_LEN_ERR
            raise ProtocolError(
                f"Send of more than the {msg.job.length} bytes posted",
                ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER),
                header=hdr,
            )
