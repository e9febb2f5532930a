"""Wire fuzzer for the soft-iWARP engine: hostile FPDU streams against a real responder.

A responder runs in a child process (so a crash is a dead process, not a lost
exception). It listens on loopback and treats every TCP connection as a user's
handler would: two fresh PDs, memory regions registered as slices of a new
arena with canary bytes before and after each region, CQs and a queue pair,
receives posted, a real MPA exchange (its Reply carries the region table, for
which the input is made), and after the input every object closed in one of
several orders (:data:`TEARDOWNS`), the regions sometimes while the input is
still being taken. An exception from any of those calls counts as a crash.
Then it checks the canaries, the regions no peer may write, and that no view
of the arena is left (it can be resized); it reports what it found over its
stdin/stdout control channel.

This side generates inputs (deterministic for a seed and an input number):
valid Sends, Writes, Read Requests, Read Responses and Terminates, with CRC
on or off, then mutated by class (bit flips, length fields, STags, offsets
near 2^64, truncation, bad CRC, versions, opcodes, QN/MSN/MO, garbage,
splices, MPA Requests). Each input is one connection: MPA Request, the FPDU
stream, then our FIN. The responder must answer with a Terminate or a close
within 2 s; an input that does not is tried again alone at the end, and is a
hang only if it times out again (a machine that starves the responder for
seconds times out every input in flight, and none of them alone). After
each input the fuzzer checks that the child is alive; every connection
checks that the listener accepts; the control channel says whether any guard
zone changed.

Usage::

    python tools/fuzz_wire.py --count 10000 --seed 1 --workers 4 [--time 120] [--json]
    python tools/fuzz_wire.py --replay 1234 --seed 1     # one input, verbose

The module is importable: :func:`run` takes the same parameters and returns
the summary dict.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import logging
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from crc32c import crc32c

from rdmashim.providers.softiwarp import ddp, mpa
from rdmashim.providers.softiwarp.ddp import QN, Opcode
from rdmashim.providers.softiwarp.terminate import TermCode

REPLY_TIMEOUT = 2.0
"""Seconds for the MPA Reply, and for the close or Terminate after our input."""
GUARD = 64
"""Canary bytes before and after each region in the responder's arena."""
RECV_SIZE = 512
RECVS = 4
READ_LEN = 64
"""The responder posts one RDMA Read of this many bytes per connection."""
READ_STAG = 0x00ABCD42
READ_TO = 0x7000_0000_1000
TO_MAX = (1 << 64) - 1
MAX_SEGMENT = 65000
"""Payload bytes per FPDU in the seeds (the 16-bit ULPDU length holds at most 65535)."""

CLASSES = (
    "valid", "bitflip", "length", "stag", "offset", "truncate", "crc", "version",
    "opcode", "qn_msn_mo", "garbage", "splice", "mpa",
)  # fmt: skip


# ---------------------------------------------------------------------- responder (child)
_REGIONS = {
    # name: (length, access names, pd, iova, must stay unchanged)
    "rw": (4096, ("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"), 0, None, False),
    "wo": (4096, ("LOCAL_WRITE", "REMOTE_WRITE"), 0, None, False),
    "ro": (4096, ("REMOTE_READ",), 0, None, True),
    "local": (4096, ("LOCAL_WRITE",), 0, None, True),
    "high": (4096, ("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"), 0, (1 << 64) - 4096, False),
    "big": (128 * 1024, ("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"), 0, None, False),
    "other": (4096, ("LOCAL_WRITE", "REMOTE_WRITE", "REMOTE_READ"), 1, None, True),
    "recv": (RECV_SIZE * RECVS, ("LOCAL_WRITE",), 0, None, False),
    "sink": (READ_LEN, ("LOCAL_WRITE",), 0, None, False),
}


def _pattern(n: int, salt: int) -> bytes:
    return bytes((i * 131 + salt) & 0xFF for i in range(n))


TEARDOWNS = ("regions-first", "qp-first", "pds-first", "reverse", "shuffled", "regions-early")
"""The orders a connection's objects are closed in (one per connection, in turn), as a
user's handler would: its regions first (the MRs a ``serve`` handler closes after the
disconnect, with the QP still there), the QP first, the PDs first (closing their
children), the reverse of creation, shuffled, or the regions while the input is still
being taken."""
_TABLE = struct.Struct("!IQI")
"""A region's STag, address and length in the MPA Reply's private data."""


def pack_table(table: dict[str, list[int]]) -> bytes:
    """The region table as private data (in :data:`_REGIONS` order)."""
    return b"".join(_TABLE.pack(*table[name]) for name in _REGIONS)


def unpack_table(data: bytes) -> dict[str, list[int]] | None:
    """The table :func:`pack_table` made, or None if ``data`` is not one."""
    if len(data) != _TABLE.size * len(_REGIONS):
        return None
    return {
        name: list(_TABLE.unpack_from(data, i * _TABLE.size)) for i, name in enumerate(_REGIONS)
    }


