"""The native engine's core against the Python engine: the same streams, the same results.

Differential tests (``docs/native-engine.md``): a host of each engine, with the
same regions (same STags and tagged offsets, over separate buffers that start
alike), the same receives posted and the same RDMA Read outstanding, takes the
same byte stream cut at the same places; both must complete the same work
requests with the same statuses, place the same bytes, end in the same state
with the same Terminate code, and put the same bytes on the wire. The streams
are the wire fuzzer's (``tools/fuzz_wire.py``: valid seeds and their mutations,
hostile ones included), and the send side is compared on posted work of every
kind. Then a native engine and a Python one talk to each other.
"""

from __future__ import annotations

import random
import select
import socket
from collections import deque
from typing import Any

import pytest

from rdmashim import SGE, Access, SendFlags, WROpcode
from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.jobs import (
    EngineConfig,
    EngineState,
    Failed,
    RecvJob,
    SendJob,
)
from rdmashim.providers.softiwarp.memory import MemoryTable
from rdmashim.verbs.buffers import pin
from rdmashim.verbs.wr import RecvWR, SendWR

from outbox import sort_outbox
from tooling import tool

if not native.AVAILABLE:
    pytest.skip(f"native engine: {native.WHY_NOT}", allow_module_level=True)

fuzz_wire = tool("fuzz_wire")

REGIONS = fuzz_wire._REGIONS
RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
PATTERN = 0xA5


class PyHost:
    """The Python engine with its memory, receive queue and completions."""

    def __init__(self, config: EngineConfig, qp_num: int = 7) -> None:
        self.memory = MemoryTable()
        self.pds = [object(), object()]
        self.rq: deque[RecvJob] = deque()
        self.send_wcs: list[Any] = []
        self.recv_wcs: list[Any] = []
        self.engine = Engine(qp_num=qp_num, pd=self.pds[0], memory=self.memory, recv_queue=self.rq)
        self.engine.start(config)
        self._take()
        self.buffers: dict[int, bytearray] = {}
        self._pins: list[Any] = []
        self.wire = bytearray()

    def _take(self) -> None:
        """After each call into the engine, what it put out, as a provider takes it:
        completions, and on Failed the queued receives flushed."""
        outbox = self.engine.outbox
        while outbox:
            for event in sort_outbox(outbox, self.send_wcs, self.recv_wcs):
                if isinstance(event, Failed):
                    jobs = list(self.rq)
                    self.rq.clear()
                    self.engine.flush_recv(jobs)

    def register(self, length: int, access: Access, pd: int, iova: int | None) -> tuple[int, int]:
        buf = bytearray([PATTERN]) * length
        pinned = pin(buf, writable=True)
        self._pins.append(pinned)
        base = pinned.addr if iova is None else iova
        region = self.memory.register(self.pds[pd], pinned.view, base, access)
        self.buffers[region.stag] = buf
        return region.stag, base

    def post_recv(self, wrs: list[RecvWR]) -> None:
        for w in wrs:
            self.rq.append(RecvJob(w.wr_id, tuple(w.sg_list), sum(s.length for s in w.sg_list)))

    def post_send(self, wrs: list[SendWR]) -> None:
        for w in wrs:
            sges = tuple(w.sg_list)
            inline = None
            if w.send_flags & SendFlags.INLINE:
                inline = b"".join(
                    bytes(self.memory.resolve(s.lkey, self.pds[0], s.addr, s.length, 0))
                    for s in sges
                )
            length = sum(s.length for s in sges)
            self.engine.post_send(
                SendJob(
                    w.wr_id,
                    w.opcode,
                    int(w.send_flags),
                    sges,
                    inline,
                    length,
                    w.remote_addr,
                    w.rkey,
                    w.invalidate_rkey,
                )
            )
            self._take()

    def receive(self, data: bytes) -> None:
        self.engine.receive_data(data)
        self._take()

    def flush_tx(self) -> bytes:
        out = bytearray()
        while bufs := self.engine.produce():
            chunk = b"".join(bytes(b) for b in bufs)
            self.engine.sent(len(chunk))
            self._take()
            out += chunk
        self.wire += out
        return bytes(out)

    def summary(self) -> tuple[Any, ...]:
        code = getattr(self.engine.error, "code", None) if self.engine.error else None
        state = self.engine.state
        return (state, code, self.send_wcs, self.recv_wcs)


