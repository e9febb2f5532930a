"""The engines' own cost per message, without sockets: the native core beside the
Python engine, and both beside a raw TCP socket pair moving the same bytes.

Two engines of a kind are wired back to back in one process (sans-IO): one posts
batches of 64-byte Sends (signaled) and the other has receives posted; each round
frames the batch (CRC on), parses and places it, and both completion queues are
drained. The figure is nanoseconds per message for all of that on both sides.
The raw TCP row writes the same wire bytes (a batch of framed Sends) to one end of
a socket pair and reads them from the other: what a message costs the kernel alone.
This measures the protocol work the native engine takes out of Python
(``docs/native-engine.md``), not an end-to-end rate: ``bench.py`` does that.

Usage::

    python benchmarks/engine_core.py [--messages 200000] [--batch 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections import deque
from collections.abc import Callable

from rdmashim import SGE, Access, SendFlags, WROpcode
from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.jobs import EngineConfig, RecvJob, RecvRun, SendJob
from rdmashim.providers.softiwarp.memory import MemoryTable
from rdmashim.verbs.buffers import pin

from report import engine_line

SIZE = 64


def python_engine(batch: int) -> Callable[[], bytes]:
    """One round of the Python engine pair; returns the wire bytes of the round."""
    memory, pd = MemoryTable(), object()
    src, dst = pin(bytearray(SIZE), writable=True), pin(bytearray(SIZE * batch), writable=True)
    s = memory.register(pd, src.view, src.addr, Access.LOCAL_WRITE)
    d = memory.register(pd, dst.view, dst.addr, Access.LOCAL_WRITE)
    rq: deque[RecvJob] = deque()

    def engine(queue: deque[RecvJob]) -> Engine:
        e = Engine(1, pd, memory, queue)
        e.start(EngineConfig(crc=True))
        return e

    a, b = engine(deque()), engine(rq)
    sge = (SGE(src.addr, SIZE, s.stag),)
    recvs = [RecvJob(i, (SGE(dst.addr + SIZE * i, SIZE, d.stag),), SIZE) for i in range(batch)]
    flags = int(SendFlags.SIGNALED)
    sends = [SendJob(i, WROpcode.SEND, flags, sge, None, SIZE) for i in range(batch)]

    def round_() -> bytes:
        rq.extend(recvs)
        for job in sends:
            job.done, job.status = False, job.status.SUCCESS
            a.post_send(job)
        wire = b"".join(bytes(c) for c in a.produce())
        a.sent(len(wire))
        b.receive_data(wire)
        assert completions(a) + completions(b) == 2 * batch
        return wire

    round_.keep = (src, dst)  # type: ignore[attr-defined]
    return round_


def completions(engine: Engine) -> int:
    """Take the engine's outbox (as a provider does after each call): how many
    completions it held."""
    out, engine.outbox = engine.outbox, []
    return sum(len(item) if isinstance(item, RecvRun | list) else 1 for item in out)


def native_engine(batch: int) -> Callable[[], bytes]:
    """One round of the native pair, posting prepared arrays (one call each way)."""
    ffi, lib = native.ffi, native.lib
    mem = lib.rs_mem_new()
    src, dst = pin(bytearray(SIZE), writable=True), pin(bytearray(SIZE * batch), writable=True)
    for stag, buf in ((0x1100, src), (0x2200, dst)):
        lib.rs_mem_add(mem, stag, ffi.cast("uint8_t *", buf.addr), buf.addr, buf.length, 1, 1)
    cqs = [lib.rs_cq_new(4 * batch) for _ in range(4)]
    a = lib.rs_qp_new(mem, 1, 1, cqs[0], cqs[1], ffi.NULL, 4 * batch, 4 * batch, 0)
    b = lib.rs_qp_new(mem, 1, 2, cqs[2], cqs[3], ffi.NULL, 4 * batch, 4 * batch, 0)
    for qp in (a, b):
        lib.rs_qp_start(qp, 1, 16, 16, 65536, 0, 0)
    sends, recvs = ffi.new("rs_send_wr[]", batch), ffi.new("rs_recv_wr[]", batch)
    for i in range(batch):
        w = sends[i]
        w.wr_id, w.opcode, w.flags, w.num_sge = i, int(WROpcode.SEND), int(SendFlags.SIGNALED), 1
        w.sg_list[0].addr, w.sg_list[0].length, w.sg_list[0].lkey = src.addr, SIZE, 0x1100
        r = recvs[i]
        r.wr_id, r.num_sge = i, 1
        r.sg_list[0].addr, r.sg_list[0].length = dst.addr + SIZE * i, SIZE
        r.sg_list[0].lkey = 0x2200
    why, length, wcs = ffi.new("int *"), ffi.new("size_t *"), ffi.new("rs_wc[]", batch)

    def round_() -> bytes:
        lib.rs_qp_post_recv(b, recvs, batch)
        lib.rs_qp_post_send(a, sends, batch, why)
        ptr = lib.rs_qp_tx(a, length)
        n = length[0]
        lib.rs_qp_rx(b, ptr, n)
        lib.rs_qp_tx_done(a, n)
        assert lib.rs_cq_poll(cqs[0], wcs, batch) == batch
        assert lib.rs_cq_poll(cqs[3], wcs, batch) == batch
        return b""

    round_.keep = (src, dst, mem, cqs, a, b)  # type: ignore[attr-defined]
    return round_


def raw_tcp(wire: bytes) -> Callable[[], bytes]:
    """Write a round's wire bytes to a socket pair and read them back."""
    left, right = socket.socketpair()
    buf = bytearray(len(wire))
    view = memoryview(buf)

    def round_() -> bytes:
        left.sendall(wire)
        got = 0
        while got < len(wire):
            got += right.recv_into(view[got:])
        return b""

    round_.keep = (left, right)  # type: ignore[attr-defined]
    return round_


def timed(round_: Callable[[], bytes], rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        round_()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not (1 <= args.batch <= 4096 and args.messages >= args.batch and args.repeats >= 1):
        parser.error("--batch 1..4096, --messages at least --batch, --repeats at least 1")
    print(engine_line())
    if not native.AVAILABLE:
        print(f"native core: n/a ({native.WHY_NOT})")
        return 0
    rounds = args.messages // args.batch
    py = python_engine(args.batch)
    wire = py()
    runs = {"native core": native_engine(args.batch), "Python engine": py, "raw TCP": raw_tcp(wire)}
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # alternated, so load hits all alike
        for name, round_ in runs.items():
            figures[name].append(timed(round_, rounds) / (rounds * args.batch) * 1e9)
    raw = statistics.median(figures["raw TCP"])
    count = rounds * args.batch
    print(f"{SIZE} B Sends in batches of {args.batch}, {count} messages, median of {args.repeats}")
    for name, values in figures.items():
        med = statistics.median(values)
        print(f"  {name:14} {med:9.0f} ns/message   {med / raw:6.2f}x raw TCP")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
