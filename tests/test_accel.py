"""The compiled kernels (``_accel``) against the Python reference (``kernels.py``): the
same bytes, placements, completions and stop offsets for random batches of Sends and
random, flawed and hostile received streams; the loader's switch; and the API suite
on the Python kernels in a child process (the main run uses the compiled ones)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from crc32c import crc32c
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_engine_small_sends import FLAWED_RUNS
from test_engine_small_sends import _run as run_small_sends

from rdmashim.providers.softiwarp import ddp, fastpath
from rdmashim.providers.softiwarp.ddp import (
    CTRL_READ_RESPONSE,
    CTRL_WRITE,
    MAX_SEND_PAYLOAD,
    MAX_TAGGED_PAYLOAD,
    QN,
    Opcode,
)
from rdmashim.providers.softiwarp.kernels import (
    MSG_WORDS,
    SEND_CTRLS,
    SPAN,
    Kernels,
    PyKernels,
    Targets,
)
from rdmashim.providers.softiwarp.memory import Region
from rdmashim.verbs.enums import Access

REPO = Path(__file__).resolve().parents[1]
PY: Kernels = PyKernels()
_U32 = st.integers(0, 0xFFFFFFFF)


@pytest.fixture(scope="module")
def c() -> Kernels:
    if fastpath.COMPILED is None:
        pytest.skip(f"compiled kernels unavailable: {fastpath.WHY_NOT}")
    return fastpath.COMPILED


# ---------------------------------------------------------------- CRC32c
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), value=_U32, skip=st.integers(0, 7))
def test_crc32c_matches_the_package(c: Kernels, data: bytes, value: int, skip: int) -> None:
    from rdmashim.providers.softiwarp._accel import ffi, lib

    view = memoryview(data)[skip:]  # every alignment
    expected = crc32c(view, value)
    assert c.crc32c(view, value) == expected == PY.crc32c(view, value)
    raw = ffi.from_buffer("uint8_t[]", view)
    assert lib.rs_crc32c_sw(value, raw, len(raw)) == expected  # the table, with or without SSE4.2


def test_crc32c_across_the_lengths_of_each_method(c: Kernels) -> None:
    # The instruction's three lanes (384 and 6144 bytes a round) and the vector fold (from
    # 512 bytes, 256 a round, then 16 at a time, then the instruction): every length
    # around their steps, at odd alignments, continuing from a value.
    rng = random.Random(5)
    data = rng.randbytes(16384)
    lengths = [*range(370, 800), *range(6100, 6200), 12288 - 1, 12288, 12288 + 17, 16379]
    for n in lengths:
        skip = rng.randrange(8)
        view = memoryview(data)[skip : skip + n]
        value = rng.getrandbits(32)
        assert c.crc32c(view, value) == crc32c(view, value), (n, skip)


def test_crc32c_of_a_large_buffer(c: Kernels) -> None:
    data = random.Random(3).randbytes(1 << 20)
    assert c.crc32c(data) == crc32c(data)
    assert c.crc32c(memoryview(data)[5:], 0x12345678) == crc32c(memoryview(data)[5:], 0x12345678)


# ---------------------------------------------------------------- TX framing
_SEND = st.tuples(st.binary(max_size=100), st.sampled_from(sorted(SEND_CTRLS)), _U32)


@settings(max_examples=200, deadline=None)
@given(sends=st.lists(_SEND, max_size=20), msn=_U32, crc=st.booleans())
def test_frame_sends_matches_the_reference_and_the_codec(
    c: Kernels, sends: list[tuple[bytes, int, int]], msn: int, crc: bool
) -> None:
    data = b"".join(p for p, _, _ in sends)
    lens = [len(p) for p, _, _ in sends]
    ctrls = bytes(ctrl for _, ctrl, _ in sends)
    invs = [inv for _, _, inv in sends]
    framed = bytes(c.frame_sends(data, lens, ctrls, invs, msn, crc))
    assert framed == bytes(PY.frame_sends(memoryview(data), lens, ctrls, invs, msn, crc))
    codec = b""
    for i, (payload, ctrl, inv) in enumerate(sends):
        header = ddp.encode_untagged(
            Opcode(ctrl & 0xF), True, QN.SEND, (msn + i) & 0xFFFFFFFF, 0, len(payload), inv
        )
        codec += b"".join(bytes(b) for b in ddp.encode_fpdu(header, [payload], crc=crc))
    assert framed == codec


@pytest.mark.parametrize(
    ("payload_len", "ctrl"),
    [
        (MAX_SEND_PAYLOAD + 1, ddp.RDMAP_VERSION | Opcode.SEND),
        (4, ddp.RDMAP_VERSION | Opcode.WRITE),
        (4, ddp.RDMAP_VERSION | Opcode.TERMINATE),
        (4, Opcode.SEND),  # RDMAP version 0
    ],
)
def test_frame_sends_refuses_what_is_not_a_one_fpdu_send(
    c: Kernels, payload_len: int, ctrl: int
) -> None:
    data = b"ok" + bytes(payload_len)
    for kernels in (c, PY):
        with pytest.raises(ValueError, match="not a one-FPDU Send"):
            kernels.frame_sends(data, [2, payload_len], bytes([0x43, ctrl]), [0, 0], 1, True)
        with pytest.raises(ValueError):  # lengths that do not add up to the data
            kernels.frame_sends(b"ok" * 3, [2, 2], b"\x43\x43", [0, 0], 1, True)
    largest = bytes(MAX_SEND_PAYLOAD)
    assert c.frame_sends(largest, [len(largest)], b"\x43", [7], 1, True) == PY.frame_sends(
        largest, [len(largest)], b"\x43", [7], 1, True
    )


# ---------------------------------------------------------------- flawed streams
def _framed(header: bytes | bytearray, payload: bytes, crc: bool, flaw: str) -> bytearray:
    """One FPDU (from the codec) of ``header`` and ``payload``, with ``flaw`` if it is one
    of its framing: a bad CRC, a flipped payload byte, an ULPDU length too short or too
    long (the header's own length says where the payload starts)."""
    fpdu = bytearray(b"".join(bytes(b) for b in ddp.encode_fpdu(bytes(header), [payload], crc=crc)))
    if flaw == "bad_crc":
        fpdu[-1] ^= 0x80
    if flaw == "payload_flip" and payload:
        fpdu[len(header)] ^= 1
    if flaw == "short_ulpdu":
        fpdu[0:2] = (len(header) - 3).to_bytes(2, "big")
    if flaw == "long_ulpdu":
        fpdu[0:2] = (0xFFFF).to_bytes(2, "big")
    return fpdu


def _cut(out: bytearray, flaw: str, cut: int) -> bytes:
    """The stream, its last ``cut`` bytes gone if ``flaw`` is "truncated"."""
    if flaw == "truncated":
        del out[max(0, len(out) - cut) :]
    return bytes(out)


# ---------------------------------------------------------------- RX scan
_SCAN_FLAWS = [
    "none", "bad_crc", "payload_flip", "wrong_msn", "not_last", "qn", "mo", "inv", "tagged",
    "ddp_version", "rdmap_version", "short_ulpdu", "long_ulpdu", "truncated", "reserved",
]  # fmt: skip


def _stream(
    sizes: list[int], se: list[bool], msn: int, crc: bool, flaw: str, at: int, cut: int
) -> bytes:
    """FPDUs of Sends (from the codec), the one at ``at`` given the flaw."""
    out = bytearray()
    for i, size in enumerate(sizes):
        payload = bytes((i * 31 + k) & 0xFF for k in range(size))
        op = Opcode.SEND_SE if se[i % len(se)] else Opcode.SEND
        qn, mo, last, this_msn = QN.SEND, 0, True, (msn + i) & 0xFFFFFFFF
        hit = i == at
        if hit and flaw == "wrong_msn":
            this_msn = (this_msn + 1) & 0xFFFFFFFF
        if hit and flaw == "not_last":
            last = False
        if hit and flaw == "qn":
            qn = QN.READ_REQUEST
        if hit and flaw == "mo":
            mo = 1
        if hit and flaw == "inv":
            op = Opcode.SEND_INV
        header = bytearray(ddp.encode_untagged(op, last, qn, this_msn, mo, size))
        if hit and flaw == "tagged":
            header[2] |= ddp.DDP_TAGGED
        if hit and flaw == "ddp_version":
            header[2] ^= 0x03
        if hit and flaw == "rdmap_version":
            header[3] ^= 0xC0
        if hit and flaw == "reserved":
            header[2] |= 0x04
        out += _framed(header, payload, crc, flaw if hit else "none")
    return _cut(out, flaw, cut)


def _scan_both(c: Kernels, buf: bytes, start: int, end: int, msn: int, crc: bool):
    stop, msgs = c.scan_sends(buf, start, end, msn, crc)
    assert (stop, list(msgs)) == PY.scan_sends(buf, start, end, msn, crc)
    assert len(msgs) % MSG_WORDS == 0
    return stop, msgs


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70), min_size=1, max_size=10),
    se=st.lists(st.booleans(), min_size=1, max_size=4),
    msn=st.one_of(_U32, st.integers(0xFFFFFFF0, 0xFFFFFFFF)),
    crc=st.booleans(),
    flaw=st.sampled_from(_SCAN_FLAWS),
    at=st.integers(0, 9),
    cut=st.integers(1, 40),
    lead=st.binary(max_size=9),
    tail=st.binary(max_size=30),
)
def test_scan_matches_the_reference(
    c: Kernels, sizes: list[int], se: list[bool], msn: int, crc: bool, flaw: str, at: int,
    cut: int, lead: bytes, tail: bytes,
) -> None:  # fmt: skip
    body = _stream(sizes, se, msn, crc, flaw, at, cut)
    buf = lead + body + tail
    stop, msgs = _scan_both(c, buf, len(lead), len(lead) + len(body), msn, crc)
    found = len(msgs) // MSG_WORDS
    crc_only = flaw in ("bad_crc", "payload_flip")
    if flaw == "none" or at >= len(sizes) or (crc_only and not crc):
        if flaw != "truncated":
            assert (found, stop) == (len(sizes), len(lead) + len(body))
    elif flaw != "truncated" and not (flaw == "payload_flip" and not sizes[at]):
        assert found == at
    for k in range(found):
        off, length, solicited = msgs[k * MSG_WORDS : (k + 1) * MSG_WORDS]
        if not (flaw == "payload_flip" and k == at):
            assert buf[off : off + length] == bytes((k * 31 + j) & 0xFF for j in range(length))
        assert solicited == int(se[k % len(se)])
    # Any window of the same bytes, including ones that cut an FPDU.
    for start, end in ((0, len(buf)), (len(lead), len(buf) - 1), (len(lead) + 1, len(buf))):
        _scan_both(c, buf, start, end, msn, crc)