class CHost:
    """The native engine with the same interface."""

    def __init__(self, config: EngineConfig, qp_num: int = 7) -> None:
        self.memory = native.NativeMemory()
        self.pds = [object(), object()]
        self.scq, self.rcq = native.NativeCQ(4096), native.NativeCQ(4096)
        self.qp = native.NativeQP(self.memory, self.pds[0], qp_num, self.scq, self.rcq)
        self.qp.start(config)
        self.buffers: dict[int, bytearray] = {}
        self._pins: list[Any] = []
        self.send_wcs: list[Any] = []
        self.recv_wcs: list[Any] = []
        self.wire = bytearray()

    def register_as(self, stag: int, iova: int, length: int, access: Access, pd: int) -> None:
        buf = bytearray([PATTERN]) * length
        pinned = pin(buf, writable=True)
        self._pins.append(pinned)
        self.memory.add(stag, pinned.addr, iova, length, access, self.pds[pd])
        self.buffers[stag] = buf

    def post_recv(self, wrs: list[RecvWR]) -> None:
        self.qp.post_recv(wrs)

    def post_send(self, wrs: list[SendWR]) -> None:
        self.qp.post_send(wrs)

    def receive(self, data: bytes) -> None:
        self.qp.receive(data)

    def flush_tx(self) -> bytes:
        out = bytearray()
        while chunk := self.qp.take():
            self.qp.taken(len(chunk))
            out += chunk
        self.wire += out
        return bytes(out)

    def collect(self) -> None:
        self.send_wcs += self.scq.poll(1 << 20)
        self.recv_wcs += self.rcq.poll(1 << 20)

    def summary(self) -> tuple[Any, ...]:
        self.collect()
        state = self.qp.state
        kind, code, _ = self.qp.error
        return (state, code if kind in (1, 2, 3, 4) else None, self.send_wcs, self.recv_wcs)

    def close(self) -> None:
        self.qp.close()
        self.scq.close()
        self.rcq.close()
        self.memory.close()


def twins(config: EngineConfig) -> tuple[PyHost, CHost, dict[str, list[int]]]:
    """A host of each engine with the fuzzer's regions, the same STags in both."""
    py, c = PyHost(config), CHost(config)
    table = {}
    for name, (length, names, pd, iova, _) in REGIONS.items():
        access = Access.NONE
        for a in names:
            access |= Access[a]
        stag, base = py.register(length, access, pd, iova)
        c.register_as(stag, base, length, access, pd)
        table[name] = [stag, base, length]
    return py, c, table


def responder_work(hosts: tuple[PyHost, CHost], table: dict[str, list[int]]) -> None:
    """What the fuzzer's responder posts: four receives, and one RDMA Read."""
    rstag, raddr, _ = table["recv"]
    sstag, saddr, _ = table["sink"]
    for host in hosts:
        host.post_recv(
            [
                RecvWR(i, [SGE(raddr + i * fuzz_wire.RECV_SIZE, fuzz_wire.RECV_SIZE, rstag)])
                for i in range(fuzz_wire.RECVS)
            ]
        )
        host.post_send(
            [
                SendWR(
                    1, WROpcode.RDMA_READ, [SGE(saddr, fuzz_wire.READ_LEN, sstag)],
                    SendFlags.SIGNALED, fuzz_wire.READ_TO, fuzz_wire.READ_STAG,
                )
            ]
        )  # fmt: skip


def same(py: PyHost, c: CHost, what: str) -> None:
    """Both hosts agree on everything observable."""
    ps, cs = py.summary(), c.summary()
    assert ps[0] == cs[0], f"{what}: state {ps[0]} vs native {cs[0]} ({c.qp.error})"
    assert ps[1] == cs[1], f"{what}: Terminate code {ps[1]} vs native {cs[1]} ({c.qp.error})"
    assert ps[2] == cs[2], f"{what}: send completions\n{ps[2]}\nnative\n{cs[2]}"
    assert ps[3] == cs[3], f"{what}: receive completions\n{ps[3]}\nnative\n{cs[3]}"
    for stag, buf in py.buffers.items():
        assert buf == c.buffers[stag], f"{what}: the bytes of region {stag:#x} differ"
    assert py.wire == c.wire, f"{what}: wire output differs\n{py.wire.hex()}\n{c.wire.hex()}"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_fuzzers_streams_give_the_same_results(seed: int) -> None:
    """600 inputs per seed, every mutation class, CRC on and off, cut at random places;
    every other input has a region deregistered at a random point of its stream."""
    for index in range(600):
        probe = fuzz_wire.Generator(fuzz_wire.nominal_table()).head(seed, index)[1]
        config = EngineConfig(crc=probe.crc, ird=4, ord=4)
        py, c, table = twins(config)
        try:
            case = fuzz_wire.Generator(table).case(seed, index)
            if case.cls == "mpa":
                continue  # MPA setup is Python for both engines
            responder_work((py, c), table)
            py.flush_tx()
            c.flush_tx()
            rng = random.Random(index)
            data = case.stream
            # Every other input: a region closed at a random point of the stream.
            close_at = rng.randrange(len(data) + 1) if index % 2 else -1
            closing = rng.choice(sorted(REGIONS))
            while True:
                if 0 <= close_at <= len(case.stream) - len(data):
                    close_at = -1
                    stag = table[closing][0]
                    py.memory.deregister(py.memory._regions[stag >> 8])
                    c.memory.remove(stag)
                if not data:
                    break
                n = rng.choice((1, 3, 17, 64, 1000, 65536))
                for host in (py, c):
                    host.receive(data[:n])
                data = data[n:]
            py.flush_tx()
            c.flush_tx()
            same(py, c, f"seed {seed} input {index} ({case.cls}, {case.note})")
        finally:
            c.close()