class _Responder:
    """The child: one listener; per connection, as a user's handler does it, two PDs,
    guarded regions over slices of one new arena, CQs and a QP; after the input, every
    object closed in one of :data:`TEARDOWNS`, then the arena checked (guards, frozen
    regions, and that no view of it is left: it can be resized)."""

    def __init__(self, ctx: Any) -> None:
        import rdmashim

        self.rdmashim = rdmashim
        self.ctx = ctx
        self.size = sum(length + 2 * GUARD for length, *_ in _REGIONS.values())
        self.pristine = _pattern(self.size, 7)
        self.guarded: list[tuple[str, int, int]] = []  # (name, start, end) that must not change
        self.starts: dict[str, int] = {}
        pos = 0
        for name, (length, _, _, _, frozen) in _REGIONS.items():
            self.guarded.append((f"{name}-guard-before", pos, pos + GUARD))
            start = self.starts[name] = pos + GUARD
            if frozen:
                self.guarded.append((name, start, start + length))
            self.guarded.append((f"{name}-guard-after", start + length, start + length + GUARD))
            pos = start + length + GUARD
        self.connections = 0
        self.strays: list[dict] = []
        self.teardown_errors: list[dict] = []
        self.internal = _Internal()

    def register(self, pds: list[Any], arena: bytearray) -> dict[str, Any]:
        """The connection's regions, as slices of its arena."""
        regions = {}
        view = memoryview(arena)
        for name, (length, names, pd_index, iova, _) in _REGIONS.items():
            access = self.rdmashim.Access.NONE
            for a in names:
                access |= self.rdmashim.Access[a]
            start = self.starts[name]
            regions[name] = pds[pd_index].reg_mr(view[start : start + length], access, iova=iova)
        view.release()
        return regions

    def check(self, peer: int, arena: bytearray) -> None:
        for name, start, end in self.guarded:
            if arena[start:end] != self.pristine[start:end]:
                self.strays.append({"peer_port": peer, "zone": name})
        try:
            arena.extend(b"\0")  # fails while anything still holds a view of the arena
        except BufferError as exc:
            self.teardown_errors.append({"peer_port": peer, "error": f"arena still viewed: {exc}"})

    async def serve(self, listener: trio.SocketListener) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                stream = await listener.accept()
                nursery.start_soon(self.connection, stream)

    async def connection(self, stream: trio.SocketStream) -> None:
        from rdmashim.providers.softiwarp.connection import MpaTimeout, accept_qp, read_request
        from rdmashim.providers.softiwarp.negotiation import MpaOptions
        from rdmashim.providers.softiwarp.terminate import ProtocolError

        rdmashim = self.rdmashim
        teardown = TEARDOWNS[self.connections % len(TEARDOWNS)]
        self.connections += 1
        try:
            peer = stream.socket.getpeername()[1]
        except OSError:
            await stream.aclose()
            return
        expected = (ProtocolError, MpaTimeout, ConnectionError, trio.BrokenResourceError, OSError)
        try:
            request = await read_request(stream, request_timeout=REPLY_TIMEOUT)
        except expected:
            await trio.aclose_forcefully(stream)
            return
        arena = bytearray(self.pristine)
        pds = [self.ctx.alloc_pd(), self.ctx.alloc_pd()]
        regions = self.register(pds, arena)
        scq, rcq = self.ctx.create_cq(64), self.ctx.create_cq(64)
        qp = pds[0].create_qp(
            send_cq=scq,
            recv_cq=rcq,
            cap=rdmashim.QPCap(max_send_wr=8, max_recv_wr=RECVS, max_send_sge=1, max_recv_sge=1),
        )
        recv = regions["recv"]
        qp.post_recv(
            [
                rdmashim.RecvWR(i, [rdmashim.SGE(recv.addr + i * RECV_SIZE, RECV_SIZE, recv.lkey)])
                for i in range(RECVS)
            ]
        )
        table = {n: [mr.rkey, mr.iova, mr.length] for n, mr in regions.items()}
        objects: dict[str, Any] = {f"mr-{n}": mr for n, mr in regions.items()}
        objects |= {"qp": qp, "send_cq": scq, "recv_cq": rcq, "pd0": pds[0], "pd1": pds[1]}
        try:
            options = MpaOptions(crc=False, ird=4, ord=4)
            await accept_qp(qp, stream, request, private_data=pack_table(table), options=options)
            sink = regions["sink"]
            qp.post_send(
                rdmashim.SendWR(
                    1, rdmashim.WROpcode.RDMA_READ, [sink.sge()], rdmashim.SendFlags.SIGNALED,
                    READ_TO, READ_STAG,
                )
            )  # fmt: skip
            if teardown == "regions-early":  # while the input is being taken
                await trio.sleep(0.001 * (self.connections % 4))
                self.close(peer, {k: v for k, v in objects.items() if k.startswith("mr-")})
            with trio.move_on_after(30):
                await qp.wait_closed()
        except expected:
            await trio.aclose_forcefully(stream)
        finally:
            names = list(objects)
            if teardown == "regions-first" or teardown == "regions-early":
                names.sort(key=lambda n: not n.startswith("mr-"))
            elif teardown == "qp-first":
                names.sort(key=lambda n: n != "qp")
            elif teardown == "pds-first":
                names.sort(key=lambda n: not n.startswith("pd"))
            elif teardown == "reverse":
                names.reverse()
            else:
                random.Random(self.connections).shuffle(names)
            self.close(peer, {n: objects[n] for n in names})
            self.check(peer, arena)

    def close(self, peer: int, objects: dict[str, Any]) -> None:
        """Close each object as a user does; an exception from any is a finding."""
        for name, obj in objects.items():
            try:
                obj.close()
            except Exception as exc:
                self.teardown_errors.append(
                    {"peer_port": peer, "error": f"{name}.close(): {type(exc).__name__}: {exc}"}
                )

    async def control(self) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
        buf = b""
        while True:
            chunk = await stdin.receive_some(4096)
            if not chunk:
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                _, buf = buf.split(b"\n", 1)
                strays, self.strays = self.strays, []
                teardown, self.teardown_errors = self.teardown_errors, []
                internal, self.internal.records = self.internal.records, []
                _emit(
                    {
                        "connections": self.connections,
                        "strays": strays,
                        "teardown_errors": teardown,
                        "internal_errors": internal,
                    }
                )