@pytest.mark.parametrize("flaw", ["none", "bad_crc", "payload_flip", "truncated"])
@pytest.mark.parametrize("at", [0, 2])
def test_place_tagged_of_long_payloads_matches_the_reference(
    c: Kernels, flaw: str, at: int
) -> None:
    # Payloads from FOLD_MIN (512) on take the copying CRC pass: a bad CRC is placed
    # there, then stops the run, in both kernels.
    sizes = [511, 512, 4099, 65000]
    for ctrl, in_order in ((CTRL_WRITE, False), (CTRL_READ_RESPONSE, True)):
        body = _tagged_stream(sizes, ctrl, 0x1234, 0x10000, True, flaw, at, 9)
        (stop, _, _), placed = _place_tagged_both(
            c, body, 0, len(body), ctrl, 0x1234, 0x10000, sum(sizes), 0, True, in_order
        )
        whole = sizes if flaw == "none" else sizes[:at]
        expected = b"".join(
            bytes((i * 13 + k) & 0xFF for k in range(n)) for i, n in enumerate(whole)
        )
        assert placed[: len(expected)] == expected
        assert (stop == len(body)) == (flaw == "none")


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=400),
    msn=_U32,
    crc=st.booleans(),
    start=st.integers(-2, 420),
    end=st.integers(-2, 420),
)
def test_scan_of_hostile_bytes_matches_the_reference(
    c: Kernels, data: bytes, msn: int, crc: bool, start: int, end: int
) -> None:
    stop, msgs = _scan_both(c, data, start, end, msn, crc)
    if not 0 <= start <= end <= len(data):
        assert (stop, msgs) == (start, [])


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    crc=st.booleans(),
    edits=st.lists(st.tuples(st.integers(0, 10000), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_scan_of_mutated_streams_matches_the_reference(
    c: Kernels, sizes: list[int], crc: bool, edits: list[tuple[int, int]]
) -> None:
    buf = bytearray(_stream(sizes, [False, True], 5, crc, "none", -1, 0))
    for pos, value in edits:
        buf[pos % len(buf)] = value
    _scan_both(c, bytes(buf), 0, len(buf), 5, crc)


# ---------------------------------------------------------------- RX placement
def _regions(count: int, size: int) -> list[Region]:
    return [
        Region(i + 1, 0x1000 * (i + 1), size, Access.LOCAL_WRITE, None, memoryview(bytearray(size)))
        for i in range(count)
    ]


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=8),
    splits=st.lists(st.lists(st.integers(0, 70), max_size=3), min_size=8, max_size=8),
    offsets=st.lists(st.integers(0, 140), min_size=24, max_size=24),
    extra=st.integers(-2, 2),
)
def test_place_matches_the_reference(
    c: Kernels, sizes: list[int], splits: list[list[int]], offsets: list[int], extra: int
) -> None:
    """Random segment layouts (some out of bounds, too short, or fewer than the
    messages): the same bytes placed, or the same ValueError after the same prefix."""
    buf = _stream(sizes, [True], 1, True, "none", -1, 0)
    _, msgs = _scan_both(c, buf, 0, len(buf), 1, True)
    layouts = []
    for impl in (c, PY):
        regions = _regions(3, 128)
        targets = Targets()
        seg = 0
        for i in range(len(sizes)):
            parts = splits[i] or [sizes[i]]
            for n in parts:
                region = regions[seg % 3]
                targets.segments.append((impl.handle(region), region.length, offsets[seg % 24], n))
                seg += 1
            targets.nsegs.append(len(parts))
        if extra > 0:
            targets.nsegs[-1] += extra  # more segments than there are
        elif extra < 0:
            del targets.nsegs[extra:]  # fewer messages than scanned: fine
        try:
            impl.place(buf, msgs, targets)
            error = None
        except ValueError:
            error = ValueError
        layouts.append(([bytes(r.view) for r in regions], error))
    assert layouts[0] == layouts[1]


