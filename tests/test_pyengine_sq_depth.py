"""The Python engine's ``sq_depth`` is a count kept as send work is posted, completed
and flushed (not summed from its queues): after every step it equals the entries
posted less those completed, a run's entries each. With the compiled and the Python
kernels."""

from __future__ import annotations

import pytest
from test_engine_sansio import Host

from rdmashim import SGE, SendFlags, WROpcode
from rdmashim.providers.softiwarp.jobs import SendJob, SendRun

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels


def _run(first: int, n: int) -> SendRun:
    run = SendRun()
    for wr_id in range(first, first + n):
        run.add(wr_id, SendRun.ctrl(0, False), 0, wr_id.to_bytes(8, "little"), 0)
    return run


def test_sq_depth_counts_what_is_posted_and_not_completed() -> None:
    host = Host(crc=True)
    engine = host.engine
    engine.sq_sig_all = True  # every entry completes into the outbox: they can be counted
    src = host.region(b"x" * 64)
    sge = (SGE(src.addr, 64, src.stag),)
    jobs: list[SendJob | SendRun] = [
        SendJob(1, WROpcode.SEND, 0, (), b"inline", 6),
        _run(10, 3),
        SendJob(2, WROpcode.RDMA_WRITE, 0, sge, None, 64, 0x1000, 0x77),
        _run(20, 2),
        SendJob(3, WROpcode.SEND, int(SendFlags.FENCE), sge, None, 64),
    ]
    posted = 0
    for job in jobs:
        engine.post_send(job)
        posted += len(job) if isinstance(job, SendRun) else 1
        assert engine.sq_depth == posted - len(host.send_wcs)
    while chunks := engine.produce(max_bytes=1):  # a message or a run at a time
        assert engine.sq_depth == posted - len(host.send_wcs)
        engine.sent(sum(len(c) for c in chunks))
        assert engine.sq_depth == posted - len(host.send_wcs)
    assert len(host.send_wcs) == posted and engine.sq_depth == 0
    for job in (_run(30, 4), SendJob(4, WROpcode.SEND, 0, (), b"last", 4)):
        engine.post_send(job)
    assert engine.produce(max_bytes=1)  # the run handed over, not sent: flushed below
    assert engine.sq_depth == 5
    engine.set_error()
    assert engine.sq_depth == 0 and len(host.send_wcs) == posted + 5
    engine.post_send(_run(40, 2))  # in ERROR: flushed at once, never counted
    assert engine.sq_depth == 0 and len(host.send_wcs) == posted + 7
