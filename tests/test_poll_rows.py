"""``cq.poll_rows``: a poll's completions as ``WC_ROW`` rows in the caller's buffer, on every
backend this machine runs: the built-in engine's native and Python engines, IBAL over the
built-in engine, and rdma-core where it has a device (skipped, naming why, where not;
the conversion from ``ibv_wc`` is also checked here without a device, through a function
standing in for ``ibv_poll_cq``).

The same traffic polled by ``poll_rows`` gives, row by row and field by field, what
``poll_into`` gives of a twin run (and what the traffic posted says: wr_ids, opcodes,
lengths, statuses), error and flush completions included; the three polls mixed take
each completion once, in order; ``num_entries`` limits; misuse is EINVAL, naming the
problem. On the native engine the row is C's ``rs_wc``, polled straight into the buffer.
"""

from __future__ import annotations

import array
import errno
import socket
import struct
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from api.support import SIG, TIMEOUT, Cm, Pair, drain, is_linux_rxe, ok, pattern
from test_resources import connected, post_receives

from rdmashim import (
    WC_ROW,
    Access,
    RecvWR,
    SendFlags,
    SendWR,
    VerbsError,
    WCArray,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import CMEventType, EventChannel
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.completion import CQ
from rdmashim.providers.softiwarp import engines, native
from rdmashim.verbs.backend import load_backend

ROOT = Path(__file__).resolve().parent.parent
SIZE = WC_ROW.size
FIELDS = ("wr_id", "status", "opcode", "byte_len", "qp_num", "wc_flags", "invalidated_rkey",
          "solicited")  # fmt: skip
Row = tuple[Any, ...]

# ------------------------------------------------------------------------------ backends
BACKENDS = ["native", "python", "ibal", "rdmacore"]
"""``native``/``python``: the built-in engine with that engine; ``ibal``: the IBAL facade
over the built-in engine; ``rdmacore``: rdma-core over this machine's device."""


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The backend name to open devices and CM ids with (skipped, saying why, where the
    backend cannot run here)."""
    name = str(request.param)
    if name in ("native", "python"):
        if name == "native" and not native.AVAILABLE:
            pytest.skip(f"native engine unavailable: {native.WHY_NOT}")
        monkeypatch.setenv(engines.ENV_ENGINE, name)
        return "softiwarp"
    reason = load_backend(name).unavailable_reason()
    if reason:
        pytest.skip(f"{name} backend unavailable here: {reason}")
    return name


@pytest.fixture
async def cm(backend: str) -> AsyncIterator[Cm]:
    """The shared API suite's CM (``tests/api/support.py``) on ``backend``."""
    async with EventChannel(backend=backend) as channel:
        yield Cm(channel)


def solicited_reported(backend: str) -> bool:
    """Whether the backend's completions say a Send was solicited (``struct ibv_wc`` and
    IBAL's ``ib_wc_t`` do not; the built-in engine does)."""
    return backend == "softiwarp"


# ------------------------------------------------------------------------------ polling
def rows_of(rows: Any, n: int) -> list[Row]:
    """Rows ``0..n-1`` of a buffer, decoded."""
    return [WC_ROW.unpack_from(rows, i * SIZE) for i in range(n)]


def row_of(wc: Any) -> Row:
    """What a row of ``wc`` holds (the enums and the bool as ints)."""
    return (wc.wr_id, int(wc.status), int(wc.opcode), wc.byte_len, wc.qp_num,
            int(wc.wc_flags), wc.invalidated_rkey, int(wc.solicited))  # fmt: skip


def by_rows(cq: Any) -> list[Row]:
    """What one ``poll_rows`` into a 3-row buffer takes (a poll may take part of what is
    queued)."""
    rows = bytearray(3 * SIZE)
    return rows_of(rows, cq.poll_rows(rows))


def by_array(cq: Any) -> list[Row]:
    """What one ``poll_into`` a 3-entry array takes."""
    wcs = WCArray(3)
    return [row_of(wcs[i]) for i in range(cq.poll_into(wcs))]


async def collect(cq: Any, n: int, take: Callable[[Any], list[Row]]) -> list[Row]:
    """At least ``n`` completions, taken by ``take`` as they come (polled: no wait takes
    any); the last poll may take more."""
    got: list[Row] = []
    with trio.fail_after(TIMEOUT):
        while len(got) < n:
            new = take(cq)
            if not new:
                await trio.sleep(0.002)
            got += new
    return got


def named(rows: list[Row], pair: Pair) -> list[Row]:
    """``rows`` with their QP number replaced by the side it names (twin runs differ in
    nothing else)."""
    sides = {pair.client.qp.qp_num: "client", pair.server.qp.qp_num: "server"}
    return [(*r[:4], sides.get(r[4], r[4]), *r[5:]) for r in rows]


async def queued_receives(pair: Pair, n: int) -> Any:
    """The server's receive CQ once it holds the completions of ``n`` Sends, Send ``i``
    ``i`` bytes into receive ``i`` (none taken yet)."""
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(16 * n), n, 16)
    src = client.reg(pattern(16, 5))
    client.qp.post_send([SendWR(i, WROpcode.SEND, [src.sge(0, i)], SIG) for i in range(n)])
    ok(await drain(client.send_cq, n))
    cq = server.recv_cq
    with trio.fail_after(TIMEOUT):
        while len(cq) < n:  # noqa: ASYNC110 (polled: nothing may be taken yet)
            await trio.sleep(0.005)
    return cq