def test_place_refuses_msgs_outside_the_buffer(c: Kernels) -> None:
    for impl in (c, PY):
        (region,) = _regions(1, 64)
        targets = Targets([(impl.handle(region), 64, 0, 64)], [1])
        with pytest.raises(ValueError):
            impl.place(b"x" * 10, [8, 4, 0], targets)  # payload runs past the buffer
        with pytest.raises(ValueError):
            impl.place(b"x" * 10, [], targets)  # more targets than messages
        assert bytes(region.view) == bytes(64)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=12),
    offsets=st.lists(st.integers(0, 300), min_size=12, max_size=12),
    room=st.lists(st.integers(0, 70), min_size=12, max_size=12),
    cap=st.integers(0, 400),
    fewer=st.integers(0, 2),
)
def test_place_in_matches_the_reference(
    c: Kernels, sizes: list[int], offsets: list[int], room: list[int], cap: int, fewer: int
) -> None:
    """Messages into receives of one buffer at random offsets and sizes (some too short,
    some past the buffer): the same bytes placed, or the same ValueError with nothing
    placed."""
    buf = _stream(sizes, [True], 1, True, "none", -1, 0)
    _, msgs = _scan_both(c, buf, 0, len(buf), 1, True)
    count = max(0, len(sizes) - fewer)
    outcomes = []
    for impl in (c, PY):
        (region,) = _regions(1, cap)
        try:
            impl.place_in(buf, msgs, impl.handle(region), _spans(offsets[:count], room[:count]))
            error = None
        except ValueError:
            error = ValueError
        outcomes.append((bytes(region.view), error))
    assert outcomes[0] == outcomes[1]
    fits = all(
        sizes[i] <= room[i] and offsets[i] + room[i] <= cap for i in range(count)
    )  # fmt: skip
    assert (outcomes[0][1] is None) == fits
    assert fits or outcomes[0][0] == bytes(cap)  # all or nothing


