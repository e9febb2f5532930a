"""The RDMA operations one RDS-over-RDMA session posts ahead of the messages that carry
them (RDS's RDMA by cookie, :mod:`.rdma`): their numbering, their entries in the
session's prepared batch, and which of them are done.

Operation number ``n`` takes batch entry ``first + n % RDMA_DEPTH`` and that entry's
work request id, ``RDMA_WR + n % RDMA_DEPTH``, so an entry posted again with the fields
it had is one the engine packed already (rds stress ``-D`` writes into the same few
buffers again and again). A Write is posted unsignaled (as Linux posts one without
``RDS_RDMA_NOTIFY_ME``): it is done when a Send posted after it completes, and its
operation when the peer acknowledges the message (a failed one still completes, with
its error); a Read is signaled, and done (its data here) when it completes.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from rdmashim.ulps.rds.rdma import RdmaOp, RdmaStatus, status_of
from rdmashim.verbs import SendBatch, SendFlags, WCStatus, WROpcode

if TYPE_CHECKING:
    from rdmashim.ulps.rds.connection import Counters

RDMA_DEPTH = 16
"""RDMA operations a session keeps in flight (beside its send slots on the send queue)."""
RDMA_WR = 1 << 32
"""Work request ids at and above this are RDMA operations; below, send slots."""
_UNSIGNALED = SendFlags(0)


class RdmaPosts:
    """A session's RDMA operations: posted into entries ``first..first+RDMA_DEPTH-1`` of
    its batch, in flight by work request id (:attr:`inflight`), done as their
    completions, or the Sends after them, say."""

    def __init__(self, sends: SendBatch, first: int, slots: int, counters: Counters) -> None:
        self._sends, self._first, self._counters = sends, first, counters
        self.inflight: dict[int, RdmaOp] = {}
        """RDMA operations in flight, by work request id."""
        self.next = RDMA_WR
        """The number of the next operation (they are numbered in posting order)."""
        self._shapes: list[tuple[object, ...] | None] = [None] * RDMA_DEPTH
        """What each entry holds (region, cookie, offset, write): set again only when
        that changes."""
        self.writes: deque[tuple[int, RdmaOp]] = deque()
        """The Writes in :attr:`inflight` and their numbers, in posting order."""
        self.reads = 0
        """The Reads in :attr:`inflight`."""
        self.marks = [RDMA_WR] * slots
        """For each send slot, :attr:`next` when its Send was last posted: the operations
        numbered below it went before that Send."""

    def post(self, op: RdmaOp, entries: list[int]) -> None:
        """Add ``op``'s Write or Read to ``entries`` (the batch entries a post takes)."""
        n = self.next
        self.next = n + 1
        k = n % RDMA_DEPTH
        wr_id = RDMA_WR + k
        self.inflight[wr_id] = op
        mr = op._mr
        assert mr is not None  # registered when the message was queued (_begin)
        write = op.write
        if write:
            self.writes.append((n, op))
        else:
            self.reads += 1
        shape = (mr, op.cookie, op.remote_offset, write)
        if self._shapes[k] != shape:  # else the entry stays as packed
            self._shapes[k] = shape
            if write:
                opcode, flags = WROpcode.RDMA_WRITE, _UNSIGNALED
            else:  # the data is here when the Read completes
                opcode, flags = WROpcode.RDMA_READ, SendFlags.SIGNALED
            self._sends.set(
                self._first + k, wr_id=wr_id, opcode=opcode, sg_list=[mr.sge()],
                send_flags=flags, remote_addr=op.remote_addr, rkey=op.rkey,
            )  # fmt: skip
        entries.append(self._first + k)
        counters = self._counters
        counters.rdma_bytes += op.length
        if write:
            counters.rdma_writes += 1
        else:
            counters.rdma_reads += 1

    def writes_done(self, slot: int) -> None:
        """The Send of ``slot`` completed: so did the Writes posted before it."""
        writes, mark, inflight = self.writes, self.marks[slot], self.inflight
        while writes and writes[0][0] < mark:
            n, op = writes.popleft()
            wr_id = RDMA_WR + n % RDMA_DEPTH
            if inflight.get(wr_id) is op:  # (else a failed one was taken already)
                del inflight[wr_id]

    def done(self, wr_id: int, status: WCStatus) -> None:
        """The completion of operation ``wr_id`` (a Read's, or a failure's)."""
        op = self.inflight.pop(wr_id)
        if not op.write:
            self.reads -= 1
        if status == WCStatus.SUCCESS:
            if not op.write:  # the data is here; a Write is done when the peer acks
                op._finish(RdmaStatus.SUCCESS)
        elif status != WCStatus.WR_FLUSH_ERR:
            self._counters.rdma_failures += 1
            op._finish(status_of(status), status.name)