def _send_work(rng: random.Random, table: dict[str, list[int]]) -> list[SendWR]:
    """A random mix of Sends (plain, SE, with Invalidate, inline, several SGEs),
    Writes and Reads over the regions (some of them faulty)."""
    rw_stag, rw_addr, _ = table["rw"]
    big_stag, big_addr, big_len = table["big"]
    wrs: list[SendWR] = []
    for i in range(rng.randrange(1, 12)):
        kind = rng.choice(("send", "send", "write", "read", "inline", "sges", "bad"))
        n = rng.choice((0, 1, 7, 100, 4096, rng.randrange(big_len)))
        off = rng.randrange(big_len - n + 1)
        sge = SGE(big_addr + off, n, big_stag)
        flags = SendFlags.SIGNALED if rng.random() < 0.7 else SendFlags.NONE
        if rng.random() < 0.2:
            flags |= SendFlags.SOLICITED
        if kind in ("send", "inline"):
            op = WROpcode.SEND_WITH_INV if rng.random() < 0.2 else WROpcode.SEND
            if kind == "inline":
                flags |= SendFlags.INLINE
                sge = SGE(rw_addr, min(n, 80), rw_stag)
            wrs.append(SendWR(i, op, [sge], flags, invalidate_rkey=0x1234))
        elif kind == "sges":
            parts = [SGE(rw_addr + k * 64, 64, rw_stag) for k in range(rng.randrange(1, 6))]
            wrs.append(SendWR(i, WROpcode.SEND, parts, flags))
        elif kind == "write":
            wrs.append(SendWR(i, WROpcode.RDMA_WRITE, [sge], flags, 0x7000_0000 + off, 0x4242))
        elif kind == "read":
            wrs.append(SendWR(i, WROpcode.RDMA_READ, [sge], flags, 0x9000_0000, 0x5151))
        else:  # a region of another PD: a local protection error when it starts
            o_stag, o_addr, _ = table["other"]
            wrs.append(SendWR(i, WROpcode.SEND, [SGE(o_addr, 8, o_stag)], flags))
    return wrs


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("max_fpdu", [65536, 1460, 64])
def test_posted_work_goes_out_as_the_same_bytes(crc: bool, max_fpdu: int) -> None:
    for seed in range(40):
        rng = random.Random(seed)
        config = EngineConfig(crc=crc, ird=8, ord=rng.choice((1, 2, 8)), max_fpdu=max_fpdu)
        py, c, table = twins(config)
        try:
            big_stag, _, big_len = table["big"]
            content = rng.randbytes(big_len)
            for host in (py, c):
                host.buffers[big_stag][:] = content
            work = _send_work(rng, table)
            # Work framed ahead of TCP when a later request fails completes flushed, and
            # how far each engine frames ahead differs (the Python one by its buffers):
            # with a failing request in the list, each request goes out before the next.
            failing = any(w.sg_list and w.sg_list[0].lkey == table["other"][0] for w in work)
            for batch in [[w] for w in work] if failing else [work]:
                for host in (py, c):
                    host.post_send(batch)
                py.flush_tx()
                c.flush_tx()
            same(py, c, f"seed {seed}")
        finally:
            c.close()