@settings(max_examples=100, deadline=None)
@given(
    pieces=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 64), st.integers(0, 64)), max_size=70
    ),
)
def test_send_plan_gathers_as_the_reference(c: Kernels, pieces: list[tuple[int, int, int]]) -> None:
    """A plan's gather joins its pieces, read from the regions when used, not when
    planned."""
    rng = random.Random(len(pieces))
    views = [memoryview(bytearray(rng.randbytes(128))) for _ in range(3)]
    regions = [
        Region(i + 1, 0x1000 * (i + 1), 128, Access.LOCAL_WRITE, None, v)
        for i, v in enumerate(views)
    ]
    chosen = [regions[r] for r, _, _ in pieces]
    starts = [start for _, start, _ in pieces]
    lens = array("I", [n for _, _, n in pieces])
    plans = [(impl, impl.send_plan(chosen, starts, lens)) for impl in (c, PY)]
    for _ in range(2):
        expected = b"".join(regions[r].view[a : a + n] for r, a, n in pieces)
        for impl, plan in plans:
            assert bytes(impl.gather(plan)) == expected
        for view in views:  # the next round reads what the regions hold then
            view[:] = rng.randbytes(128)


def test_send_plan_refuses_arrays_of_different_lengths(c: Kernels) -> None:
    (region,) = _regions(1, 64)
    with pytest.raises(ValueError, match="differ in length"):
        c.send_plan([region], [0], array("I", [8, 8]))


