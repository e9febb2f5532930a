"""``cq.poll_rows`` where one backend's own rules show. The cross-backend cases (the twin
run against ``poll_into``, error and flush completions, the three polls mixed,
``num_entries``, misuse) are in ``tests/api/test_poll_rows.py``, which the API suite runs
on every backend, rdma-core in the guest included.

Here: after a CQ overrun of the built-in engine, ``poll_rows`` is EOVERFLOW on both its
engines; on the native engine the row is C's ``rs_wc``, polled straight into the buffer;
rdma-core's conversion from ``ibv_wc`` is checked without a device, through a function
standing in for ``ibv_poll_cq``; and ``examples/poll_rows.py`` runs as docs/verbs.md
quotes it.
"""

from __future__ import annotations

import errno
import socket
import struct
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import pytest
import trio
from api.support import SIG, TIMEOUT, Cm, Row, queued_receives, row_of, rows_of
from test_resources import connected, post_receives

from rdmashim import (
    WC_ROW,
    Access,
    SendWR,
    VerbsError,
    WCArray,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import EventChannel
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.completion import CQ
from rdmashim.providers.softiwarp import engines, native

ROOT = Path(__file__).resolve().parent.parent
SIZE = WC_ROW.size
FIELDS = ("wr_id", "status", "opcode", "byte_len", "qp_num", "wc_flags", "invalidated_rkey",
          "solicited")  # fmt: skip


# ------------------------------------------------------------------------------ overrun
async def test_after_an_overrun_poll_rows_is_eoverflow(each_engine: str) -> None:
    """As ``poll`` and ``poll_into`` (``tests/test_batch_softiwarp.py``)."""
    async with connected(prepare=post_receives(8), cqe=4) as pair:
        client = pair.client
        src = client.pd.reg_mr(b"overrun!", Access(0))
        client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge()], SIG) for i in range(8)])
        with trio.fail_after(TIMEOUT):
            await client.context.get_async_event()  # CQ_ERR
        for poll in (lambda: client.send_cq.poll_into(WCArray(4)),
                     lambda: client.send_cq.poll_rows(bytearray(4 * SIZE))):  # fmt: skip
            with pytest.raises(VerbsError) as info:
                poll()
            assert info.value.errno == errno.EOVERFLOW


# ------------------------------------------------------------------------------ native engine
needs_native = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"native engine unavailable: {native.WHY_NOT}"
)


@needs_native
def test_the_row_is_the_native_engines_rs_wc() -> None:
    """Size and every field's offset are C's (``ffi.sizeof``/``ffi.offsetof``)."""
    ffi = native.ffi
    assert SIZE == ffi.sizeof("rs_wc") == 40
    assert WC_ROW.format in ("@QIIIIIII4x", b"@QIIIIIII4x")
    codes = "QIIIIIII"
    offsets = [struct.calcsize("@" + codes[:k]) for k in range(len(codes))]
    assert offsets == [ffi.offsetof("rs_wc", f) for f in FIELDS]
    assert [struct.calcsize("@" + c) for c in codes] == [
        ffi.sizeof(ffi.typeof("rs_wc").fields[k][1].type) for k in range(len(FIELDS))
    ]


