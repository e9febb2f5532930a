"""The compiled kernels: :class:`~rdmashim.providers.softiwarp.kernels.Kernels` over ``_accel``.

Importing this module fails (``ImportError``) when the extension was not built
or cffi's backend is missing; :mod:`.fastpath` then keeps the Python kernels.
Buffers go to C through ``ffi.from_buffer`` (a pointer and its length, the
object kept alive for the call), integer lists through cffi arrays; C writes
only into buffers sized here and returns counts and offsets.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import Any, cast

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp._accel import ffi, lib
from rdmashim.providers.softiwarp.ddp import SEND_MIN, TAGGED_HDR_LEN, TAGGED_MIN
from rdmashim.providers.softiwarp.kernels import (
    MSG_WORDS,
    SPAN,
    Buffer,
    Targets,
    check_tagged_frame,
    check_tagged_target,
)
from rdmashim.providers.softiwarp.memory import Region

_FRAME_OVERHEAD = SEND_MIN + 3
"""Most bytes an FPDU adds to its payload: header, PAD, CRC."""
_TAGGED_OVERHEAD = TAGGED_MIN + 3
_TRAILER = tuple(ddp.trailer_len(TAGGED_HDR_LEN - 2 + n) for n in range(4))
"""PAD and CRC bytes after a tagged payload of ``n`` bytes, by ``n % 4``."""
COPY_MAX = 8192
"""Largest FPDU payload the compiled framing copies (measured: 1428 bytes copy at 137 us
per MiB against 579 for slices; 65516 bytes cost 138 us copied, 62 as slices)."""

lib.rs_init()


def _bytes(data: Buffer) -> Any:
    return ffi.from_buffer("uint8_t[]", data)


_ZERO_WORD = array("I", [0])
"""One zero ``uint32_t`` (``array("I")`` is 32 bits wide on every platform CPython runs on;
checked at import)."""
if _ZERO_WORD.itemsize != 4:
    raise ImportError("array('I') is not 32 bits wide here")


def _u32(values: Sequence[int]) -> Any:
    """``uint32_t`` words for C: an ``array("I")`` as it is, any other sequence copied."""
    if values.__class__ is array:
        return ffi.from_buffer("uint32_t[]", values)
    return ffi.new("uint32_t[]", values)


def _fpdu_len(buf: Buffer, pos: int) -> int:
    """Bytes of the FPDU whose length field is at ``buf[pos:pos + 2]``."""
    return ddp.fpdu_len(buf[pos] << 8 | buf[pos + 1])


class CKernels:
    """The kernels of ``_accel.c`` (see :class:`~rdmashim.providers.softiwarp.kernels.Kernels`)."""

    accelerated = True
    name = "C (cffi), CRC32c " + {lib.RS_CRC_INSN: "SSE4.2", lib.RS_CRC_FOLD: "VPCLMULQDQ"}.get(
        lib.rs_crc32c_hw(), "table"
    )

    def crc32c(self, data: Buffer, value: int = 0) -> int:
        """See :class:`Kernels`."""
        view = _bytes(data)
        return int(lib.rs_crc32c(value, view, len(view)))

    def frame_sends(
        self, data: Buffer, lens: Sequence[int], ctrls: Buffer, invs: Sequence[int], msn: int,
        crc: bool,
    ) -> Buffer:  # fmt: skip
        """See :class:`Kernels`."""
        n = len(lens)
        if not n == len(ctrls) == len(invs):
            raise ValueError("frame_sends: lens, ctrls and invs differ in length")
        src = _bytes(data)
        out = bytearray(len(src) + n * _FRAME_OVERHEAD)
        written = lib.rs_frame_sends(
            _bytes(out), len(out), src, len(src), _u32(lens), _bytes(ctrls), _u32(invs), n, msn,
            crc,
        )  # fmt: skip
        if written < 0:
            raise ValueError("frame_sends: a message is not a one-FPDU Send")
        del out[written:]
        return out

    def scan_sends(
        self, buf: Buffer, start: int, end: int, msn: int, crc: bool
    ) -> tuple[int, Sequence[int]]:
        """See :class:`Kernels`."""
        if not 0 <= start <= end <= len(buf):
            return start, []
        words = (end - start) // SEND_MIN * MSG_WORDS
        out = _ZERO_WORD * words
        stop = ffi.new("size_t *")
        view = _bytes(buf)
        count = lib.rs_scan_sends(view, len(view), start, end, msn, crc, _u32(out), words, stop)
        del out[count * MSG_WORDS :]
        return int(stop[0]), out

    def place(self, buf: Buffer, msgs: Sequence[int], targets: Targets) -> None:
        """See :class:`Kernels`."""
        nsegs = targets.nsegs
        segments = targets.segments
        handles, caps, offs, lens = zip(*segments, strict=True) if segments else ((), (), (), ())
        view = _bytes(buf)
        failed = lib.rs_place(
            view, len(view), _u32(msgs), len(msgs), len(nsegs),
            ffi.new("uint8_t *[]", handles), ffi.new("uint64_t[]", caps),
            ffi.new("uint64_t[]", offs), ffi.new("uint64_t[]", lens),
            len(segments), ffi.new("uint32_t[]", nsegs), len(nsegs),
        )  # fmt: skip
        if failed:
            raise ValueError("place: a message or segment outside its bounds")

    def place_in(self, buf: Buffer, msgs: Sequence[int], target: object, spans: Buffer) -> None:
        """See :class:`Kernels`."""
        n, odd = divmod(memoryview(spans).nbytes, SPAN.size)
        if odd:
            raise ValueError("place_in: spans are not whole (offset, length) pairs")
        dst = target if isinstance(target, ffi.CData) else _bytes(target)  # type: ignore[arg-type]
        view = _bytes(buf)
        failed = lib.rs_place_in(
            view, len(view), _u32(msgs), len(msgs), n, dst, len(dst),
            ffi.from_buffer("uint64_t[]", spans),
        )  # fmt: skip
        if failed:
            raise ValueError("place_in: a message outside the buffer or its receive")

    def handle(self, region: Region) -> object:
        """See :class:`Kernels`: a cdata over the region's memory, made once per region."""
        handle = region.handle
        if handle is None:
            handle = region.handle = ffi.from_buffer("uint8_t[]", region.view, True)
        return handle

    def send_plan(
        self, regions: Sequence[Region], starts: Sequence[int], lens: array[int]
    ) -> object:
        """See :class:`Kernels`: a pointer to each piece (into the regions' handles,
        which live as long as the regions stay registered) and the lengths as C sees
        them, converted once."""
        if not len(regions) == len(starts) == len(lens):
            raise ValueError("send_plan: regions, starts and lens differ in length")
        handle: Callable[[Region], Any] = self.handle
        pointers = ffi.new(
            "uint8_t *[]", [handle(r) + a for r, a in zip(regions, starts, strict=True)]
        )
        # (each cdata keeps its array alive)
        return pointers, _u32(lens), len(lens), sum(lens)

    def gather(self, plan: object) -> Buffer:
        """See :class:`Kernels`."""
        pointers, sizes, n, total = cast("tuple[Any, Any, int, int]", plan)
        out = bytearray(total)
        lib.rs_gather(ffi.from_buffer("uint8_t[]", out), pointers, sizes, n)
        return out

    def frame_tagged(
        self, src: Buffer, ctrl: int, stag: int, to: int, chunk: int, last: bool, crc: bool
    ) -> list[Buffer]:
        """See :class:`Kernels`: one buffer with the payload copied in for FPDUs of up to
        :data:`COPY_MAX` payload bytes (cheaper than three iovecs each), else headers
        and trailers around slices of ``src``."""
        data = _bytes(src)
        total = len(data)
        check_tagged_frame(ctrl, stag, to, total, chunk)
        copy = chunk <= COPY_MAX
        count = total // chunk + 1
        out = bytearray((total if copy else 0) + count * _TAGGED_OVERHEAD)
        written = lib.rs_frame_tagged(
            _bytes(out), len(out), data, total, ctrl, stag, to, chunk, last, crc, copy
        )
        if written < 0:
            raise ValueError("frame_tagged: not a run of tagged FPDUs")
        if copy:
            del out[written:]
            return [out]
        frames = memoryview(out)
        payload = memoryview(src)
        parts: list[Buffer] = []
        o = d = 0
        while True:
            n = min(chunk, total - d)
            trailer = o + TAGGED_HDR_LEN + _TRAILER[n & 3]
            parts.append(frames[o : o + TAGGED_HDR_LEN])
            if n:
                parts.append(payload[d : d + n])
            parts.append(frames[o + TAGGED_HDR_LEN : trailer])
            o = trailer
            d += n
            if d == total:
                return parts

    def place_tagged(
        self, buf: Buffer, start: int, end: int, ctrl: int, stag: int, to: int,
        target: object, off: int, crc: bool, in_order: bool,
    ) -> tuple[int, int, bool]:  # fmt: skip
        """See :class:`Kernels`."""
        dst = target if isinstance(target, ffi.CData) else _bytes(target)  # type: ignore[arg-type]
        size = len(dst)
        check_tagged_target(ctrl, stag, to, size, off)
        if not 0 <= start <= end <= len(buf):
            return start, to, False
        result = ffi.new("uint64_t[2]")
        view = _bytes(buf)
        stop = lib.rs_place_tagged(
            view, len(view), start, end, ctrl, stag, to, dst, size, off, crc, in_order, result
        )
        if stop < 0:
            raise ValueError("place_tagged: the range is not inside its target")
        # A run ending at the top of the 64-bit TO space is followed by TO 2**64, which
        # the C side's uint64_t holds as 0; the next TO is never below ``to``.
        next_to = int(result[0])
        if next_to < to:
            next_to += 1 << 64
        return int(stop), next_to, bool(result[1])