def test_place_in_refuses_msgs_outside_the_buffer(c: Kernels) -> None:
    for impl in (c, PY):
        (region,) = _regions(1, 64)
        target = impl.handle(region)
        with pytest.raises(ValueError):
            impl.place_in(b"x" * 10, [8, 4, 0, 0, 1, 0], target, _spans([0, 8], [8, 8]))  # past buf
        with pytest.raises(ValueError):
            impl.place_in(b"x" * 10, [0, 1, 0], target, _spans([0, 8], [8, 8]))  # more than scanned
        with pytest.raises(ValueError):
            impl.place_in(b"x" * 10, [0, 1, 0], target, _spans([0], [8])[:-8])  # half a span
        assert bytes(region.view) == bytes(64)


def _spans(offs: list[int], lens: list[int]) -> bytes:
    """Receives as place_in takes them: (offset, length) pairs."""
    return b"".join(SPAN.pack(o, n) for o, n in zip(offs, lens, strict=True))


def test_deregistration_releases_the_compiled_handle(c: Kernels) -> None:
    """The compiled handle holds the region's buffer; deregistering drops it, so the
    buffer can be released (an MR's close does that)."""
    from rdmashim.providers.softiwarp.memory import MemoryTable

    table = MemoryTable()
    view = memoryview(bytearray(32))
    region = table.register(None, view, 0x1000, Access.LOCAL_WRITE)
    handle = c.handle(region)
    assert c.handle(region) is handle  # made once
    with pytest.raises(BufferError):
        view.release()
    del handle
    table.deregister(region)
    view.release()