@needs_native
async def test_native_polls_into_the_buffer_it_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer's pointer is made once and reused while the same buffer comes again;
    the CQ holds the buffer meanwhile (a bytearray cannot be resized) and lets it go for
    another one and at close; an unaligned buffer gets the same rows (C polls into the
    CQ's scratch and they are copied)."""
    monkeypatch.setenv(engines.ENV_ENGINE, "native")
    async with EventChannel() as channel:
        cm = Cm(channel)
        pair = await cm.pair()
        n = 9
        cq = await queued_receives(pair, n)
        first = bytearray(2 * SIZE)
        got: list[Row] = []
        assert cq.poll_rows(first) == 2
        got += rows_of(first, 2)
        assert len(cq) == n - 2  # (the CQ's count follows C's)
        made = cq._row_ptr
        assert cq.poll_rows(first) == 2
        got += rows_of(first, 2)
        assert cq._row_ptr is made and cq._row_direct  # the same buffer: its pointer kept
        with pytest.raises(BufferError):
            first.extend(b"x")  # held by the CQ
        odd = memoryview(bytearray(1 + 3 * SIZE))[1:]
        assert cq.poll_rows(odd) == 3
        got += rows_of(odd, 3)
        assert cq._row_ptr is not made and not cq._row_direct
        first.extend(b"x")  # let go
        last = bytearray(4 * SIZE)
        assert cq.poll_rows(last) == 2
        got += rows_of(last, 2)
        qp = pair.server.qp.qp_num
        assert got == [(i, 0, int(WCOpcode.RECV), i, qp, 0, 0, 0) for i in range(n)]
        cq.close()
        last.extend(b"x")  # let go at close


# ------------------------------------------------------------------------------ rdma-core
class _Context:
    """What a rdma-core CQ tells of a failed completion (``_qp_failed``), recorded."""

    def __init__(self) -> None:
        self.failed: list[tuple[int, str]] = []

    def _qp_failed(self, qp_num: int, why: Exception) -> None:
        self.failed.append((qp_num, str(why)))


def _fake_cq(entries: list[dict[str, int]]) -> Any:
    """A rdma-core CQ without a device: ``ibv_poll_cq`` is a function that hands out
    ``entries`` (``struct ibv_wc`` fields) in order."""
    queue = deque(entries)

    def poll_cq(_cq: Any, n: int, out: Any) -> int:
        k = 0
        while queue and k < n:
            for name, value in {**_ZERO_WC, **queue.popleft()}.items():
                setattr(out[k], name, value)
            k += 1
        return k

    cq = CQ.__new__(CQ)
    cq.context = _Context()
    cq._closed = False
    cq._ptr = None
    cq._poll_cq = poll_cq
    cq._buffer = deque()
    cq._wc = ffi.new("struct ibv_wc[]", 16)
    cq._row_wcs = None
    return cq


_ZERO_WC = dict.fromkeys(
    ("wr_id", "status", "opcode", "vendor_err", "byte_len", "imm_data", "qp_num", "src_qp",
     "wc_flags"), 0
)  # fmt: skip
"""Every field of a ``struct ibv_wc`` this backend reads (the entry a poll reuses)."""


INV, IMM = int(WCFlags.WITH_INV), int(WCFlags.WITH_IMM)
IBV_WCS: list[dict[str, int]] = [
    {"wr_id": 1, "status": 0, "opcode": 128, "byte_len": 77, "qp_num": 5},
    {"wr_id": 2**64 - 1, "status": 0, "opcode": 0, "byte_len": 0, "qp_num": 5},
    {"wr_id": 3, "status": 0, "opcode": 128, "byte_len": 9, "qp_num": 6,
     "wc_flags": INV, "invalidated_rkey": 0x1234_5678},
    {"wr_id": 4, "status": 0, "opcode": 129, "byte_len": 4, "qp_num": 6,
     "wc_flags": IMM, "imm_data": socket.htonl(0xCAFE)},
    {"wr_id": 5, "status": 0, "opcode": 128, "byte_len": 1, "qp_num": 6,
     "wc_flags": 0x30 | INV | 1, "invalidated_rkey": 7},  # bits past 0xF: not ours
    {"wr_id": 6, "status": 0, "opcode": 7, "byte_len": 2, "qp_num": 5},  # an opcode not ours
    {"wr_id": 7, "status": int(WCStatus.REM_ACCESS_ERR), "opcode": 2, "qp_num": 5},
    {"wr_id": 8, "status": int(WCStatus.WR_FLUSH_ERR), "opcode": 0x85, "qp_num": 6},
    {"wr_id": 9, "status": 99, "opcode": 77, "qp_num": 5},  # unknown: GENERAL_ERR, SEND
    {"wr_id": 10, "status": 0, "opcode": 1, "byte_len": 3, "qp_num": 5},
]  # fmt: skip


@pytest.mark.parametrize("size", [1, 3, 16])
def test_rdmacore_rows_are_its_poll_into(size: int) -> None:
    """rdma-core's rows from ``ibv_wc`` (a function standing in for ``ibv_poll_cq``)
    are what ``poll_into`` decodes of the same entries, polled ``size`` at a time:
    flags past ours masked, the invalidated rkey only with WITH_INV, no immediate data,
    unknown statuses and opcodes as ``decode_wc`` makes them; an error tells the
    context as ``poll_into`` does; completions a ``len()`` took first come first."""
    rows_cq, array_cq = _fake_cq(IBV_WCS), _fake_cq(IBV_WCS)
    try:
        rows, wcs = bytearray(size * SIZE), WCArray(size)
        by_rows_: list[Row] = []
        by_array_: list[Row] = []
        while k := rows_cq.poll_rows(rows):
            by_rows_ += rows_of(rows, k)
        while k := array_cq.poll_into(wcs):
            by_array_ += [row_of(wcs[i]) for i in range(k)]
        assert by_rows_ == by_array_
        assert rows_cq.context.failed == array_cq.context.failed
        assert [wr for _, wr in array_cq.context.failed] == [
            "work request 7 REM_ACCESS_ERR", "work request 8 WR_FLUSH_ERR",
            "work request 9 GENERAL_ERR",
        ]  # fmt: skip
        s, op = int(WCStatus.SUCCESS), WCOpcode
        assert by_rows_ == [
            (1, s, op.RECV, 77, 5, 0, 0, 0),
            (2**64 - 1, s, op.SEND, 0, 5, 0, 0, 0),
            (3, s, op.RECV, 9, 6, INV, 0x1234_5678, 0),
            (4, s, op.RECV_RDMA_WITH_IMM, 4, 6, IMM, 0, 0),
            (5, s, op.RECV, 1, 6, INV | 1, 7, 0),
            (6, s, op.SEND, 2, 5, 0, 0, 0),
            (7, WCStatus.REM_ACCESS_ERR, op.RDMA_READ, 0, 5, 0, 0, 0),
            (8, WCStatus.WR_FLUSH_ERR, op.RECV, 0, 6, 0, 0, 0),
            (9, WCStatus.GENERAL_ERR, op.SEND, 0, 5, 0, 0, 0),
            (10, s, op.RDMA_WRITE, 3, 5, 0, 0, 0),
        ]
        # Completions taken into the CQ's own queue (by len() or wait()) come first.
        mixed = _fake_cq(IBV_WCS)
        mixed._poll_native(4)
        assert len(mixed._buffer) == 4
        rows = bytearray(6 * SIZE)
        assert mixed.poll_rows(rows) == 6
        assert rows_of(rows, 6) == by_array_[:6]
        assert mixed.poll_rows(rows, 2) == 2 and rows_of(rows, 2) == by_array_[6:8]
        mixed._closed = True
    finally:
        rows_cq._closed = array_cq._closed = True


def test_rdmacore_poll_cq_failing_fails_poll_rows_as_poll_into() -> None:
    cq = _fake_cq([])
    cq._poll_cq = lambda _cq, _n, _out: -1
    try:
        with pytest.raises(VerbsError) as a:
            cq.poll_into(WCArray(2))
        with pytest.raises(VerbsError) as b:
            cq.poll_rows(bytearray(2 * SIZE))
        assert a.value.errno == b.value.errno == errno.EIO
    finally:
        cq._closed = True


# ------------------------------------------------------------------------------ the example
def test_the_example_runs_and_the_page_quotes_it() -> None:
    """``examples/poll_rows.py`` as a user runs it; docs/verbs.md quotes it as it is."""
    example = ROOT / "examples" / "poll_rows.py"
    out = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        "received 32 messages as rows, each its own length, in order: True"
    ]
    page = (ROOT / "docs" / "verbs.md").read_text()
    section = page.split("## Completions as rows", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```python\n")[1:]
    assert blocks, "docs/verbs.md has no example under 'Completions as rows'"
    source = example.read_text()
    for block in blocks:
        assert block.split("```", 1)[0] in source