class _Internal(logging.Handler):
    """Collects the engine's internal errors (bugs it survived by ending one QP)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(logging.Formatter().format(record)[-2000:])


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _responder_main() -> None:
    import rdmashim

    internal = _Internal()
    logger = logging.getLogger("rdmashim")
    logger.setLevel(logging.ERROR)  # protocol violations are warnings; a bug of ours is an error
    logger.addHandler(internal)
    async with rdmashim.open_device("siw_lo") as ctx:
        responder = _Responder(ctx)
        responder.internal = internal
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=512)
        _emit({"port": listener.socket.getsockname()[1]})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(responder.serve, listener)
            nursery.start_soon(responder.control)


# ---------------------------------------------------------------------- inputs
@dataclass
class Fpdu:
    """One FPDU before framing: the header (from the MPA length on) and the payload."""

    header: bytearray
    payload: bytes = b""

    def fix_length(self) -> None:
        struct.pack_into("!H", self.header, 0, len(self.header) - 2 + len(self.payload))


@dataclass
class Case:
    """One input: its class, the MPA Request, and the bytes that follow it."""

    index: int
    cls: str
    crc: bool
    request: bytes
    fpdus: list[Fpdu] = field(default_factory=list)
    stream: bytes = b""
    note: str = ""


def nominal_table() -> dict[str, list[int]]:
    """A region table of made-up STags and addresses (the shape of a responder's)."""
    table = {
        name: [0x1234 + i * 256, 0x10000 * (i + 1), length]
        for i, (name, (length, *_)) in enumerate(_REGIONS.items())
    }
    table["high"][1] = (1 << 64) - table["high"][2]  # the region that ends at 2^64
    return table


def frame(fpdus: list[Fpdu], crc: bool) -> bytes:
    """The FPDUs on the wire: length, header, payload, PAD and CRC32c (or zeros)."""
    out = bytearray()
    for f in fpdus:
        body = bytes(f.header) + f.payload
        body += bytes(-len(body) & 3)
        out += body + (struct.pack("<I", crc32c(body)) if crc else bytes(4))
    return bytes(out)


def _tagged(op: Opcode, last: bool, stag: int, to: int, payload: bytes) -> Fpdu:
    # A zero-length segment at the very end of a region that ends at 2^64 has TO 2^64.
    return Fpdu(bytearray(ddp.encode_tagged(op, last, stag, to & TO_MAX, len(payload))), payload)


def _untagged(op: Opcode, last: bool, qn: int, msn: int, mo: int, payload: bytes, inv=0) -> Fpdu:
    hdr = ddp.encode_untagged(op, last, qn, msn, mo, len(payload), inv)
    return Fpdu(bytearray(hdr), payload)


class Generator:
    """Valid seeds and their mutations for one responder's region table."""

    def __init__(self, regions: dict[str, list[int]], classes: tuple[str, ...] = CLASSES) -> None:
        self.regions = regions
        self.classes = classes

    def case(self, seed: int, index: int) -> Case:
        """Input ``index`` of ``seed``, made for :attr:`regions` (its class, CRC and MPA
        Request are the same for any table)."""
        rng, case = self.head(seed, index)
        case.fpdus = self.seed_fpdus(rng)
        getattr(self, f"_m_{case.cls}")(rng, case)
        if not case.stream:
            case.stream = frame(case.fpdus, case.crc)
        return case

    def head(self, seed: int, index: int) -> tuple[random.Random, Case]:
        """Input ``index`` of ``seed`` up to its MPA Request (its class and CRC), with the
        random state the rest is made from."""
        rng = random.Random(seed * 1_000_003 + index)
        cls = rng.choice(self.classes)
        crc = rng.random() < 0.75
        return rng, Case(index, cls, crc, self.request(crc))

    @staticmethod
    def request(crc: bool, private_data: bytes = b"fuzz") -> bytes:
        frame_ = mpa.StartFrame(reply=False, crc=crc, ird=4, ord=4, private_data=private_data)
        return mpa.encode_start_frame(frame_)

    # -------------------------------------------------------------- seeds
    def seed_fpdus(self, rng: random.Random) -> list[Fpdu]:
        out: list[Fpdu] = []
        msn = {QN.SEND: 1, QN.READ_REQUEST: 1}
        kinds = ["send", "write", "read_request", "read_response", "terminate"]
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            kind = rng.choice(kinds)
            out += getattr(self, f"_seed_{kind}")(rng, msn)
            if kind == "terminate":
                break
            if kind == "read_response":  # the responder has one Read outstanding
                kinds.remove(kind)
        return out

    @staticmethod
    def _segments(rng: random.Random, n: int) -> list[tuple[int, int]]:
        cuts = set(rng.sample(range(1, n), min(rng.choice((0, 0, 1, 2)), n - 1))) if n else set()
        cuts.update(range(MAX_SEGMENT, n, MAX_SEGMENT))
        bounds = [0, *sorted(cuts), n]
        return list(itertools.pairwise(bounds))

    def _seed_send(self, rng: random.Random, msn: dict) -> list[Fpdu]:
        n = rng.choice((0, 1, 7, 64, RECV_SIZE, rng.randrange(RECV_SIZE + 1)))
        data = rng.randbytes(n)
        op = rng.choice((Opcode.SEND, Opcode.SEND_SE, Opcode.SEND_INV, Opcode.SEND_SE_INV))
        inv = 0
        if op in (Opcode.SEND_INV, Opcode.SEND_SE_INV):
            inv = self.regions[rng.choice(("rw", "wo", "other", "ro"))][0]
        segs = self._segments(rng, n)
        out = [_untagged(op, b == n, QN.SEND, msn[QN.SEND], a, data[a:b], inv) for a, b in segs]
        msn[QN.SEND] += 1
        return out

    def _seed_write(self, rng: random.Random, msn: dict) -> list[Fpdu]:
        stag, addr, length = self.regions[rng.choice(("rw", "wo", "high", "big"))]
        n = rng.choice((0, 1, 16, length, rng.randrange(length + 1)))
        off = rng.randrange(length - n + 1)
        data = rng.randbytes(n)
        return [
            _tagged(Opcode.WRITE, b == n, stag, addr + off + a, data[a:b])
            for a, b in self._segments(rng, n)
        ]

    def _seed_read_request(self, rng: random.Random, msn: dict) -> list[Fpdu]:
        stag, addr, length = self.regions[rng.choice(("rw", "ro", "high", "big"))]
        n = rng.choice((0, 1, 64, length, rng.randrange(length + 1)))
        off = rng.randrange(length - n + 1)
        sink_stag = rng.getrandbits(32)
        sink_to = rng.choice((0, 0x1000, rng.getrandbits(48)))
        src_to = (addr + off) & TO_MAX
        hdr = ddp.encode_read_request(msn[QN.READ_REQUEST], sink_stag, sink_to, n, stag, src_to)
        msn[QN.READ_REQUEST] += 1
        return [Fpdu(bytearray(hdr))]

    def _seed_read_response(self, rng: random.Random, msn: dict) -> list[Fpdu]:
        stag, addr, _ = self.regions["sink"]
        data = rng.randbytes(READ_LEN)
        return [
            _tagged(Opcode.READ_RESPONSE, b == READ_LEN, stag, addr + a, data[a:b])
            for a, b in self._segments(rng, READ_LEN)
        ]

    def _seed_terminate(self, rng: random.Random, msn: dict) -> list[Fpdu]:
        code = TermCode(rng.randrange(3), rng.randrange(3), rng.randrange(10))
        body = ddp.encode_terminate(ddp.Terminate(code))
        return [Fpdu(bytearray(body[: ddp.UNTAGGED_HDR_LEN]), body[ddp.UNTAGGED_HDR_LEN :])]

    # -------------------------------------------------------------- mutations
    def _m_valid(self, rng: random.Random, case: Case) -> None:
        case.note = "unchanged"

    def _m_bitflip(self, rng: random.Random, case: Case) -> None:
        data = bytearray(frame(case.fpdus, case.crc))
        for _ in range(rng.choice((1, 1, 2, 4, 8))):
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
        case.stream = bytes(data)

    def _m_length(self, rng: random.Random, case: Case) -> None:
        f = rng.choice(case.fpdus)
        hlen = len(f.header)
        actual = hlen - 2 + len(f.payload)
        value = rng.choice(
            (0, 1, 2, 3, hlen - 3, hlen - 2, actual - 1, actual + 1, actual + 4, 0xFFFF,
             rng.getrandbits(16))
        )  # fmt: skip
        struct.pack_into("!H", f.header, 0, value & 0xFFFF)
        case.note = f"ULPDU length {value & 0xFFFF} (was {actual})"

    def _stag_fields(self, f: Fpdu) -> list[int]:
        op = f.header[3] & 0x0F
        if op in (Opcode.WRITE, Opcode.READ_RESPONSE):
            return [4]
        if op == Opcode.READ_REQUEST and len(f.header) >= 48:
            return [20, 36]
        return [4]  # the invalidate STag of a Send (reserved in other untagged headers)

    def _m_stag(self, rng: random.Random, case: Case) -> None:
        f = rng.choice(case.fpdus)
        pos = rng.choice(self._stag_fields(f))
        (old,) = struct.unpack_from("!I", f.header, pos)
        names = tuple(_REGIONS)
        value = rng.choice(
            (0, 1, 0xFFFFFFFF, rng.getrandbits(32), old ^ rng.randrange(1, 256),
             old ^ (rng.randrange(1, 1 << 24) << 8), old + 256, old - 256,
             self.regions[rng.choice(names)][0])
        ) & 0xFFFFFFFF  # fmt: skip
        struct.pack_into("!I", f.header, pos, value)
        case.note = f"STag at {pos}: {old:#x} -> {value:#x}"

    def _m_offset(self, rng: random.Random, case: Case) -> None:
        f = rng.choice(case.fpdus)
        op = f.header[3] & 0x0F
        n = len(f.payload)
        if op == Opcode.READ_REQUEST and len(f.header) >= 48:
            (n,) = struct.unpack_from("!I", f.header, 32)
            if rng.random() < 0.3:
                size = rng.choice(
                    (0, 1, 4095, 4096, 4097, 65536, 131072, 0x7FFFFFFF, 0xFFFFFFFF, n + 1)
                )
                struct.pack_into("!I", f.header, 32, size)
                case.note = f"Read size {size}"
                return
            pos = rng.choice((24, 40))
        elif op in (Opcode.WRITE, Opcode.READ_RESPONSE):
            pos = 8
        else:  # untagged: the 32-bit MO
            mo = rng.choice((1, n, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF - n + 1, rng.getrandbits(32)))
            struct.pack_into("!I", f.header, 16, mo & 0xFFFFFFFF)
            case.note = f"MO {mo:#x}"
            return
        (old,) = struct.unpack_from("!Q", f.header, pos)
        _, addr, length = self.regions[rng.choice(("rw", "high", "ro", "other", "big"))]
        value = rng.choice(
            (TO_MAX, TO_MAX - n, TO_MAX - n + 1, TO_MAX - n + 2, TO_MAX - rng.randrange(1 << 16),
             1 << 63, addr - 1, addr + length - n + 1, addr + length, 0, rng.getrandbits(64),
             old + 1, old - 1)
        ) & TO_MAX  # fmt: skip
        struct.pack_into("!Q", f.header, pos, value)
        case.note = f"TO at {pos}: {old:#x} -> {value:#x} (length {n})"

    def _m_truncate(self, rng: random.Random, case: Case) -> None:
        data = frame(case.fpdus, case.crc)
        cut = rng.randrange(len(data))
        case.stream = data[:cut]
        case.note = f"cut at {cut} of {len(data)}"

    def _m_crc(self, rng: random.Random, case: Case) -> None:
        data = bytearray(frame(case.fpdus, case.crc))
        if rng.random() < 0.5 or len(case.fpdus) == 0:
            i = rng.randrange(len(data))  # any byte, CRC left as it was
        else:  # a CRC field itself
            i = len(data) - 1 - rng.randrange(4)
        data[i] ^= rng.randrange(1, 256)
        case.stream = bytes(data)
        case.note = f"byte {i} changed, CRC {'on' if case.crc else 'off'}"

    def _m_version(self, rng: random.Random, case: Case) -> None:
        f = rng.choice(case.fpdus)
        if rng.random() < 0.5:
            f.header[2] = (f.header[2] & ~0x03) | rng.choice((0, 2, 3))
        else:
            f.header[3] = (f.header[3] & 0x3F) | rng.choice((0x00, 0x80, 0xC0))
        case.note = f"control {f.header[2]:#04x} {f.header[3]:#04x}"

    def _m_opcode(self, rng: random.Random, case: Case) -> None:
        f = rng.choice(case.fpdus)
        choice = rng.randrange(4)
        if choice == 0:
            f.header[3] = (f.header[3] & 0xF0) | rng.randrange(8, 16)
        elif choice == 1:
            f.header[3] = (f.header[3] & 0xF0) | rng.randrange(8)
        elif choice == 2:
            f.header[2] ^= ddp.DDP_TAGGED
        else:
            f.header[2] ^= ddp.DDP_LAST
        case.note = f"control {f.header[2]:#04x} {f.header[3]:#04x}"

    def _m_qn_msn_mo(self, rng: random.Random, case: Case) -> None:
        untagged = [f for f in case.fpdus if not f.header[2] & ddp.DDP_TAGGED]
        if not untagged:
            case.fpdus.append(_untagged(Opcode.SEND, True, QN.SEND, 1, 0, b"x"))
            untagged = case.fpdus[-1:]
        f = rng.choice(untagged)
        pos = rng.choice((8, 12, 16))
        (old,) = struct.unpack_from("!I", f.header, pos)
        value = (
            rng.choice((0, 1, 2, 3, 0xFFFFFFFF, old + 1, old - 1, 1 << 31, rng.getrandbits(32)))
            & 0xFFFFFFFF
        )
        struct.pack_into("!I", f.header, pos, value)
        case.note = f"{ {8: 'QN', 12: 'MSN', 16: 'MO'}[pos] } {old} -> {value}"

    def _m_garbage(self, rng: random.Random, case: Case) -> None:
        junk = rng.randbytes(rng.choice((1, 3, 4, 17, 100, rng.randrange(1, 2000))))
        if rng.random() < 0.5:
            case.stream = junk
        else:
            case.stream = frame(case.fpdus, case.crc) + junk
        case.note = f"{len(junk)} random bytes"

    def _m_splice(self, rng: random.Random, case: Case) -> None:
        choice = rng.randrange(3)
        if choice == 0:  # one FPDU many times: MSN repeats, or (renumbered) IRD and RQ overruns
            f = rng.choice(case.fpdus)
            copies = [Fpdu(bytearray(f.header), f.payload) for _ in range(rng.choice((2, 5, 20)))]
            if not f.header[2] & ddp.DDP_TAGGED and rng.random() < 0.5:
                (msn,) = struct.unpack_from("!I", f.header, 12)
                for i, copy in enumerate(copies):
                    struct.pack_into("!I", copy.header, 12, (msn + i) & 0xFFFFFFFF)
            case.fpdus = copies
        elif choice == 1:  # reordered
            rng.shuffle(case.fpdus)
        else:  # more seeds, renumbered from the start
            case.fpdus += self.seed_fpdus(rng)
        case.note = f"splice {choice}, {len(case.fpdus)} FPDUs"

    def _m_mpa(self, rng: random.Random, case: Case) -> None:
        req = bytearray(case.request)
        choice = rng.randrange(7)
        if choice == 0:
            req[rng.randrange(16)] ^= rng.randrange(1, 256)  # key
        elif choice == 1:
            req[17] = rng.choice((0, 3, 4, 255))  # revision
        elif choice == 2:
            req[16] |= rng.choice((mpa.FLAG_MARKERS, 0x0F, 0x01, mpa.FLAG_REJECT))
        elif choice == 3:  # private data longer than 256, with the data
            n = rng.choice((253, 257, 300, 0xFFFF))
            req = req[:18] + struct.pack("!H", n) + req[20:24] + bytes(max(n - 4, 0))
        elif choice == 4:  # private data length beyond what is sent (cut short)
            struct.pack_into("!H", req, 18, len(req) - 20 + rng.randrange(1, 200))
            case.fpdus = []
        elif choice == 5:
            req = req[: rng.randrange(len(req))]
            case.fpdus = []
        else:  # enhanced flag without the IRD/ORD block
            req = req[:18] + struct.pack("!H", 2) + req[20:22]
        case.request = bytes(req)
        case.note = f"MPA Request mutation {choice}"


# ---------------------------------------------------------------------- checking
def scan_terminate(data: bytes, crc: bool) -> TermCode | None:
    """The code of the first Terminate among the FPDUs in ``data``, if any."""
    pos = 0
    while pos + 4 <= len(data):
        (ulpdu_len,) = struct.unpack_from("!H", data, pos)
        if data[pos + 3] & 0x0F == Opcode.TERMINATE and pos + 24 <= len(data):
            (word,) = struct.unpack_from("!I", data, pos + 20)
            return TermCode(word >> 28, (word >> 24) & 0xF, (word >> 16) & 0xFF)
        pos += 2 + ulpdu_len + (-(ulpdu_len + 2) & 3) + 4
    return None


class Child:
    """The responder process and its control channel."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: trio.Process | None = None
        self.port = 0
        self.regions = nominal_table()
        """The region table inputs are made for until a connection's MPA Reply brings the
        real one (each connection registers its regions anew)."""
        self._buf = b""
        self._lock = trio.Lock()
        self.generation = 0

    async def start(self) -> None:
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        try:
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, __file__, "--responder"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        finally:
            os.close(log)
        self._buf = b""
        hello = await self._line(30)
        self.port = hello["port"]
        self.generation += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def _line(self, seconds: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        with trio.fail_after(seconds):
            while b"\n" not in self._buf:
                chunk = await self.proc.stdout.receive_some(65536)
                if not chunk:
                    raise ConnectionError("responder closed its control channel")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    async def status(self) -> dict:
        async with self._lock:
            assert self.proc is not None and self.proc.stdin is not None
            await self.proc.stdin.send_all(b"status\n")
            return await self._line(30)

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    async def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            await self.proc.wait()


@dataclass
class Outcome:
    """What the responder did with one input."""

    kind: str
    """terminate, close, reject, hang or refused."""
    code: str = ""
    port: int = 0
    """Our end's TCP port (maps a stray write the responder reports back to the input)."""
    latency: float = 0.0
    """Seconds from our FIN after the input to the responder's close."""


async def exchange(
    port: int, case: Case, remake: Callable[[dict[str, list[int]] | None], Case] | None = None
) -> Outcome:
    """One connection: MPA Request, the input, FIN; then what the responder did. With
    ``remake``, the input is made (from its head) for the region table the MPA Reply
    carries (None: the Reply had none)."""
    try:
        with trio.fail_after(REPLY_TIMEOUT):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
    except (OSError, trio.TooSlowError):
        return Outcome("refused")
    sock = stream.socket
    port = sock.getsockname()[1]
    try:
        outcome = await _exchange(stream, case, remake)
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await trio.aclose_forcefully(stream)
    outcome.port = port
    return outcome


async def _exchange(
    stream: trio.SocketStream,
    case: Case,
    remake: Callable[[dict[str, list[int]] | None], Case] | None,
) -> Outcome:
    received = bytearray()
    crc = case.crc
    reply_len = None
    stage = "no MPA Reply"
    try:
        with trio.fail_after(REPLY_TIMEOUT):
            await stream.send_all(case.request)
            if case.cls != "mpa":
                while reply_len is None:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return Outcome("close", "before the MPA Reply")
                    received += chunk
                    parsed = mpa.parse_start_frame(received, reply=True)
                    if parsed is not None:
                        reply, reply_len = parsed
                        if reply.reject:
                            return Outcome("reject")
                        crc = reply.crc
                        if remake is not None:
                            case = remake(unpack_table(reply.private_data))
        stage = "input not taken"
        with trio.fail_after(REPLY_TIMEOUT):
            await stream.send_all(case.stream)
            await stream.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    except trio.TooSlowError:
        return Outcome("hang", stage)
    sent = trio.current_time()
    with trio.move_on_at(sent + REPLY_TIMEOUT) as scope:
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except (trio.BrokenResourceError, OSError):
                break
            if not chunk:
                break
            received += chunk
    if scope.cancelled_caught:
        return Outcome("hang", "no close within 2 s of the input")
    latency = trio.current_time() - sent
    if case.cls == "mpa":
        parsed = None
        with contextlib.suppress(Exception):
            parsed = mpa.parse_start_frame(received, reply=True)
        if parsed is None:
            return Outcome("close", latency=latency)
        reply, reply_len = parsed
        if reply.reject:
            return Outcome("reject", latency=latency)
        crc = reply.crc
    code = scan_terminate(bytes(received[reply_len or 0 :]), crc)
    kind = "terminate" if code else "close"
    return Outcome(kind, str(code) if code else "", latency=latency)


@dataclass
class Stats:
    """Running figures of a fuzz run."""

    seed: int
    inputs: int = 0
    crashes: list[dict] = field(default_factory=list)
    hangs: list[dict] = field(default_factory=list)
    stalls: list[dict] = field(default_factory=list)
    """Inputs that timed out among others but were answered in time when tried again
    alone at the end: the machine starved the responder (no MPA Reply for any input at
    once), not a hang of ours."""
    strays: list[dict] = field(default_factory=list)
    refused: list[dict] = field(default_factory=list)
    max_latency: float = 0.0
    internal_errors: list[str] = field(default_factory=list)
    """Engine bugs the responder survived (logged at ERROR, one QP terminated)."""
    by_class: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    started: float = field(default_factory=time.monotonic)

    def summary(self, command: str) -> dict:
        elapsed = time.monotonic() - self.started
        return {
            "command": command,
            "seed": self.seed,
            "inputs": self.inputs,
            "elapsed_s": round(elapsed, 1),
            "inputs_per_s": round(self.inputs / elapsed, 1) if elapsed > 0 else 0.0,
            "crashes": len(self.crashes),
            "hangs": len(self.hangs),
            "stalls_retried_ok": len(self.stalls),
            "stray_writes": len(self.strays),
            "listener_refused": len(self.refused),
            "max_close_s": round(self.max_latency, 3),
            "internal_errors": len(self.internal_errors),
            "internal_error_details": self.internal_errors[:5],
            "crash_details": self.crashes[:20],
            "hang_details": self.hangs[:20],
            "stall_details": self.stalls[:20],
            "stray_details": self.strays[:20],
            "classes": {
                cls: {"inputs": sum(c.values()), "outcomes": dict(c.most_common())}
                for cls, c in sorted(self.by_class.items())
            },
        }


async def _fuzz(
    seed: int,
    count: int,
    seconds: float,
    workers: int,
    progress: Callable[[Stats], None] | None,
    log_path: Path,
    only: int | None = None,
    classes: tuple[str, ...] = CLASSES,
) -> Stats:
    stats = Stats(seed)
    child = Child(log_path)
    await child.start()
    gen = Generator(child.regions, classes)
    next_index = iter(range(count) if only is None else [only])
    deadline = time.monotonic() + seconds
    in_flight: dict[int, tuple[int, str]] = {}
    ports: collections.OrderedDict[int, tuple[int, str, str]] = collections.OrderedDict()
    restart_lock = trio.Lock()
    last_progress = time.monotonic()

    async def check_child(generation: int) -> None:
        async with restart_lock:
            if child.alive or child.generation != generation:
                return
            stats.crashes.append(
                {
                    "inputs": sorted(in_flight.values()),
                    "returncode": child.proc.returncode if child.proc else None,
                    "log_tail": child.log_tail(),
                }
            )
            await child.stop()
            await child.start()

    async def collect_strays() -> None:
        if not child.alive:
            return
        try:
            status = await child.status()
        except (ConnectionError, trio.TooSlowError, trio.BrokenResourceError):
            return
        stats.internal_errors += status["internal_errors"]
        for error in status["teardown_errors"]:
            error["input"] = ports.get(error["peer_port"])
            stats.crashes.append({"teardown": error})
        for stray in status["strays"]:
            origin = ports.get(stray["peer_port"])
            stray["input"] = origin
            stats.strays.append(stray)

    async def attempt(index: int, case: Case) -> Outcome:
        """Input ``index`` (``case``: its head) on a connection: the MPA class's input is
        its Request, made now for the last table; the others are made for the table
        their MPA Reply brings."""
        if case.cls == "mpa":
            return await exchange(child.port, gen.case(seed, index))

        def remake(table: dict[str, list[int]] | None) -> Case:
            gen.regions = table or gen.regions  # the latest, for the MPA class
            return gen.case(seed, index)

        return await exchange(child.port, case, remake)

    async def retry_hangs() -> None:
        """Each input that timed out, again alone: a hang only if it times out again."""
        hangs, stats.hangs = stats.hangs, []
        for hang in hangs:
            outcome = await attempt(hang["input"], gen.head(seed, hang["input"])[1])
            stalled = child.alive and outcome.kind != "hang"
            (stats.stalls if stalled else stats.hangs).append(hang)

    async def worker(wid: int) -> None:
        nonlocal last_progress
        for index in next_index:
            if time.monotonic() > deadline:
                return
            generation = child.generation
            _, case = gen.head(seed, index)
            in_flight[wid] = (index, case.cls)
            outcome = await attempt(index, case)
            del in_flight[wid]
            ports[outcome.port] = (index, case.cls, case.note)
            if len(ports) > 20000:
                ports.popitem(last=False)
            stats.inputs += 1
            stats.max_latency = max(stats.max_latency, outcome.latency)
            if outcome.kind == "refused" and child.proc is not None:
                with trio.move_on_after(REPLY_TIMEOUT):  # a dying child closes its listener first
                    await child.proc.wait()
            crashed = not child.alive or child.generation != generation
            key = f"terminate {outcome.code}" if outcome.kind == "terminate" else outcome.kind
            key = "responder died" if crashed else key
            stats.by_class[case.cls][key] += 1
            if only is not None:
                print(f"input {index}: class {case.cls}, {case.note}; CRC {case.crc}")
                print(f"regions {gen.regions}")
                print(f"stream {case.stream[:200].hex()}")
                print(f"outcome {outcome}")
            if crashed:
                await check_child(generation)  # the crash is counted once, with its inputs
                continue
            if outcome.kind == "hang":
                stats.hangs.append({"input": index, "class": case.cls, "what": outcome.code})
            elif outcome.kind == "refused":
                stats.refused.append({"input": index, "class": case.cls})
            if stats.inputs % 20 == 0:
                await collect_strays()
            if progress is not None and time.monotonic() - last_progress > 5:
                last_progress = time.monotonic()
                progress(stats)

    try:
        async with trio.open_nursery() as nursery:
            for wid in range(workers):
                nursery.start_soon(worker, wid)
        await trio.sleep(0.5)
        await retry_hangs()
        await collect_strays()
        if not child.alive:
            await check_child(child.generation)
        else:  # the listener still accepts after the last input
            probe = Case(-1, "valid", False, Generator.request(False))
            if (await exchange(child.port, probe)).kind == "refused":
                stats.refused.append({"input": "final probe"})
    finally:
        await child.stop()
    return stats


def run(
    seed: int = 1,
    count: int = 1000,
    seconds: float = 120.0,
    workers: int = 4,
    progress: Callable[[Stats], None] | None = None,
    only: int | None = None,
    command: str = "",
    classes: tuple[str, ...] = CLASSES,
) -> dict:
    """Fuzz ``count`` inputs (at most ``seconds``); the summary as a dict."""
    with tempfile.TemporaryDirectory(prefix="fuzz_wire.") as tmp:
        stats = trio.run(
            _fuzz, seed, count, seconds, workers, progress, Path(tmp) / "responder.log", only,
            classes,
        )  # fmt: skip
    return stats.summary(command)


def _progress(stats: Stats) -> None:
    elapsed = time.monotonic() - stats.started
    print(
        f"{stats.inputs} inputs, {stats.inputs / elapsed:.0f}/s, crashes {len(stats.crashes)}, "
        f"hangs {len(stats.hangs)}, stray writes {len(stats.strays)}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--count", type=int, default=1000, help="inputs to run")
    parser.add_argument("--time", type=float, default=120.0, help="seconds at most")
    parser.add_argument("--workers", type=int, default=4, help="concurrent connections")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--replay", type=int, help="run only this input and show it")
    parser.add_argument(
        "--classes", default=",".join(CLASSES), help="mutation classes to draw from (comma list)"
    )
    parser.add_argument("--responder", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.responder:
        trio.run(_responder_main)
        return 0
    if args.count < 1 or args.time <= 0 or args.workers < 1:
        parser.error("--count and --workers must be at least 1, --time above 0")
    classes = tuple(c for c in args.classes.split(",") if c)
    unknown = set(classes) - set(CLASSES)
    if unknown or not classes:
        parser.error(f"unknown classes {sorted(unknown)}; known: {', '.join(CLASSES)}")
    summary = run(
        args.seed, args.count, args.time, args.workers, _progress, args.replay,
        " ".join(["python", "tools/fuzz_wire.py", *(argv or sys.argv[1:])]), classes,
    )  # fmt: skip
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(
            f"{summary['inputs']} inputs in {summary['elapsed_s']} s "
            f"({summary['inputs_per_s']}/s): crashes {summary['crashes']}, hangs "
            f"{summary['hangs']} (and {summary['stalls_retried_ok']} answered when tried "
            f"again alone), stray writes {summary['stray_writes']}, listener refused "
            f"{summary['listener_refused']}, internal errors {summary['internal_errors']}"
        )
        for cls, entry in summary["classes"].items():
            outcomes = ", ".join(f"{k}: {v}" for k, v in entry["outcomes"].items())
            print(f"  {cls} ({entry['inputs']}): {outcomes}")
    bad = summary["crashes"] or summary["hangs"] or summary["stray_writes"]
    bad = bad or summary["internal_errors"]
    return 1 if bad or summary["listener_refused"] else 0


if __name__ == "__main__":
    sys.exit(main())