def test_a_native_engine_and_a_python_engine_talk() -> None:
    """Sends, Writes and Reads both ways between the two engines, every byte checked."""
    config = EngineConfig(crc=True, ird=8, ord=8, max_fpdu=1460)
    py, c, table = twins(config)
    try:
        rng = random.Random(5)
        big_stag, big_addr, big_len = table["big"]
        rw_stag, rw_addr, _ = table["rw"]
        py.buffers[big_stag][:] = rng.randbytes(big_len)
        c.buffers[big_stag][:] = rng.randbytes(big_len)
        pbig, cbig = bytes(py.buffers[big_stag]), bytes(c.buffers[big_stag])
        for host in (py, c):
            host.post_recv(
                [RecvWR(100 + i, [SGE(rw_addr + i * 1024, 1024, rw_stag)]) for i in range(4)]
            )
        # py writes its first half to c's second half, c reads py's second half into its first
        half = big_len // 2
        first, second = SGE(big_addr, half, big_stag), big_addr + half
        sig = SendFlags.SIGNALED
        py.post_send(
            [
                SendWR(1, WROpcode.RDMA_WRITE, [first], sig, second, big_stag),
                SendWR(2, WROpcode.SEND, [SGE(big_addr, 1000, big_stag)], sig),
            ]
        )
        c.post_send(
            [
                SendWR(3, WROpcode.RDMA_READ, [first], sig, second, big_stag),
                SendWR(4, WROpcode.SEND, [SGE(big_addr + 5, 999, big_stag)], sig),
            ]
        )
        for _ in range(100):
            a, b = py.flush_tx(), c.flush_tx()
            if not a and not b:
                break
            c.receive(a)
            py.receive(b)
        c.collect()
        assert py.engine.state is c.qp.state is EngineState.RTS, c.qp.error
        assert [(w.wr_id, w.status.name) for w in py.send_wcs] == [(1, "SUCCESS"), (2, "SUCCESS")]
        assert [(w.wr_id, w.status.name) for w in c.send_wcs] == [(3, "SUCCESS"), (4, "SUCCESS")]
        assert [(w.wr_id, w.byte_len) for w in c.recv_wcs] == [(100, 1000)]
        assert [(w.wr_id, w.byte_len) for w in py.recv_wcs] == [(100, 999)]
        assert c.buffers[big_stag][half:] == pbig[:half]  # py's Write
        assert c.buffers[big_stag][:half] == pbig[half:]  # c's Read of py's second half
        assert c.buffers[rw_stag][:1000] == pbig[:1000]
        assert py.buffers[rw_stag][:999] == cbig[5:1004]
    finally:
        c.close()


def test_a_hostile_stream_never_reads_or_writes_outside_the_regions() -> None:
    """Random bytes after a valid header, and headers with every length: the native
    engine answers with a Terminate and places nothing outside a region (the regions'
    buffers are compared with the Python engine's, which is guarded elsewhere)."""
    rng = random.Random(11)
    for index in range(300):
        py, c, table = twins(EngineConfig(crc=rng.random() < 0.5))
        try:
            responder_work((py, c), table)
            py.flush_tx()
            c.flush_tx()
            data = rng.randbytes(rng.randrange(1, 3000))
            for host in (py, c):
                host.receive(data)
            py.flush_tx()
            c.flush_tx()
            same(py, c, f"random input {index}")
        finally:
            c.close()


