"""The checks of posted work requests (siw's post paths in ``siw_verbs.c``), apart
from the QP that posts them.

Receive requests become the engine's :class:`~.jobs.RecvJob` s (a batch's once per
entry); receive queues take them with ``post_recv``'s refusals. A send request is
worked out once into a :class:`SendTemplate` (its opcode, flags, wire limits, the
region of an inline SGE), kept by the QP while the request stays the same; a send
batch keeps its templates and, when its first entries all join one run of inline
Sends, a :class:`RunPlan` that copies their data with one kernel call.
"""

from __future__ import annotations

import errno
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, TypeVar

from rdmashim.providers.softiwarp import fastpath
from rdmashim.providers.softiwarp.ddp import U32_MAX
from rdmashim.providers.softiwarp.jobs import (
    RecvJob,
    SendRun,
)
from rdmashim.providers.softiwarp.memory import MemoryTable, Region
from rdmashim.verbs.enums import (
    SendFlags,
    WROpcode,
)
from rdmashim.verbs.errors import (
    VerbsError,
    refused_wr,
)
from rdmashim.verbs.wr import (
    SGE,
    InlineData,
    RecvBatch,
    RecvWR,
    SendWR,
    recv_problem,
    send_problem,
    wr_id_problem,
)

COPY_SEND_MAX = 8192
"""A Send (or Send with Invalidate) of one SGE of registered memory, without INLINE or
FENCE, of at most this many bytes is copied when posted and then goes as an inline one
does (framed in C with the Sends beside it, or written at once from ``post_send``):
cheaper than keeping its SGE for the framing later. Its region must be in the QP's PD,
else it takes the general path, which reports the error."""


_W = TypeVar("_W", SendWR, RecvWR)


def recv_job(w: RecvWR) -> RecvJob | None:
    """The engine's form of a receive (it only reads it: a batch posts one many times),
    or None when it cannot be posted (:func:`recv_problem` says why)."""
    sges = tuple(w.sg_list)
    if len(sges) == 1:  # (the common case, checked inline: a post of one costs 0.1 us less)
        s = sges[0]
        if (
            s.__class__ is SGE
            and 0 <= s.length <= U32_MAX
            and 0 <= s.lkey <= U32_MAX
            and 0 <= s.addr <= U64
            and 0 <= w.wr_id <= U64
        ):
            return RecvJob(w.wr_id, sges, s.length)
    if recv_problem(w):
        return None
    return RecvJob(w.wr_id, sges, sum(s.length for s in sges))


def recv_jobs(
    operation: str, wrs: Iterable[RecvWR], memory: MemoryTable
) -> tuple[list[RecvJob], VerbsError | None]:
    """The jobs of ``wrs`` up to the first that cannot be posted, and the error that
    one raises once those before it are posted (``bad_wr`` its index), if any."""
    jobs: list[RecvJob] = []
    for i, w in enumerate(wrs):
        job = recv_job(w)
        problem = recv_problem(w) if job is None else unregistered(job.sges, memory)
        if job is None or problem:
            return jobs, refused_wr(errno.EINVAL, operation, i, problem or "")
        jobs.append(job)
    return jobs, None


def unregistered(sges: Iterable[SGE], memory: MemoryTable) -> str | None:
    """Why a work request cannot be posted when one of its SGEs names no registered
    region (its MR closed, say), or None. (Whether the region holds the SGE, its PD
    and its rights are checked when the data moves, as on every backend.)"""
    for s in sges:
        if s.length and memory.lookup(s.lkey) is None:
            return f"{s}: lkey {s.lkey:#x} names no registered memory region (was its MR closed?)"
    return None


class RecvJobs(list[RecvJob]):
    """A receive batch's entries as engine jobs (:meth:`RecvBatch.prepared`)."""

    max_nsge = 0
    """The most SGEs an entry has had (a post within the limit skips the per-entry check)."""

    def __init__(self, n: int) -> None:
        super().__init__([None] * n)  # type: ignore[list-item]
        self.refused: dict[int, str] = {}
        """The entries that cannot be posted, and why (EINVAL when a post reaches them)."""

    def set(self, i: int, wr: RecvWR) -> None:
        job = recv_job(wr)
        if job is None:
            self.refused[i] = recv_problem(wr) or ""
            self[i] = RecvJob(0, (), 0)  # (never posted)
            return
        self.refused.pop(i, None)
        self[i] = job
        self.max_nsge = max(self.max_nsge, len(job.sges))


