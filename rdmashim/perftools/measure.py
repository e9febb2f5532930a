"""The measurement loops of the six tools, on a connected :class:`~.session.Resources`.

Each loop posts work as perftest does on the wire (so a perftest peer can be
the other side) and returns timestamps (``time.perf_counter_ns``) for
:mod:`rdmashim.perftools.report`:

* bandwidth (client): Writes, Reads or Sends, ``tx_depth`` outstanding per QP,
  every ``cq_mod``-th signalled; ``send_bw`` also keeps within the receiver's
  credits (iWARP has no RNR retry: a Send without a posted receive is fatal);
* ``send_bw`` server: receives, re-posted while more are due, and a credit
  (its count of receives) RDMA-written back every ``rx_depth // 3`` of them;
* ``write_lat``: ping-pong by RDMA Write, each side watching the last byte
  of its receive half for the peer's counter (the server writes first);
* ``read_lat``: one RDMA Read at a time; ``send_lat``: Send ping-pong, the
  client first.

Waiting on memory (credits, ``write_lat``) yields to trio between looks, so
the built-in engine, which runs in the same trio loop, makes progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import trio.lowlevel

from rdmashim import RecvWR, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.perftools import wire
from rdmashim.perftools.options import PerfConfig
from rdmashim.perftools.session import Resources, completion_error

Progress = Callable[[int], object]
"""Called with the number of messages just completed (for a progress bar)."""

_OPCODES = {"write": WROpcode.RDMA_WRITE, "read": WROpcode.RDMA_READ, "send": WROpcode.SEND}
_QP_BITS = 8


@dataclass
class Stamps:
    """What a loop measured."""

    posted: list[int] = field(default_factory=list)
    completed: list[tuple[int, int]] = field(default_factory=list)
    """``(message index, time)`` of each signalled completion."""
    start: int = 0
    end: int = 0
    count: int = 0


def _deadline(config: PerfConfig) -> float:
    return time.monotonic() + config.duration if config.duration else float("inf")


def _check(res: Resources, wcs: list, what: str) -> None:  # type: ignore[type-arg]
    for wc in wcs:
        if wc.status != WCStatus.SUCCESS:
            link = res.links[wc.wr_id & ((1 << _QP_BITS) - 1)] if res.links else None
            error = link.cm_id.qp.error if link and link.cm_id.qp else None
            raise completion_error(wc, what, error)


async def bw_client(res: Resources, size: int, progress: Progress | None = None) -> Stamps:
    """Post ``iters`` (or ``-D`` seconds of) Writes/Reads/Sends on every QP; time them."""
    config = res.config
    assert res.send_cq is not None
    opcode = _OPCODES[config.verb]
    links = res.links
    iters = config.iters if config.duration is None else None
    deadline = _deadline(config)
    scnt = [0] * len(links)
    ccnt = [0] * len(links)
    stamps = Stamps()
    credit = config.tool == "send_bw"
    what = f"{config.tool} {size} B"
    per_qp: dict[int, int] = {}
    stopping = False
    while True:
        for link in links:
            q = link.index
            while (iters is None or scnt[q] < iters) and scnt[q] - ccnt[q] + 1 <= config.tx_depth:
                if stopping and scnt[q] % config.cq_mod == 0:
                    break
                if credit:
                    assert link.credit_mr is not None
                    granted = wire.CREDIT.unpack_from(link.credit_mr.buf, 4 * (config.num_qps + q))[
                        0
                    ]
                    if scnt[q] + 1 - granted >= config.rx_depth:
                        break
                k = scnt[q]
                last = iters is not None and k == iters - 1
                signal = (k + 1) % config.cq_mod == 0 or last
                n = len(stamps.posted)
                wr_id = (n << _QP_BITS) | q
                if signal:
                    per_qp[wr_id] = k + 1
                assert link.mr is not None
                sge = link.mr.sge(0, size)
                stamps.posted.append(time.perf_counter_ns())
                link.cm_id.qp.post_send(  # type: ignore[union-attr]
                    SendWR(
                        wr_id, opcode, [sge], SendFlags.SIGNALED if signal else SendFlags.NONE,
                        link.theirs.vaddr if opcode != WROpcode.SEND else 0,
                        link.theirs.rkey if opcode != WROpcode.SEND else 0,
                    )
                )  # fmt: skip
                scnt[q] += 1
        if not stopping and time.monotonic() >= deadline:
            stopping = True
        outstanding = any(c < s for c, s in zip(ccnt, scnt, strict=True))
        all_posted = iters is not None and all(s >= iters for s in scnt)
        if (all_posted or stopping) and not outstanding:
            break
        wcs = res.send_cq.poll(64)
        if not wcs:
            if not per_qp:  # nothing signalled out: waiting for credits, which raise no completion
                if stopping:  # -D is over: the unsignalled tail needs no credit the peer
                    break  # may have stopped granting (its own clock ended its run)
                await trio.lowlevel.checkpoint()
                continue
            wcs = await res.send_cq.poll_wait(64)
        _check(res, wcs, what)
        now = time.perf_counter_ns()
        for wc in wcs:
            q = wc.wr_id & ((1 << _QP_BITS) - 1)
            done = per_qp.pop(wc.wr_id)
            if progress is not None:
                progress(done - ccnt[q])
            ccnt[q] = done
            stamps.completed.append((wc.wr_id >> _QP_BITS, now))
    stamps.posted = stamps.posted[: max((n for n, _ in stamps.completed), default=-1) + 1]
    return stamps


def post_receives(res: Resources, size: int, count: int) -> None:
    """``count`` receives of ``size`` bytes into each QP's receive half."""
    for link in res.links:
        assert link.mr is not None
        sge = link.mr.sge(res.buffer_size, size)
        for _ in range(count):
            link.cm_id.qp.post_recv(RecvWR(link.index, [sge]))  # type: ignore[union-attr]