def test_two_native_engines_over_a_real_socket() -> None:
    """The socket side (rs_qp_read_fd / rs_qp_write_fd) over a socket pair: 1 MiB of
    Writes, 200 Sends and a 256 KiB Read, driven by select until both are quiet."""
    left, right = socket.socketpair()
    hosts = [CHost(EngineConfig(crc=True), qp_num=n) for n in (1, 2)]
    try:
        size = 1 << 20
        data = random.Random(3).randbytes(size)
        regions = []
        for host in hosts:
            buf = bytearray(size)
            pinned = pin(buf, writable=True)
            host._pins.append(pinned)
            host.memory.add(
                0x4200 + host.qp.qp_num, pinned.addr, pinned.addr, size, RW, host.pds[0]
            )
            regions.append((buf, pinned.addr, 0x4200 + host.qp.qp_num))
        (abuf, aaddr, astag), (bbuf, baddr, bstag) = regions
        abuf[:] = data
        sig = SendFlags.SIGNALED
        hosts[1].post_recv([RecvWR(i, [SGE(baddr + size - 4096, 64, bstag)]) for i in range(200)])
        hosts[0].post_send(
            [SendWR(1, WROpcode.RDMA_WRITE, [SGE(aaddr, size // 2, astag)], sig, baddr, bstag)]
            + [SendWR(10 + i, WROpcode.SEND, [SGE(aaddr + i, 64, astag)], sig) for i in range(200)]
        )
        hosts[1].post_send(
            [SendWR(2, WROpcode.RDMA_READ, [SGE(baddr + size // 2, 1 << 18, bstag)], sig,
                    aaddr + size // 2, astag)]
        )  # fmt: skip
        for s in (left, right):
            s.setblocking(False)
        pairs = [(hosts[0], left), (hosts[1], right)]
        for _ in range(100000):
            moved = 0
            for host, sock in pairs:
                while (n := host.qp.write_fd(sock.fileno())) > 0:
                    moved += n
                while (n := host.qp.read_fd(sock.fileno())) > 0:
                    moved += n
            if not moved:
                select.select([left, right], [], [], 0.05)
                if all(h.qp.sq_depth == 0 for h in hosts):
                    break
        for host in hosts:
            host.collect()
            assert host.qp.state is EngineState.RTS, host.qp.error
        assert [w.wr_id for w in hosts[0].send_wcs] == [1, *range(10, 210)]
        assert [(w.wr_id, w.status.name) for w in hosts[1].send_wcs] == [(2, "SUCCESS")]
        assert [w.byte_len for w in hosts[1].recv_wcs] == [64] * 200
        assert bbuf[: size // 2] == data[: size // 2]
        assert bbuf[size // 2 : size // 2 + (1 << 18)] == data[size // 2 : size // 2 + (1 << 18)]
        assert bbuf[size - 4096 : size - 4096 + 64] == data[199 : 199 + 64]
    finally:
        left.close()
        right.close()
        for host in hosts:
            host.close()


@pytest.mark.parametrize("cqe", [1, 4, 7])
def test_a_cq_overrun_fails_the_qp_after_the_call_and_keeps_the_queues_whole(cqe: int) -> None:
    """Eight signaled Sends into a send CQ of ``cqe``: the completion that does not fit
    moves the QP to ERROR (kind RS_ERR_CQ_OVERRUN) when the call that made it ends, and
    the send queue is empty and consistent. The first version entered ERROR from inside
    the loop completing the queue: that loop then took one entry too many and the queue
    depth wrapped to 2**32 - 1 (freeing the QP walked four billion entries)."""
    memory = native.NativeMemory()
    pd = object()
    scq, rcq = native.NativeCQ(cqe), native.NativeCQ(16)
    qp = native.NativeQP(memory, pd, 9, scq, rcq)
    try:
        qp.start(EngineConfig(crc=True))
        buf = bytearray(b"overrun!")
        pinned = pin(buf, writable=True)
        memory.add(0x4200, pinned.addr, pinned.addr, len(buf), Access.LOCAL_WRITE, pd)
        sig = SendFlags.SIGNALED
        sge = SGE(pinned.addr, 8, 0x4200)
        qp.post_send([SendWR(i, WROpcode.SEND, [sge], sig) for i in range(8)])
        while chunk := qp.take():
            qp.taken(len(chunk))
        assert qp.state is EngineState.ERROR
        assert qp.error[0] == 6  # RS_ERR_CQ_OVERRUN
        assert qp.sq_depth == 0
        assert [wc.wr_id for wc in scq.poll(16)] == list(range(cqe))
    finally:
        qp.close()
        scq.close()
        rcq.close()
        memory.close()


def test_a_post_at_indices_checks_every_index_before_it_posts() -> None:
    """``rs_qp_post_recv_at`` and ``rs_srq_post_at`` read ``table[at[k]]``: one index
    past the table posts nothing (``RS_BAD_INDEX``; the provider refuses such a post
    before C sees it, so this is C's own guard of the memory it reads); good indices
    post those entries in the order given (a QP in ERROR flushes them in that order)."""
    ffi, lib = native.ffi, native.lib
    memory = native.NativeMemory()
    pd = object()
    scq, rcq = native.NativeCQ(16), native.NativeCQ(16)
    qp = native.NativeQP(memory, pd, 9, scq, rcq)
    srq = lib.rs_srq_new(4)
    try:
        table = ffi.new("rs_recv_wr[]", 3)
        for i in range(3):
            table[i].wr_id = 100 + i
        bad = ffi.new("uint32_t[]", [0, 3])
        assert lib.rs_qp_post_recv_at(qp._ptr, table, 3, bad, 2) == 0xFFFFFFFF
        assert lib.rs_srq_post_at(srq, table, 3, bad, 2) == 0xFFFFFFFF
        good = ffi.new("uint32_t[]", [2, 0, 2])
        assert lib.rs_qp_post_recv_at(qp._ptr, table, 3, good, 3) == 3
        assert lib.rs_srq_post_at(srq, table, 3, good, 3) == 3
        assert lib.rs_srq_post_at(srq, table, 3, good, 3) == 1  # (4 fit)
        lib.rs_qp_set_error(qp._ptr, 5, b"test")
        assert [wc.wr_id for wc in rcq.poll(16)] == [102, 100, 102]
    finally:
        lib.rs_srq_free(srq)
        qp.close()
        scq.close()
        rcq.close()
        memory.close()