# ---------------------------------------------------------------- tagged runs
_TAGGED_FLAWS = [
    "none", "bad_crc", "payload_flip", "stag", "ctrl", "below", "past_end", "gap", "early_last",
    "reserved", "untagged", "short_ulpdu", "long_ulpdu", "truncated",
]  # fmt: skip


def _tagged_stream(
    sizes: list[int], ctrl: int, stag: int, to: int, crc: bool, flaw: str, at: int, cut: int
) -> bytes:
    """Tagged FPDUs (from the codec) at consecutive TOs from ``to``, the last one with the
    last flag, the one at ``at`` given the flaw."""
    out = bytearray()
    for i, size in enumerate(sizes):
        payload = bytes((i * 13 + k) & 0xFF for k in range(size))
        hit = i == at
        at_to, this_stag, last = to, stag, i == len(sizes) - 1
        if hit and flaw == "stag":
            this_stag ^= 0x100
        if hit and flaw == "below":
            at_to -= 1
        if hit and flaw == "past_end":
            at_to += 1 << 20
        if hit and flaw == "gap":
            at_to += 1
        if hit and flaw == "early_last":
            last = True
        op = Opcode(ctrl & 0xF)
        header = bytearray(ddp.encode_tagged(op, last, this_stag, at_to % (1 << 64), size))
        if hit and flaw == "ctrl":
            header[3] ^= 0x02  # Write <-> Read Response
        if hit and flaw == "reserved":
            header[2] |= 0x08
        if hit and flaw == "untagged":
            header[2] &= ~ddp.DDP_TAGGED
        out += _framed(header, payload, crc, flaw if hit else "none")
        to += size
    return _cut(out, flaw, cut)


def _place_tagged_both(
    c: Kernels, buf: bytes, start: int, end: int, ctrl: int, stag: int, to: int, size: int,
    off: int, crc: bool, in_order: bool,
) -> tuple[tuple[int, int, bool], bytes]:  # fmt: skip
    """The same results and the same bytes placed from both kernels."""
    results = []
    for impl, wrap in ((c, True), (PY, True), (c, False)):
        target = bytearray(b"\xee" * size)
        region = Region(stag, to - off, size, Access.REMOTE_WRITE, None, memoryview(target))
        dst = impl.handle(region) if wrap else memoryview(target)
        try:
            got = impl.place_tagged(buf, start, end, ctrl, stag, to, dst, off, crc, in_order)
        except ValueError:
            got = None
        results.append((got, bytes(target)))
    assert results[0] == results[1] == results[2]
    return results[0]  # type: ignore[return-value]


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 90), min_size=1, max_size=10),
    read=st.booleans(),
    stag=_U32,
    to=st.one_of(st.integers(0, 1 << 40), st.integers((1 << 64) - 2000, (1 << 64) - 900)),
    crc=st.booleans(),
    flaw=st.sampled_from(_TAGGED_FLAWS),
    at=st.integers(0, 9),
    cut=st.integers(1, 40),
    lead=st.binary(max_size=9),
    off=st.integers(0, 5),
    spare=st.integers(-3, 9),
    in_order=st.booleans(),
)
def test_place_tagged_matches_the_reference(
    c: Kernels, sizes: list[int], read: bool, stag: int, to: int, crc: bool, flaw: str,
    at: int, cut: int, lead: bytes, off: int, spare: int, in_order: bool,
) -> None:  # fmt: skip
    ctrl = CTRL_READ_RESPONSE if read else CTRL_WRITE
    body = _tagged_stream(sizes, ctrl, stag, to, crc, flaw, at, cut)
    buf = lead + body + b"\0" * 5
    size = off + max(0, sum(sizes) + spare)
    if to + size - off > 1 << 64:
        return
    (stop, after, last), placed = _place_tagged_both(
        c, buf, len(lead), len(lead) + len(body), ctrl, stag, to, size, off, crc, in_order
    )
    if flaw == "none" and spare >= 0 and (spare == 0 or not in_order):
        assert stop == len(lead) + len(body)
        assert placed[off : off + sum(sizes)] == b"".join(
            bytes((i * 13 + k) & 0xFF for k in range(n)) for i, n in enumerate(sizes)
        )
        assert (after, last) == ((to + sum(sizes), True) if in_order else (to, False))
    for start, end in ((0, len(buf)), (len(lead) + 1, len(buf)), (len(lead), len(buf) - 7)):
        _place_tagged_both(c, buf, start, end, ctrl, stag, to, size, off, crc, in_order)


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=400),
    stag=st.sampled_from([0, 0x01020304, 0xFFFFFFFF]),
    to=st.sampled_from([0, 0x10, (1 << 64) - 64]),
    size=st.integers(0, 64),
    crc=st.booleans(),
    start=st.integers(-2, 420),
    end=st.integers(-2, 420),
    in_order=st.booleans(),
)
def test_place_tagged_of_hostile_bytes_matches_the_reference(
    c: Kernels, data: bytes, stag: int, to: int, size: int, crc: bool, start: int, end: int,
    in_order: bool,
) -> None:  # fmt: skip
    _place_tagged_both(c, data, start, end, CTRL_WRITE, stag, to, size, 0, crc, in_order)


