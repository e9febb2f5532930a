"""Transmitting (siw's ``siw_qp_tx.c``): the send queue, framed into FPDUs.

:meth:`Transmitter.post_send` queues a job (or a run of inline Sends);
:meth:`Transmitter.produce` returns the buffers of the next FPDUs: a Terminate
first, control FPDUs (the RTR), then Read Responses from the IRQ between
messages, then the send queue in order (runs of small Sends framed by one kernel
call, Writes and Read Responses a step of tagged FPDUs at a time, Sends in
segments, Read Requests onto the ORQ), holding a FENCEd request while Reads are
outstanding and Reads beyond ORD. :meth:`Transmitter.sent` completes what went
out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import QN, U32_MAX, Opcode
from rdmashim.providers.softiwarp.jobs import (
    FENCE,
    Chunk,
    EngineState,
    SendJob,
    SendRun,
    check_wire_fields,
    slice_segments,
)
from rdmashim.providers.softiwarp.memory import AccessViolation
from rdmashim.providers.softiwarp.qp_state import QPEngineState
from rdmashim.verbs.enums import Access, WCStatus, WROpcode
from rdmashim.verbs.wr import SGE

PRODUCE_MAX = 1024 * 1024
"""Bytes of FPDUs one :meth:`Engine.produce` returns at most (one more step of a message
may pass it). Measured: the compiled tagged framing's buffers of 4 MiB in flight cost
31 us per 64 KiB step in page faults (the allocator hands memory back and takes it
again), 1 MiB 6.6 us."""
TAGGED_STEP = 1024 * 1024
"""Payload bytes of tagged FPDUs framed per kernel call (at least one FPDU's). Measured
(write-bw, 1 MiB Writes): 64 KiB steps, one 64 KB FPDU per call, left the sender bound
by Python per FPDU (0.84 of raw TCP); 1 MiB steps 0.91-1.0."""


class Transmitter(QPEngineState):
    """The engine's transmit side (see the module docstring)."""

    def post_send(self, job: SendJob | SendRun) -> None:
        """Queue a send work request, or a run of them (already checked against the QP's
        limits)."""
        state = self.state
        if state is EngineState.ERROR or state is EngineState.TERMINATE:
            self._complete_send(job, WCStatus.WR_FLUSH_ERR)
            return
        self.sq_depth += len(job) if isinstance(job, SendRun) else 1
        self._sq.append(job)

    @property
    def tx_ready(self) -> bool:
        """Whether :meth:`produce` has something to send now."""
        if self._terminate is not None or self._control:
            return True
        if self.state is not EngineState.RTS or self._rtr_pending:
            return False
        if self._current is not None or self._irq:
            return True
        return bool(self._sq) and self._sq_head_may_start()

    def _sq_head_may_start(self) -> bool:
        head = self._sq[0]
        if head.flags & FENCE and self._orq:
            return False
        return not (head.opcode is WROpcode.RDMA_READ and len(self._orq) >= self.config.ord)

    def produce(self, max_bytes: int = PRODUCE_MAX, max_buffers: int = 512) -> list[Chunk]:
        """Buffers of the next FPDUs to send (empty when there is nothing to send)."""
        if self._terminate is not None:
            return self._take_terminate()
        out, self._control = self._control, []
        if self.state is not EngineState.RTS or self._rtr_pending:
            return out
        sq = self._sq
        if self._current is None and not self._irq:
            if not sq:
                return out  # (the call after a burst went out, usually)
            if len(sq) == 1 and not out:
                fpdu = self._frame_lone_send(sq[0])
                if fpdu is not None:
                    return [fpdu]
        size = 0
        while size < max_bytes and len(out) < max_buffers:
            if self._current is None and self._sq and not self._irq:
                size += self._small_send_fpdus(out, max_bytes - size)
                if size >= max_bytes:
                    break  # (a SendRun left at the head must not reach _start_next)
            if self._current is None and not self._start_next():
                break
            try:
                fpdus, last, nbytes = next(self._current)  # type: ignore[arg-type]
            except AccessViolation as exc:
                self._local_error(exc)
                return out + self._take_terminate()
            except Exception as exc:  # a bug of ours must not take the process down
                self._internal_error(exc)
                return out + self._take_terminate()
            if last:
                if self._current_job is not None:
                    self._burst_done.append(self._current_job)
                else:
                    self._responding -= 1
                self._current = None
                self._current_job = None
            out.extend(fpdus)
            size += nbytes
        return out

    def _frame_lone_send(self, job: SendJob | SendRun) -> bytes | None:
        """The FPDU of ``job``, the only work to send, when it is a Send (or Send with
        Invalidate) of inline data that fits one FPDU: framed by the codec into one
        buffer, with none of a run's lists or a kernel call (a ping-pong's post). None,
        nothing changed, for anything else (:meth:`produce`'s loop takes it)."""
        if isinstance(job, SendRun):
            return None
        inline = job.inline
        op = job.opcode
        if (
            inline is None
            or (op is not WROpcode.SEND and op is not WROpcode.SEND_WITH_INV)
            or len(inline) != job.length
            or job.length > self.small_send_max
            or (job.flags & FENCE and self._orq)
        ):
            return None
        try:
            check_wire_fields(job)
        except AccessViolation:
            return None  # the loop reports it
        self._sq.popleft()
        self._sq_order.append(job)
        self._burst_done.append(job)
        msns = self._tx_msn
        msn = msns[QN.SEND] = (msns[QN.SEND] + 1) & U32_MAX
        invalidate = op is WROpcode.SEND_WITH_INV
        ctrl = SendRun.ctrl(job.flags, invalidate)
        inv = job.invalidate_rkey if invalidate else 0
        return ddp.encode_send(inline, ctrl, inv, msn, self.config.crc)

    def _seal(self, fpdu: list[Chunk]) -> int:
        """Append PAD and CRC field to an FPDU's header and payload pieces; its bytes."""
        header = fpdu[0]
        ulpdu_len = (header[0] << 8) | header[1]
        pad = ddp.pad_len(ulpdu_len)
        if self.config.crc:
            crc32c = self._kernels.crc32c
            value = 0
            for part in fpdu:
                value = crc32c(part, value)
            if pad:
                value = crc32c(ddp.ZERO_PAD[pad], value)
            fpdu.append(ddp.ZERO_PAD[pad] + value.to_bytes(4, "little"))
        else:
            fpdu.append(bytes(pad + 4))
        return ddp.fpdu_len(ulpdu_len)

    def _small_send_fpdus(self, out: list[Chunk], budget: int) -> int:
        """Frame the inline Sends at the head of the send queue that fit one FPDU each.

        The fast path of :meth:`produce`: this picks the work requests; the kernels
        frame them all (header, payload, PAD, CRC) into one buffer appended to
        ``out``. Returns the bytes added. It stops at the first work request that is
        anything else (the general path then takes it).
        """
        sq = self._sq
        send, send_inv = WROpcode.SEND, WROpcode.SEND_WITH_INV
        op = sq[0].opcode
        if op is not send and op is not send_inv:
            return 0  # (an RDMA operation; a SendRun's opcode is SEND)
        orq = self._orq
        order = self._sq_order
        burst = self._burst_done
        most = self.small_send_max
        chunks: list[Chunk] = []
        lens: list[int] = []
        ctrls = bytearray()
        invs: list[int] = []
        size = 0
        run: SendRun | None = None  # the run taken, when it is all (framed from its arrays)
        while sq and size < budget:
            job = sq[0]
            if isinstance(job, SendRun):  # taken whole (its size is bounded at post time)
                sq.popleft()
                order.append(job)
                burst.append(job)
                run = None if lens else job
                chunks += job.chunks
                lens += job.lens
                ctrls += job.ctrls
                invs += job.invs
                size += job.size
                continue
            inline = job.inline
            op = job.opcode
            if (
                inline is None
                or (op is not send and op is not send_inv)
                or len(inline) != job.length
                or job.length > most
                or (job.flags & FENCE and orq)
            ):
                break
            try:
                check_wire_fields(job)
            except AccessViolation:
                break  # the general path reports it
            sq.popleft()
            order.append(job)
            burst.append(job)
            run = None
            chunks.append(inline)
            lens.append(len(inline))
            ctrls.append(SendRun.ctrl(job.flags, op is send_inv))
            invs.append(job.invalidate_rkey if op is send_inv else 0)
            size += SendRun.fpdu_bytes(len(inline))
        if lens:
            msns = self._tx_msn
            msn = msns[QN.SEND]
            msns[QN.SEND] = (msn + len(lens)) & U32_MAX
            data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if run is not None:  # its arrays go to the kernels as they are
                lens, ctrls, invs = run.lens, run.ctrls, run.invs  # type: ignore[assignment]
            out.append(
                self._kernels.frame_sends(
                    data, lens, ctrls, invs, (msn + 1) & U32_MAX, self.config.crc
                )
            )
        return size

    def sent(self, nbytes: int) -> None:
        """The driver handed every buffer of the last :meth:`produce` to TCP."""
        self.bytes_sent += nbytes
        done, self._burst_done = self._burst_done, []
        read = WROpcode.RDMA_READ
        for job in done:
            if job.opcode is not read:
                job.done = True
        self._drain_sq_order()

    def _start_next(self) -> bool:
        if self._irq:
            resp = self._irq.popleft()
            self._current = self._tagged_fpdus(
                Opcode.READ_RESPONSE, resp.sink_stag, resp.sink_to, [resp.source]
            )
            self._current_job = None
            self._current_stags = (resp.src_stag,)
            return True
        if not self._sq or not self._sq_head_may_start():
            return False
        job = self._sq.popleft()
        assert isinstance(job, SendJob)  # produce() frames a run at the head itself
        self._sq_order.append(job)
        self._current_job = job
        self._current = self._job_fpdus(job)
        self._current_stags = () if job.inline is not None else tuple(s.lkey for s in job.sges)
        return True

    def _local_segments(self, job: SendJob) -> list[memoryview]:
        if job.inline is not None:
            return [memoryview(job.inline)]
        resolve = self.memory.resolve
        return [
            resolve(s.lkey, self.pd, s.addr, s.length, Access.NONE) for s in job.sges if s.length
        ]

    def _job_fpdus(self, job: SendJob) -> Iterator[tuple[list[Chunk], bool, int]]:
        op = job.opcode
        check_wire_fields(job)
        if op is WROpcode.RDMA_READ:
            sge = job.sges[0] if job.sges else SGE(0, 0, 0)
            if job.length:
                job.sink = self.memory.resolve(
                    sge.lkey, self.pd, sge.addr, sge.length, Access.LOCAL_WRITE
                )
            else:
                job.sink = memoryview(b"")
            job.msn = self._tx_msn[QN.READ_REQUEST] = (self._tx_msn[QN.READ_REQUEST] + 1) & U32_MAX
            self._orq.append(job)
            hdr = ddp.encode_read_request(
                self._tx_msn[QN.READ_REQUEST], sge.lkey, sge.addr, job.length,
                job.rkey, job.remote_addr,
            )  # fmt: skip
            request: list[Chunk] = [hdr]
            yield request, True, self._seal(request)
            return
        segments = self._local_segments(job)
        if op is WROpcode.RDMA_WRITE:
            yield from self._tagged_fpdus(Opcode.WRITE, job.rkey, job.remote_addr, segments)
            return
        msn = self._tx_msn[QN.SEND] = (self._tx_msn[QN.SEND] + 1) & U32_MAX
        chunk = self.small_send_max
        total = job.length
        mo = 0
        ctrl = SendRun.ctrl(job.flags, op is WROpcode.SEND_WITH_INV)
        inv = job.invalidate_rkey if op is WROpcode.SEND_WITH_INV else 0  # else reserved: 0
        while True:
            n = min(chunk, total - mo)
            last = mo + n == total
            ddp_ctrl = ddp.DDP_VERSION | (ddp.DDP_LAST if last else 0)
            header = ddp.UNTAGGED.pack(
                ddp.UNTAGGED_HDR_LEN - 2 + n, ddp_ctrl, ctrl, inv, QN.SEND, msn, mo
            )
            fpdu: list[Chunk] = [header]
            fpdu += slice_segments(segments, mo, n)
            yield fpdu, last, self._seal(fpdu)
            mo += n
            if last:
                return

    def _tagged_fpdus(
        self, opcode: Opcode, stag: int, to: int, segments: Sequence[memoryview]
    ) -> Iterator[tuple[list[Chunk], bool, int]]:
        """The FPDUs of a Write or Read Response, framed by the kernels a step of
        ``TAGGED_STEP`` payload bytes at a time (a step that spans SGEs is joined)."""
        chunk = self._tagged_max
        step = max(chunk, TAGGED_STEP // chunk * chunk)
        total = sum(len(s) for s in segments)
        frame = self._kernels.frame_tagged
        crc = self.config.crc
        ctrl = opcode | ddp.RDMAP_VERSION
        off = 0
        while True:
            n = min(step, total - off)
            last = off + n == total
            pieces = slice_segments(segments, off, n) if segments else []
            src = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            fpdus = frame(src, ctrl, stag, to + off, chunk, last, crc)
            yield fpdus, last, sum(map(len, fpdus))
            off += n
            if last:
                return