def queue_recvs(
    operation: str, queue: deque[RecvJob], jobs: Sequence[RecvJob], max_wr: int, max_sge: int,
    name: str, max_nsge: int | None = None,
    flush: Callable[[Sequence[RecvJob]], None] | None = None,
) -> None:  # fmt: skip
    """Queue receive jobs as ``post_recv`` posts a list (``bad_wr`` the first refused, the
    ones before it queued; ``name`` the queue's in the error); with ``flush`` (a QP in
    ERR) they are flushed instead. When no job has more than ``max_nsge`` SGEs (a batch
    or a single request knows) and all fit, one ``extend``."""
    if (
        flush is None
        and max_nsge is not None
        and max_nsge <= max_sge
        and len(queue) + len(jobs) <= max_wr
    ):
        queue.extend(jobs)
        return
    for i, job in enumerate(jobs):
        if len(job.sges) > max_sge:
            raise refused_wr(errno.EINVAL, operation, i, f"{len(job.sges)} SGEs > {max_sge}")
        if flush is not None:
            flush([job])
            continue
        if len(queue) >= max_wr:
            raise refused_wr(errno.ENOMEM, operation, i, f"{name} full ({max_wr})")
        queue.append(job)


def batch_jobs(
    batch: RecvBatch, operation: str, count: int | None, indices: Sequence[int] | None
) -> tuple[list[RecvJob], int, VerbsError | None]:
    """The jobs a receive batch post takes up to the first entry that cannot be posted,
    the most SGEs any of them may have, and the error that entry raises once those
    before it are posted (``bad_wr`` its position in the post), if any."""
    entries = batch.select(operation, count, indices)
    jobs = batch.prepared(RecvJob, RecvJobs)
    refused = jobs.refused
    if refused:
        for k, i in enumerate(entries):
            if i in refused:
                taken = list(map(jobs.__getitem__, entries[:k]))
                return taken, jobs.max_nsge, refused_wr(errno.EINVAL, operation, k, refused[i])
    if isinstance(entries, range):
        return jobs[: entries.stop], jobs.max_nsge, None
    return list(map(jobs.__getitem__, entries)), jobs.max_nsge, None


U64 = 0xFFFFFFFFFFFFFFFF


RUN_BYTES = 256 * 1024
"""A :class:`SendRun` takes no more entries once its FPDUs reach this many bytes."""


SUPPORTED_SEND = frozenset(
    {WROpcode.SEND, WROpcode.SEND_WITH_INV, WROpcode.RDMA_WRITE, WROpcode.RDMA_READ}
)


WIRE_LIMITS = (
    "length, rkey, invalidate_rkey or remote_addr + length do not fit the wire "
    "(32, 32, 32 and 64 bits)"
)


class InlineSGE:
    """An SGE of an inline send: the region it names is looked up once and kept while it
    stays registered (a deregistered one is looked up again, and refused if gone)."""

    __slots__ = ("end", "length", "offset", "region", "sge")

    def __init__(self, sge: SGE) -> None:
        self.sge = sge
        self.length = sge.length
        self.region: Region | None = None
        self.offset = self.end = 0

    def read(self, memory: MemoryTable, pd: object = None) -> bytes | None:
        """A copy of the bytes the SGE names now, or None if no region holds them (or,
        with ``pd``, the region is of another PD: a Send without INLINE reads only its
        QP's memory)."""
        region = self.region
        s = self.sge
        if region is None or not region.valid:
            region = self.region = memory.lookup(s.lkey)
            if region is None or not 0 <= s.addr - region.addr <= region.length - s.length:
                self.region = None
                return None
            self.offset = s.addr - region.addr
            self.end = self.offset + s.length
        if pd is not None and region.pd is not pd:
            return None
        return region.view[self.offset : self.end].tobytes()


def inline_bytes(i: int, part: InlineSGE | InlineData, memory: MemoryTable) -> bytes:
    """A copy of what one element of an inline send's ``sg_list`` holds now."""
    if isinstance(part, InlineSGE):
        data = part.read(memory)
        if data is None:
            raise refused_wr(
                errno.EINVAL, "post_send", i, f"inline SGE {part.sge} outside a region"
            )
        return data
    return bytes(part)


def fields_of(w: SendWR) -> tuple[object, ...] | None:
    """What a :class:`SendTemplate` is made of: the request's fields it reads, its SGEs by
    value (a named tuple each); None when its ``sg_list`` holds raw bytes (read at
    post time, and mutable: such a template is never reused)."""
    sges = tuple(w.sg_list)
    for s in sges:
        if s.__class__ is not SGE:
            return None
    return (w.opcode, w.send_flags, sges, w.remote_addr, w.rkey, w.invalidate_rkey)


TEMPLATES_KEPT = 1024
"""The most send templates, and receive jobs, a QP keeps for requests posted again (then
it starts over)."""