def test_place_tagged_refuses_a_range_outside_its_target(c: Kernels) -> None:
    for impl in (c, PY):
        for ctrl, to, off in ((0x43, 0, 0), (CTRL_WRITE, 0, 9), (CTRL_WRITE, (1 << 64) - 4, 0)):
            with pytest.raises(ValueError):
                impl.place_tagged(
                    b"", 0, 0, ctrl, 1, to, memoryview(bytearray(8)), off, True, False
                )


@settings(max_examples=300, deadline=None)
@given(
    size=st.one_of(st.integers(0, 3000), st.integers(16000, 40000)),
    skip=st.integers(0, 7),
    read=st.booleans(),
    stag=_U32,
    to=st.one_of(st.integers(0, 1 << 40), st.just((1 << 64) - 40000)),
    chunk=st.one_of(  # the compiled kernels copy payloads up to COPY_MAX, slice longer ones
        st.integers(1, 300), st.integers(8190, 8195), st.just(MAX_TAGGED_PAYLOAD)
    ),
    last=st.booleans(),
    crc=st.booleans(),
)
@example(  # a run ending at the top of the TO space: the next TO is 2**64 on both kernels
    size=40000,
    skip=0,
    read=False,
    stag=1,
    to=(1 << 64) - 40000,
    chunk=MAX_TAGGED_PAYLOAD,
    last=True,
    crc=True,
)
def test_frame_tagged_matches_the_reference_and_the_codec(
    c: Kernels, size: int, skip: int, read: bool, stag: int, to: int, chunk: int, last: bool,
    crc: bool,
) -> None:  # fmt: skip
    ctrl = CTRL_READ_RESPONSE if read else CTRL_WRITE
    data = memoryview(random.Random(size).randbytes(size + skip))[skip:]
    framed = b"".join(bytes(b) for b in c.frame_tagged(data, ctrl, stag, to, chunk, last, crc))
    assert framed == b"".join(
        bytes(b) for b in PY.frame_tagged(data, ctrl, stag, to, chunk, last, crc)
    )
    pieces = [data[o : o + chunk] for o in range(0, size, chunk)] or [data[:0]]
    codec = b""
    for k, piece in enumerate(pieces):
        final = last and k == len(pieces) - 1
        header = ddp.encode_tagged(Opcode(ctrl & 0xF), final, stag, to + k * chunk, len(piece))
        codec += b"".join(bytes(b) for b in ddp.encode_fpdu(header, [piece], crc=crc))
    assert framed == codec
    # what frame_tagged gives, place_tagged takes back whole
    placed = _place_tagged_both(c, framed, 0, len(framed), ctrl, stag, to, size, 0, crc, last)
    assert placed[0][0] == len(framed)
    assert placed[1] == bytes(data)