# ------------------------------------------------------------------------------ the traffic
SENDS = 8
SOLICITED = {1, 4, 7}


async def traffic(cm: Cm, take: Callable[[Any], list[Row]]) -> tuple[list[Row], list[Row]]:
    """Sends (some solicited), an RDMA Write and Read, then a Send too long for its
    receive (an error at the server, the connection ends, the receive behind it is
    flushed): the client's send completions and the server's receive completions, as
    ``take`` polls them."""
    pair = await cm.pair()
    client, server = pair.client, pair.server
    server.post_recvs(server.reg(64 * SENDS), SENDS, 64, first_id=100)
    src = client.reg(pattern(64, 3))
    target = server.reg(64)
    sink = client.reg(64)
    client.qp.post_send(
        [
            SendWR(i, WROpcode.SEND, [src.sge(0, 3 * i)],
                   SIG | (SendFlags.SOLICITED if i in SOLICITED else SendFlags.NONE))
            for i in range(SENDS)
        ]
        + [
            SendWR(20, WROpcode.RDMA_WRITE, [src.sge(0, 16)], SIG, target.addr, target.rkey),
            SendWR(21, WROpcode.RDMA_READ, [sink.sge(0, 32)], SIG, target.addr, target.rkey),
        ]
    )  # fmt: skip
    sent = await collect(client.send_cq, SENDS + 2, take)
    received = await collect(server.recv_cq, SENDS, take)
    # An error and a flush: a 40-byte Send into an 8-byte receive ends the connection
    # (as tests/api/test_errors.py's: on InfiniBand once the error is polled); the
    # receive behind it is flushed.
    short, spare = server.reg(8), server.reg(64)
    server.qp.post_recv([RecvWR(200, [short.sge()]), RecvWR(201, [spare.sge()])])
    client.qp.post_send(SendWR(30, WROpcode.SEND, [src.sge(0, 40)], SIG))
    failed = await collect(server.recv_cq, 1, take)
    for end in (client, server):
        await pair.events.expect(end.id, CMEventType.DISCONNECTED)
    for end in (client, server):
        end.id.disconnect()
    received += failed + await collect(server.recv_cq, 2 - len(failed), take)
    assert len(sent) == SENDS + 2 and len(received) == SENDS + 2
    return named(sent, pair), named(received, pair)