class KeptRecv(NamedTuple):
    """What a QP keeps of a receive request it posted alone, for a post of it again."""

    wr: RecvWR
    """The request (held: its id, the key, is no other object's while kept)."""
    job: RecvJob
    """Its job, posted again while the request's wr_id and SGEs are what it was made of."""
    token: object
    """The memory table's token for the QP's PD when its lkeys were found registered
    (:meth:`~.memory.MemoryTable.token`: it changes when a region is deregistered or
    invalidated)."""


class SendTemplate:
    """What a send work request means independently of the QP, worked out once.

    The checks ``post_send`` makes of a request alone (opcode, raw bytes without
    INLINE, the wire's field widths) are decided here and raised at post time in
    ``post_send``'s order, after the QP's SGE limit and queue depth.
    """

    __slots__ = (
        "copied",
        "flags",
        "inline",
        "invalid",
        "invalidate_rkey",
        "keys_fit",
        "length",
        "local",
        "made_of",
        "nsge",
        "opcode",
        "prior",
        "remote_addr",
        "rkey",
        "run_ctrl",
        "source",
        "unsupported",
    )  # fmt: skip

    def __init__(self, w: SendWR, made_of: tuple[object, ...] | None = None) -> None:
        opcode = w.opcode if w.opcode.__class__ is WROpcode else WROpcode(w.opcode)
        self.opcode = opcode
        self.made_of = made_of
        """What it was made of (:func:`fields_of`), when :meth:`QP._template` keeps it."""
        self.prior: SendTemplate | None = None
        """The template kept for the same request before this one (RDS's send slots
        alternate between flags, signaled or not: both are kept)."""
        self.unsupported = (
            None if opcode in SUPPORTED_SEND else f"{opcode.name} is not an iWARP operation"
        )
        self.invalid: str | None = send_problem(w)
        """Why a post of it fails (EINVAL), if it does whatever the QP."""
        self.flags = flags = int(w.send_flags)
        sges = w.sg_list
        self.nsge = len(sges)
        remote_addr, rkey, inv = self.remote_addr, self.rkey, _ = (
            w.remote_addr, w.rkey, w.invalidate_rkey,
        )  # fmt: skip
        self.keys_fit = keys_fit = 0 <= rkey <= U32_MAX and 0 <= inv <= U32_MAX and remote_addr >= 0
        self.invalidate_rkey = inv if opcode is WROpcode.SEND_WITH_INV else 0
        """What goes in the header's Invalidate STag field (zero but for a Send with
        Invalidate: RFC 5040 reserves it in other messages)."""
        self.local: tuple[SGE, ...] = ()
        self.length = 0
        self.source: InlineSGE | None = None
        """The one SGE of registered memory of an inline Send (the common case) or of a
        Send copied when posted (:data:`COPY_SEND_MAX`)."""
        self.copied = False
        """A Send without INLINE copied when posted: its region must be in the QP's PD."""
        runnable = (
            opcode in (WROpcode.SEND, WROpcode.SEND_WITH_INV)
            and not flags & SendFlags.FENCE
            and keys_fit
        )
        self.run_ctrl = 0
        """An inline or copied Send without FENCE joins a :class:`SendRun` if its data fit
        one FPDU: its control byte there (0: it does not)."""
        self.inline: tuple[InlineSGE | InlineData, ...] | None = None
        if self.invalid:
            return
        if flags & SendFlags.INLINE and opcode is not WROpcode.RDMA_READ:
            if len(sges) == 1 and sges[0].__class__ is SGE:
                self.source = source = InlineSGE(sges[0])
                self.inline = (source,)
            else:
                self.inline = tuple(InlineSGE(s) if isinstance(s, SGE) else s for s in sges)
            if runnable:
                self.run_ctrl = SendRun.ctrl(flags, opcode is WROpcode.SEND_WITH_INV)
            return
        local = tuple(s for s in sges if isinstance(s, SGE))
        if len(local) != len(sges):
            self.invalid = "raw bytes need INLINE"
            return
        self.local = local
        self.length = length = sum(s.length for s in local)
        if not (length <= U32_MAX and keys_fit and remote_addr <= U64 + 1 - length):
            self.invalid = WIRE_LIMITS
        elif runnable and len(local) == 1 and 0 < length <= COPY_SEND_MAX:
            self.source = InlineSGE(local[0])
            self.copied = True
            self.run_ctrl = SendRun.ctrl(flags, opcode is WROpcode.SEND_WITH_INV)