@pytest.mark.parametrize(
    ("ctrl", "stag", "to", "chunk"),
    [(0x43, 0, 0, 100), (CTRL_WRITE, 1 << 32, 0, 100), (CTRL_WRITE, 0, (1 << 64) - 9, 100),
     (CTRL_WRITE, 0, 0, 0), (CTRL_WRITE, 0, 0, MAX_TAGGED_PAYLOAD + 1)],
)  # fmt: skip
def test_frame_tagged_refuses_what_is_not_a_tagged_run(
    c: Kernels, ctrl: int, stag: int, to: int, chunk: int
) -> None:
    for impl in (c, PY):
        with pytest.raises(ValueError, match="not a run of tagged FPDUs"):
            impl.frame_tagged(bytes(10), ctrl, stag, to, chunk, True, True)


# ---------------------------------------------------------------- engine
@settings(max_examples=100, deadline=None)
@given(**FLAWED_RUNS, whole=st.booleans())
def test_engine_on_both_kernels_gives_the_same_results(
    c: Kernels, crc: bool, sizes: list[int], flaw: str, at: int, whole: bool
) -> None:
    """Completions, placed bytes, state, error and Terminate of an engine fed a flawed
    run of small Sends are the same on the compiled and the Python kernels."""
    results = []
    for compiled in (True, False):
        before = fastpath.use(compiled)
        try:
            results.append(run_small_sends(crc, sizes, flaw, at, whole))
        finally:
            fastpath.restore(before)
    assert results[0] == results[1]


# ---------------------------------------------------------------- the loader, the fallback
def _child(code: str, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env={**os.environ, **env}, check=True,
    )  # fmt: skip
    return proc.stdout.strip()


def test_environment_variable_forces_the_fallback(c: Kernels) -> None:
    code = "from rdmashim.providers.softiwarp import fastpath; print(fastpath.describe())"
    assert _child(code, RDMASHIM_NO_EXTENSIONS="0").startswith("yes (C")
    assert _child(code, RDMASHIM_NO_EXTENSIONS="1") == "no (RDMASHIM_NO_EXTENSIONS is set)"


def test_use_switches_new_engines() -> None:
    before = fastpath.use(False)
    try:
        assert not fastpath.accelerated()
        assert fastpath.describe().startswith("no (")
        if fastpath.COMPILED is None:
            with pytest.raises(RuntimeError, match="unavailable"):
                fastpath.use(True)
        else:
            fastpath.use(True)
            assert fastpath.accelerated()
    finally:
        fastpath.restore(before)


def test_api_suite_on_the_python_kernels() -> None:
    """tests/api (this process runs it on the compiled kernels when they are built)
    once more in a child process where RDMASHIM_NO_EXTENSIONS=1 forces the fallback."""
    env = {**os.environ, "RDMASHIM_NO_EXTENSIONS": "1"}
    env.pop("RDMASHIM_BACKEND", None)  # the engine's suite: softiwarp
    env.pop("RDMASHIM_ENGINE", None)  # the Python engine: the kernels' one
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/api", "-q", "-x", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1]


def test_compiled_kernels_are_there_when_required() -> None:
    """CI sets RDMASHIM_REQUIRE_EXTENSIONS=1 where gcc and the headers are installed: a
    build that silently fell back must fail there, not skip the compiled runs."""
    if os.environ.get("RDMASHIM_REQUIRE_EXTENSIONS", "") in ("", "0"):
        pytest.skip("RDMASHIM_REQUIRE_EXTENSIONS is not set")
    assert fastpath.COMPILED is not None, fastpath.WHY_NOT