async def send_bw_server(res: Resources, size: int, progress: Progress | None = None) -> Stamps:
    """Receive the client's Sends (receives already posted), granting credits."""
    config = res.config
    assert res.recv_cq is not None and res.send_cq is not None
    iters = config.iters if config.duration is None else None
    rcnt = [0] * len(res.links)
    posted = [config.rx_depth] * len(res.links)
    every = max(1, config.rx_depth // 3)
    stamps = Stamps()
    deadline = float("inf")
    credits_out = 0
    total = None if iters is None else iters * len(res.links)
    while total is None or stamps.count < total:
        if total is None:
            with trio.move_on_at(trio.current_time() + max(0.0, deadline - time.monotonic())):
                wcs = await res.recv_cq.poll_wait(64)
            if time.monotonic() >= deadline:
                break
        else:
            wcs = await res.recv_cq.poll_wait(64)
        _check(res, wcs, f"send_bw {size} B (receiving)")
        now = time.perf_counter_ns()
        if not stamps.start and wcs:
            stamps.start = now
            if config.duration:
                deadline = time.monotonic() + config.duration
        for wc in wcs:
            q = wc.wr_id
            link = res.links[q]
            rcnt[q] += 1
            stamps.count += 1
            stamps.end = now
            if iters is None or posted[q] < iters:
                post_receives_one(res, link.index, size)
                posted[q] += 1
            if (rcnt[q] % config.rx_depth) % every == 0:
                assert link.credit_mr is not None
                wire.CREDIT.pack_into(link.credit_mr.buf, 4 * q, rcnt[q] & 0xFFFFFFFF)
                while credits_out >= config.tx_depth:
                    done = await res.send_cq.poll_wait(64)
                    _check(res, done, "send_bw credit")
                    credits_out -= len(done)
                link.cm_id.qp.post_send(  # type: ignore[union-attr]
                    SendWR(
                        q, WROpcode.RDMA_WRITE, [link.credit_mr.sge(4 * q, 4)], SendFlags.SIGNALED,
                        link.theirs.vaddr, link.theirs.rkey,
                    )
                )  # fmt: skip
                credits_out += 1
        if progress is not None:
            progress(len(wcs))
    while credits_out:
        done = await res.send_cq.poll_wait(64)
        _check(res, done, "send_bw credit")
        credits_out -= len(done)
    return stamps


def post_receives_one(res: Resources, q: int, size: int) -> None:
    link = res.links[q]
    assert link.mr is not None
    link.cm_id.qp.post_recv(RecvWR(q, [link.mr.sge(res.buffer_size, size)]))  # type: ignore[union-attr]


async def _one_send(res: Resources, wr: SendWR, what: str) -> None:
    """Post ``wr`` (signalled) on the first QP and wait for its completion."""
    assert res.send_cq is not None
    res.links[0].cm_id.qp.post_send(wr)  # type: ignore[union-attr]
    while True:
        wcs = await res.send_cq.poll_wait(1)
        _check(res, wcs, what)
        if wcs:
            return


async def write_lat(res: Resources, size: int, progress: Progress | None = None) -> Stamps:
    """RDMA Write ping-pong: the peer's counter appears in our receive half's byte ``size - 1``."""
    config = res.config
    link = res.links[0]
    assert link.mr is not None
    buf = link.mr.buf
    post_at, poll_at = size - 1, res.buffer_size + size - 1
    iters = config.iters if config.duration is None else None
    deadline = _deadline(config)
    scnt = rcnt = 0
    stamps = Stamps()
    what = f"write_lat {size} B"
    while iters is None or scnt < iters or rcnt < iters:
        if time.monotonic() >= deadline:
            break
        if (iters is None or rcnt < iters) and not (scnt < 1 and res.config.server):
            rcnt += 1
            while buf[poll_at] != rcnt & 0xFF:
                if time.monotonic() >= deadline:
                    break
                await trio.lowlevel.checkpoint()
        if iters is None or scnt < iters:
            scnt += 1
            stamps.posted.append(time.perf_counter_ns())
            buf[post_at] = scnt & 0xFF
            wr = SendWR(scnt, WROpcode.RDMA_WRITE, [link.mr.sge(0, size)], SendFlags.SIGNALED,
                        link.theirs.vaddr, link.theirs.rkey)  # fmt: skip
            await _one_send(res, wr, what)
            if progress is not None:
                progress(1)
    stamps.count = scnt
    return stamps


async def read_lat(res: Resources, size: int, progress: Progress | None = None) -> Stamps:
    """One RDMA Read at a time from the server's buffer."""
    config = res.config
    link = res.links[0]
    assert link.mr is not None
    deadline = _deadline(config)
    stamps = Stamps()
    n = 0
    while (config.duration is not None or n < config.iters) and time.monotonic() < deadline:
        stamps.posted.append(time.perf_counter_ns())
        wr = SendWR(n, WROpcode.RDMA_READ, [link.mr.sge(0, size)], SendFlags.SIGNALED,
                    link.theirs.vaddr, link.theirs.rkey)  # fmt: skip
        await _one_send(res, wr, f"read_lat {size} B")
        n += 1
        if progress is not None:
            progress(1)
    stamps.posted.append(time.perf_counter_ns())  # the end of the last Read
    stamps.count = n
    return stamps


async def send_lat(res: Resources, size: int, progress: Progress | None = None) -> Stamps:
    """Send ping-pong, the client first (receives already posted, ``rx_depth`` of them)."""
    config = res.config
    assert res.recv_cq is not None
    link = res.links[0]
    assert link.mr is not None
    iters = config.iters if config.duration is None else None
    deadline = _deadline(config)
    scnt = rcnt = 0
    stamps = Stamps()
    what = f"send_lat {size} B"
    while iters is None or scnt < iters or rcnt < iters:
        if time.monotonic() >= deadline:
            break
        if (iters is None or rcnt < iters) and not (scnt < 1 and not config.server):
            wcs: list = []  # type: ignore[type-arg]
            with trio.move_on_at(trio.current_time() + max(0.0, deadline - time.monotonic())):
                while not wcs:
                    wcs = await res.recv_cq.poll_wait(1)
            if not wcs:
                break
            _check(res, wcs, what)
            rcnt += 1
            if iters is None or rcnt + config.rx_depth <= iters:
                post_receives_one(res, 0, size)
        if iters is None or scnt < iters:
            stamps.posted.append(time.perf_counter_ns())
            scnt += 1
            wr = SendWR(scnt, WROpcode.SEND, [link.mr.sge(0, size)], SendFlags.SIGNALED)
            await _one_send(res, wr, what)
            if progress is not None:
                progress(1)
    stamps.count = scnt
    return stamps


__all__ = [
    "Progress",
    "Stamps",
    "bw_client",
    "post_receives",
    "read_lat",
    "send_bw_server",
    "send_lat",
    "write_lat",
]