class RunPlan:
    """What a post of a batch's first entries needs when they all join one
    :class:`SendRun`: inline Sends without FENCE, each with one SGE whose region was
    found, worked out once. A post checks that those regions are still registered and
    the QP's limits, copies the data and makes the run, with no per-entry checks."""

    __slots__ = (
        "ctrls", "data", "ids", "invs", "kernels", "lens", "longest", "longest_inline", "pd",
        "regions", "signaled", "size",
    )  # fmt: skip

    def __init__(self, templates: Sequence[SendTemplate]) -> None:
        self.ctrls = bytes(t.run_ctrl for t in templates)
        self.invs = array("I", [t.invalidate_rkey for t in templates])
        self.signaled = [i for i, t in enumerate(templates) if t.flags & SendFlags.SIGNALED]
        """The indices of the entries with SIGNALED."""
        sources: list[InlineSGE] = [t.source for t in templates]  # type: ignore[misc]
        regions: list[Region] = [s.region for s in sources]  # type: ignore[misc]
        self.lens = array("I", [s.length for s in sources])
        self.kernels = kernels = fastpath.kernels()
        self.data = kernels.send_plan(regions, [s.offset for s in sources], self.lens)
        """What the kernels copy the entries' data by."""
        self.regions = list({id(r): r for r in regions}.values())
        """The regions the data come from (each still registered, or the plan is void)."""
        self.longest = max(self.lens)
        self.longest_inline = max(
            (n for n, t in zip(self.lens, templates, strict=True) if not t.copied), default=0
        )
        """The longest entry with INLINE (the QP's ``max_inline_data`` bounds those)."""
        pds = [r.pd for r, t in zip(regions, templates, strict=True) if t.copied]
        self.pd: object = pds[0] if pds else None
        """The PD of the copied entries' regions (:meth:`possible`: one), None if none."""
        self.size = sum(map(SendRun.fpdu_bytes, self.lens))
        self.ids: tuple[list[int], list[int]] | None = None
        """The entries' wr_ids and those of the SIGNALED ones, taken at the first post
        (a run only reads them)."""

    @staticmethod
    def possible(templates: Sequence[SendTemplate]) -> bool | None:
        """Whether these entries may be posted by a plan: never (False: fewer than two,
        or one would not join a run), not now (None: a region not found yet, or gone),
        or yes."""
        if len(templates) < 2:
            return False
        lengths = 0
        for t in templates:
            src = t.source
            if not t.run_ctrl or src is None or t.remote_addr > U64 + 1 - src.length:
                return False
            lengths += SendRun.fpdu_bytes(src.length)
        if lengths > RUN_BYTES:  # not one run, as the general path makes them
            return False
        found = all(t.source.region is not None and t.source.region.valid for t in templates)  # type: ignore[union-attr]
        if found and len({id(t.source.region.pd) for t in templates if t.copied}) > 1:  # type: ignore[union-attr]
            return False  # copied entries of two PDs: a QP has one, the general path reports
        return True if found else None

    def run(self, wrs: Sequence[SendWR]) -> SendRun:
        """The run of ``wrs`` (the entries the plan was made of), their data copied now."""
        ids = self.ids
        if ids is None:  # a batch's entries change only through it, which voids the plan
            wr_ids = [w.wr_id for w in wrs]
            ids = self.ids = (wr_ids, [wr_ids[i] for i in self.signaled])
        data = self.kernels.gather(self.data)
        return SendRun.of(data, self.lens, self.ctrls, self.invs, *ids, self.size)


class SendTemplates(list[SendTemplate]):
    """A send batch's entries as templates, for one context's memory table."""

    def __init__(self, n: int, memory: MemoryTable) -> None:
        super().__init__([None] * n)  # type: ignore[list-item]
        self.memory = memory
        """The table the inline SGEs' regions are looked up in (the templates cache them)."""
        self._plans: dict[int, RunPlan | None] = {}
        """By how many first entries a post takes: their plan, or None if they can have
        none (until an entry is set again)."""

    def set(self, i: int, wr: SendWR) -> None:
        self[i] = t = SendTemplate(wr)
        bad_id = wr_id_problem(wr.wr_id)  # (an entry changes only through here)
        if bad_id and not t.invalid:
            t.invalid, t.inline, t.source, t.run_ctrl = bad_id, None, None, 0
        self._plans.clear()

    def plan(self, count: int) -> RunPlan | None:
        """The plan of the first ``count`` entries while its regions stay registered
        (made again once one is gone or was not found yet: the general path looks the
        SGEs up again)."""
        if count in self._plans:
            plan = self._plans[count]
            if plan is None or all(r.valid for r in plan.regions):
                return plan
        entries = self[:count]
        possible = RunPlan.possible(entries)
        if possible is None:
            return None
        plan = self._plans[count] = RunPlan(entries) if possible else None
        return plan
