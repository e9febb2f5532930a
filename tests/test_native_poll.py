"""Polling the native engine's CQs into a ``WCArray``: what C sums up and the decode.

``rs_cq_poll_sum`` says what the completions of one poll have in common (all
successes, one opcode, one QP, no flags, ...) and ``poll_into`` stores such a
column whole; few completions are decoded row by row. Both must give exactly
what decoding each row on its own gives (values and types: enum members, bools).
"""

from __future__ import annotations

import random

import pytest

from rdmashim import SGE, Access, SendFlags, WROpcode
from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.jobs import EngineConfig
from rdmashim.providers.softiwarp.native_cq import _Rows
from rdmashim.verbs.buffers import pin
from rdmashim.verbs.enums import WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.wr import WC, RecvWR, SendWR, WCArray

from nativecore import two_qps

pytestmark = pytest.mark.skipif(native.lib is None, reason="the native engine is not built here")

_FIELDS = ("wr_id", "status", "opcode", "byte_len", "qp_num", "wc_flags", "invalidated_rkey",
           "solicited")  # fmt: skip
_ODD = {"status": 1, "wc_flags": 2, "solicited": 4, "invalidated_rkey": 8}


def _expected(rows: _Rows, n: int) -> list[WC]:
    """Each row decoded on its own (the oracle)."""
    out = []
    for k in range(n):
        w = rows.c[k]
        out.append(WC(
            w.wr_id, WCStatus(w.status), WCOpcode(w.opcode), w.byte_len, w.qp_num,
            WCFlags(w.wc_flags), w.invalidated_rkey, 0, bool(w.solicited),
        ))  # fmt: skip
    return out


def _summed(rows: _Rows, n: int) -> tuple[int, int, int]:
    """What ``rs_cq_poll_sum`` should say of rows 0..n-1 (``rs_wc_sum``'s definition)."""
    c = [rows.c[k] for k in range(n)]
    odd = 0
    for name, bit in _ODD.items():
        odd |= bit if any(getattr(w, name) for w in c) else 0
    odd |= 16 if len({w.opcode for w in c}) > 1 else 0
    odd |= 32 if len({w.qp_num for w in c}) > 1 else 0
    odd |= 64 if any(w.byte_len for w in c) else 0
    return odd, c[0].opcode if c else 0, c[0].qp_num if c else 0


def _check(rows: _Rows, n: int) -> None:
    wcs = WCArray(max(n, 1) + 3)
    wcs.native = rows
    rows.decode_into(wcs, n)
    got = [wcs[k] for k in range(n)]
    want = _expected(rows, n)
    assert got == want
    for g, w in zip(got, want, strict=True):
        assert [type(x) for x in g] == [type(x) for x in w], (g, w)


@pytest.mark.parametrize("seed", range(6))
def test_decoding_a_poll_gives_each_rows_own_decoding(seed: int) -> None:
    """Random rows (each column alike or not), every size around the row-by-row limit."""
    rnd = random.Random(seed)
    rows = _Rows(300)
    for n in (1, 2, 3, 4, 5, 6, 17, 64, 300):
        varied = {name: rnd.random() < 0.5 for name in _FIELDS}
        for k in range(n):
            w = rows.c[k]
            w.wr_id = rnd.getrandbits(64)
            w.status = rnd.choice(list(WCStatus)) if varied["status"] else 0
            w.opcode = rnd.choice(list(WCOpcode)) if varied["opcode"] else int(WCOpcode.RECV)
            w.byte_len = rnd.getrandbits(32) if varied["byte_len"] else 0
            w.qp_num = rnd.getrandbits(24) if varied["qp_num"] else 7
            w.wc_flags = rnd.choice([0, int(WCFlags.WITH_INV)]) if varied["wc_flags"] else 0
            w.invalidated_rkey = rnd.getrandbits(32) if varied["invalidated_rkey"] else 0
            w.solicited = rnd.choice([0, 1]) if varied["solicited"] else 0
        rows.sum.odd, rows.sum.opcode, rows.sum.qp_num = _summed(rows, n)
        _check(rows, n)


def test_c_sums_up_what_it_polled() -> None:
    """Completions a real exchange makes (Sends with and without SE, Writes, Reads,
    then everything flushed), polled in chunks of random size: C's summary is the
    oracle's, and the decode is each row's own."""
    rnd = random.Random(5)
    buf = bytearray(4096)
    pinned = pin(buf, writable=True)
    every = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
    with two_qps(EngineConfig(crc=True), cqe=4096) as core:
        a, b, cqs = core.a, core.b, core.cqs
        core.memory.add(0x100, pinned.addr, pinned.addr, len(buf), every, core.pd)
        b.post_recv([RecvWR(1000 + i, [SGE(pinned.addr + 8 * i, 8, 0x100)]) for i in range(200)])
        ops = []
        for i in range(300):
            kind = rnd.choice(["send", "se", "write", "read", "quiet"])
            sge = [SGE(pinned.addr + rnd.randrange(0, 4000), rnd.randrange(0, 9), 0x100)]
            flags = SendFlags.SIGNALED
            if kind in ("send", "se", "quiet"):
                flags = {"send": flags, "se": flags | SendFlags.SOLICITED, "quiet": 0}[kind]
                ops.append(SendWR(i, WROpcode.SEND, sge, flags))
            else:
                op = WROpcode.RDMA_WRITE if kind == "write" else WROpcode.RDMA_READ
                ops.append(SendWR(i, op, sge, flags, remote_addr=pinned.addr + 64, rkey=0x100))
        a.post_send(ops[:150])
        for _ in range(50):  # both ways until quiet
            moved = False
            for src, dst in ((a, b), (b, a)):
                if chunk := src.take():
                    dst.receive(chunk)
                    src.taken(len(chunk))
                    moved = True
            if not moved:
                break
        b.post_recv([RecvWR(2000 + i, [SGE(pinned.addr, 8, 0x100)]) for i in range(20)])
        a.post_send(ops[150:])
        a.set_error("test")  # the rest is flushed
        b.set_error("test")
        rows = _Rows(64)
        polled = 0
        for cq in cqs:
            while n := native.lib.rs_cq_poll_sum(cq._ptr, rows.c, rnd.randrange(1, 64), rows.sum):
                assert (rows.sum.odd, rows.sum.opcode, rows.sum.qp_num) == _summed(rows, n)
                _check(rows, n)
                polled += n
        assert polled > 300