async def test_rows_are_what_poll_into_gives(cm: Cm, backend: str) -> None:
    """A twin run of the same traffic polled by ``poll_into`` gives the same completions,
    field by field; both are what the traffic posted says."""
    rows_sent, rows_received = await traffic(cm, by_rows)
    array_sent, array_received = await traffic(cm, by_array)
    assert rows_sent == array_sent
    assert rows_received == array_received
    sol = solicited_reported(backend)
    rxe = is_linux_rxe(await cm.device_attr())
    grh = int(WCFlags.GRH) if rxe else 0  # (RoCE: every receive has a GRH)
    ops = [WCOpcode.SEND] * SENDS + [WCOpcode.RDMA_WRITE, WCOpcode.RDMA_READ]
    assert [(r[0], r[1], r[2], r[4], r[5]) for r in rows_sent] == [
        (wr_id, WCStatus.SUCCESS, op, "client", 0)
        for wr_id, op in zip([*range(SENDS), 20, 21], ops, strict=True)
    ]
    assert rows_received[:SENDS] == [
        (100 + i, 0, WCOpcode.RECV, 3 * i, "server", grh, 0, int(sol and i in SOLICITED))
        for i in range(SENDS)
    ]
    failed, flushed = rows_received[SENDS:]
    statuses = {WCStatus.LOC_LEN_ERR}
    if rxe:
        statuses.add(WCStatus.LOC_QP_OP_ERR)  # (rxe's way: tests/api/test_errors.py)
    assert failed[0] == 200 and failed[1] in statuses and failed[4] == "server", failed
    assert (flushed[0], flushed[1], flushed[4]) == (201, WCStatus.WR_FLUSH_ERR, "server")


async def test_polls_mixed_take_each_completion_once_in_order(cm: Cm) -> None:
    """``poll_rows``, ``poll`` and ``poll_into`` in turn on one CQ: each completion taken
    once, in order; ``num_entries`` limits (0 or below takes none, more than fit takes
    what fits); rows past those taken keep what they held."""
    pair = await cm.pair()
    n = 12
    cq = await queued_receives(pair, n)
    rows = bytearray(b"\xab" * 4 * SIZE)
    for none in (0, -1, -100):
        assert cq.poll_rows(rows, none) == 0
    assert rows == b"\xab" * 4 * SIZE
    got: list[Row] = []
    assert cq.poll_rows(rows, 2) == 2
    got += rows_of(rows, 2)
    assert rows[2 * SIZE :] == b"\xab" * 2 * SIZE  # untouched
    got += [row_of(w) for w in cq.poll(1)]
    got += by_array(cq)  # 3
    assert cq.poll_rows(rows) == 4  # as many as fit
    got += rows_of(rows, 4)
    got += [row_of(w) for w in cq.poll(1)]
    assert cq.poll_rows(rows, 100) == 1  # the last one
    got += rows_of(rows, 1)
    assert cq.poll_rows(rows) == 0 and cq.poll(4) == [] and cq.poll_into(WCArray(4)) == 0
    assert len(cq) == 0
    qp = pair.server.qp.qp_num
    grh = int(WCFlags.GRH) if is_linux_rxe(await cm.device_attr()) else 0
    assert got == [(i, 0, int(WCOpcode.RECV), i, qp, grh, 0, 0) for i in range(n)]


async def test_misuse_is_einval_naming_the_problem(cm: Cm) -> None:
    """A buffer that is not one to write rows into is refused (EINVAL, the message says
    why) and takes nothing; any writable contiguous buffer of a row or more is taken
    (of any item type or shape, at any address); a closed CQ refuses as ``poll_into``."""
    pair = await cm.pair()
    cq = await queued_receives(pair, 3)
    for rows, problem in [
        (bytes(4 * SIZE), "read-only"),
        (memoryview(bytearray(8 * SIZE))[::2], "C-contiguous"),
        (bytearray(SIZE - 1), "less than one 40-byte row"),
        (12, "writable buffer, not int"),
        ([0] * SIZE, "writable buffer, not list"),
    ]:
        with pytest.raises(VerbsError) as info:
            cq.poll_rows(rows)
        assert info.value.errno == errno.EINVAL and problem in str(info.value), info.value
    taken: list[Row] = []
    for rows in [
        array.array("Q", bytes(SIZE)),
        memoryview(bytearray(2 * SIZE + 1))[1:],
        memoryview(bytearray(2 * SIZE)).cast("B", [2, SIZE]),
    ]:
        taken += rows_of(rows, cq.poll_rows(rows, 1))
    assert [(r[0], r[3]) for r in taken] == [(0, 0), (1, 1), (2, 2)]  # nothing was lost
    spare = pair.server.ctx.create_cq(4)
    spare.close()
    with pytest.raises(VerbsError) as a:
        spare.poll_into(WCArray(1))
    with pytest.raises(VerbsError) as b:
        spare.poll_rows(bytearray(SIZE))
    assert a.value.errno == b.value.errno


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
