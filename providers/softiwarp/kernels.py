"""The engine's data-path kernels: their interface and the pure-Python reference.

A kernel does the per-FPDU work of one burst in one call: TX frames a run of
one-FPDU Sends into one buffer, or a run of tagged FPDUs (RDMA Write, Read
Response) over a contiguous source; RX scans the staging buffer for the run of
whole one-FPDU Sends it may complete and places their payloads, or places the
run of whole tagged FPDUs bound for one checked range of registered memory.
The engine decides everything else (which work requests qualify, which
receives or regions take the data, completions, errors) and calls the kernels
through :mod:`~rdmashim.providers.softiwarp.fastpath`, which picks these
functions or their compiled twins in ``_accel.c`` (:mod:`.accel`). This
module is the reference: the compiled kernels must give the same bytes, the
same placements and the same stop offsets, which ``tests/test_accel.py``
checks; both raise ``ValueError`` for arguments they refuse.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import getitem
from typing import Any, Protocol, cast

from crc32c import crc32c

from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.ddp import (
    CTRL_READ_RESPONSE,
    CTRL_SEND,
    CTRL_SEND_SE,
    CTRL_WRITE,
    DDP_TAGGED_LAST,
    DDP_TAGGED_MIDDLE,
    DDP_UNTAGGED_LAST,
    MAX_SEND_PAYLOAD,
    MAX_TAGGED_PAYLOAD,
    SEND_MIN,
    TAGGED_HDR_LEN,
    TAGGED_MIN,
    TO_LIMIT,
    U32_MAX,
    UNTAGGED_HDR_LEN,
    Opcode,
)
from rdmashim.providers.softiwarp.memory import Region

Buffer = bytes | bytearray | memoryview

MSG_WORDS = 3
"""Words per scanned message: payload offset, payload length, solicited (0 or 1)."""
SEND_CTRLS = frozenset(
    ddp.RDMAP_VERSION | op
    for op in (Opcode.SEND, Opcode.SEND_INV, Opcode.SEND_SE, Opcode.SEND_SE_INV)
)
"""RDMAP control bytes :meth:`Kernels.frame_sends` writes."""
TAGGED_CTRLS = frozenset((CTRL_WRITE, CTRL_READ_RESPONSE))
"""RDMAP control bytes of the tagged kernels (:meth:`Kernels.place_tagged`, ``frame_tagged``)."""
SPAN = struct.Struct("=QQ")
"""One receive as :meth:`Kernels.place_in` takes it: its offset in the target and its
length, native 64-bit words (the compiled kernel reads them in place)."""


@dataclass(eq=False, slots=True)
class Targets:
    """Where the payloads of a run of messages go: segment ``s`` is ``(handle, cap, off,
    length)``, the bytes ``handle[off:off + length]`` of a buffer of ``cap`` bytes, and
    message ``i`` fills the next ``nsegs[i]`` segments in turn.

    Handles come from :meth:`Kernels.handle` of registered regions, offsets and
    lengths from posted receives the engine checked; never from the peer.
    """

    segments: list[tuple[object, int, int, int]] = field(default_factory=list)
    nsegs: list[int] = field(default_factory=list)


class Kernels(Protocol):
    """The data-path kernels one engine calls (see the module docstring)."""

    accelerated: bool
    """Whether these are the compiled kernels."""
    name: str

    def crc32c(self, data: Buffer, value: int = 0) -> int:
        """CRC32c of ``data`` continuing from ``value`` (as the ``crc32c`` package)."""
        ...

    def frame_sends(
        self, data: Buffer, lens: Sequence[int], ctrls: Buffer, invs: Sequence[int], msn: int,
        crc: bool,
    ) -> Buffer:  # fmt: skip
        """The FPDUs of one-FPDU Sends: payload the next ``lens[i]`` bytes of ``data``
        (they add up to all of it), RDMAP control byte ``ctrls[i]``, invalidate STag
        ``invs[i]``, MSN ``msn + i`` (mod 2^32), QN 0, MO 0, last; zero PAD and the CRC
        (zero field when ``crc`` is false)."""
        ...

    def scan_sends(
        self, buf: Buffer, start: int, end: int, msn: int, crc: bool
    ) -> tuple[int, Sequence[int]]:
        """The run of whole one-FPDU Sends (with SE or not) at ``buf[start:end]``
        whose MSNs count up from ``msn``: the offset after the run and
        :data:`MSG_WORDS` words per message (payload offset, length, solicited; a
        list or an ``array("I")``).
        It stops before the first FPDU that is anything else or fails its CRC."""
        ...

    def place(self, buf: Buffer, msgs: Sequence[int], targets: Targets) -> None:
        """Copy the payloads of the first ``len(targets.nsegs)`` messages of a scan
        into their targets."""
        ...

    def place_in(self, buf: Buffer, msgs: Sequence[int], target: object, spans: Buffer) -> None:
        """Copy the payloads of the first messages of a scan into one buffer (a
        :meth:`handle`), one per :data:`SPAN` of ``spans``: message ``i`` to
        ``target[off:]``, into a receive of ``length`` bytes there, for span ``i``'s
        ``(off, length)``. ValueError, and nothing placed, when a message lies
        outside ``buf`` or is longer than its receive (a peer's Send too long for the
        receive it takes), or a receive passes the end of ``target``."""
        ...

    def handle(self, region: Region) -> object:
        """What :class:`Targets`, :meth:`place_in` and :meth:`place_tagged` name a
        registered region's memory by."""
        ...

    def send_plan(
        self, regions: Sequence[Region], starts: Sequence[int], lens: array[int]
    ) -> object:
        """The data of a run of Sends worked out once, for :meth:`gather`: message ``i``
        carries the ``lens[i]`` bytes at ``starts[i]`` of ``regions[i]``'s memory. The
        caller checked that each piece lies inside its region and keeps the arrays
        unchanged; the plan holds while every region stays registered."""
        ...

    def gather(self, plan: object) -> Buffer:
        """A copy of the pieces ``plan`` (from :meth:`send_plan`) names, joined; only
        while the plan's regions are registered."""
        ...

    def frame_tagged(
        self, src: Buffer, ctrl: int, stag: int, to: int, chunk: int, last: bool, crc: bool
    ) -> list[Buffer]:
        """The FPDUs of ``src`` as tagged segments (RDMAP control byte ``ctrl``, a Write's
        or a Read Response's) to ``stag`` at ``to``: ``chunk`` payload bytes each (the
        final one fewer; one empty FPDU for an empty ``src``), the final one with the DDP
        last flag when ``last``; zero PAD and the CRC (zero field when ``crc`` is false).
        The buffers to send, in order (payload slices of ``src`` or copies)."""
        ...

    def place_tagged(
        self, buf: Buffer, start: int, end: int, ctrl: int, stag: int, to: int,
        target: object, off: int, crc: bool, in_order: bool,
    ) -> tuple[int, int, bool]:  # fmt: skip
        """Place the run of whole tagged FPDUs at ``buf[start:end]`` bound for the range
        ``[to, to + len(target) - off)``, which the caller resolved and checked (STag,
        PD, access, bounds); TO ``to`` is ``target[off]`` (``target`` a :meth:`handle`
        or a writable buffer). Each FPDU must have the DDP control byte of a tagged
        segment (reserved bits zero), RDMAP control byte ``ctrl``, STag ``stag``, a
        ULPDU length that holds the header, its payload inside the range, the whole
        FPDU present and, when ``crc`` is set, a matching CRC. ``in_order`` (a Read
        Response's sink): the first FPDU's TO is ``to``, each next one's follows the
        one before, an FPDU with the last flag must end the range and ends the run.
        Stops before the first FPDU that is anything else, without placing it, except
        that one whose CRC alone fails is placed (inside the range) before the run
        stops at it: the CRC is checked in the pass that copies, as siw places before
        it checks. Returns the offset after the run, in order the TO after the run's
        payload (else ``to``) and whether the run ended with the last flag (in order)."""
        ...


class PyKernels:
    """The reference kernels, in Python (the fallback when ``_accel`` is not built)."""

    accelerated = False
    name = "Python"

    def crc32c(self, data: Buffer, value: int = 0) -> int:
        """See :class:`Kernels`."""
        return int(crc32c(data, value))

    def frame_sends(
        self, data: Buffer, lens: Sequence[int], ctrls: Buffer, invs: Sequence[int], msn: int,
        crc: bool,
    ) -> Buffer:  # fmt: skip
        """See :class:`Kernels`."""
        if not len(lens) == len(ctrls) == len(invs):
            raise ValueError("frame_sends: lens, ctrls and invs differ in length")
        view = memoryview(data).cast("B")
        if sum(lens) != len(view):
            raise ValueError("frame_sends: the lengths do not add up to the data")
        if len(lens) == 1:  # the ping-pong case: the data is the payload
            return frame_send(data, ctrls[0], invs[0], msn, crc)
        parts: list[bytes] = []
        end = 0
        for i, n in enumerate(lens):
            parts.append(
                frame_send(view[end : end + n], ctrls[i], invs[i], (msn + i) & U32_MAX, crc)
            )
            end += n
        return b"".join(parts)

    def scan_sends(
        self, buf: Buffer, start: int, end: int, msn: int, crc: bool
    ) -> tuple[int, list[int]]:
        """See :class:`Kernels`."""
        out: list[int] = []
        if not 0 <= start <= end <= len(buf) <= U32_MAX:
            return start, out
        unpack = ddp.UNTAGGED.unpack_from
        pos = start
        while end - pos >= SEND_MIN:
            # The run takes a whole one-segment Send or Send with SE on QN 0 at MO 0 with
            # the next MSN and (``crc`` set) a matching CRC.
            ulpdu_len, ddp_ctrl, ctrl, _inv, qn, got_msn, mo = unpack(buf, pos)
            if (
                ddp_ctrl != DDP_UNTAGGED_LAST
                or (ctrl != CTRL_SEND and ctrl != CTRL_SEND_SE)
                or qn
                or mo
                or got_msn != msn
                or ulpdu_len < UNTAGGED_HDR_LEN - 2
            ):
                break
            size = _whole_fpdu(buf, pos, end, ulpdu_len, crc)
            if not size:
                break
            payload = ulpdu_len - (UNTAGGED_HDR_LEN - 2)
            out += (pos + UNTAGGED_HDR_LEN, payload, ctrl == CTRL_SEND_SE)
            msn = (msn + 1) & U32_MAX
            pos += size
        return pos, out

    def place(self, buf: Buffer, msgs: Sequence[int], targets: Targets) -> None:
        """See :class:`Kernels`."""
        segments = targets.segments
        nsegs = targets.nsegs
        if len(nsegs) > len(msgs) // MSG_WORDS:
            raise ValueError("place: more targets than messages")
        size = len(buf)
        s = 0
        for i, count in enumerate(nsegs):
            src = msgs[i * MSG_WORDS]
            left = msgs[i * MSG_WORDS + 1]
            if src > size or left > size - src or count > len(segments) - s:
                raise ValueError(f"place: message {i} outside the buffer or its segments")
            for target, cap, off, n in segments[s : s + count]:
                if off > cap or n > cap - off:
                    raise ValueError(f"place: a segment of message {i} outside its buffer")
                take = min(left, n)
                if take:
                    target[off : off + take] = buf[src : src + take]  # type: ignore[index]
                src += take
                left -= take
            s += count
            if left:
                raise ValueError(f"place: message {i} longer than its segments")

    def place_in(self, buf: Buffer, msgs: Sequence[int], target: object, spans: Buffer) -> None:
        """See :class:`Kernels`."""
        dst: memoryview = target  # type: ignore[assignment]
        raw = memoryview(spans).cast("B")
        if len(raw) % SPAN.size:
            raise ValueError("place_in: spans are not whole (offset, length) pairs")
        words = raw.cast("Q")
        offs, lens = words[0::2], words[1::2]
        if len(offs) > len(msgs) // MSG_WORDS:
            raise ValueError("place_in: more targets than messages")
        size = len(buf)
        cap = len(dst)
        for i, off in enumerate(offs):
            src = msgs[i * MSG_WORDS]
            n = msgs[i * MSG_WORDS + 1]
            if src > size or n > size - src or n > lens[i] or off > cap or lens[i] > cap - off:
                raise ValueError(f"place_in: message {i} outside the buffer or its receive")
        for i, off in enumerate(offs):
            src = msgs[i * MSG_WORDS]
            n = msgs[i * MSG_WORDS + 1]
            if n:
                dst[off : off + n] = buf[src : src + n]

    def handle(self, region: Region) -> object:
        """See :class:`Kernels`: the region's own memoryview."""
        return region.view

    def send_plan(
        self, regions: Sequence[Region], starts: Sequence[int], lens: array[int]
    ) -> object:
        """See :class:`Kernels`: the regions' views and the slices to take of them."""
        slices = [slice(a, a + n) for a, n in zip(starts, lens, strict=True)]
        return [r.view for r in regions], slices

    def gather(self, plan: object) -> Buffer:
        """See :class:`Kernels`."""
        views, slices = cast(tuple[list[Any], list[slice]], plan)
        return b"".join(map(getitem, views, slices))

    def frame_tagged(
        self, src: Buffer, ctrl: int, stag: int, to: int, chunk: int, last: bool, crc: bool
    ) -> list[Buffer]:
        """See :class:`Kernels`: headers and trailers around slices of ``src``."""
        view = memoryview(src)
        total = view.nbytes
        check_tagged_frame(ctrl, stag, to, total, chunk)
        pack = ddp.TAGGED.pack
        crc_field = ddp.CRC_FIELD.pack
        out: list[Buffer] = []
        off = 0
        while True:
            n = min(chunk, total - off)
            final = off + n == total
            ulpdu_len = TAGGED_HDR_LEN - 2 + n
            ddp_ctrl = DDP_TAGGED_LAST if final and last else DDP_TAGGED_MIDDLE
            header = pack(ulpdu_len, ddp_ctrl, ctrl, stag, to + off)
            pad = ddp.ZERO_PAD[ddp.pad_len(ulpdu_len)]
            out.append(header)
            if n:
                payload = view[off : off + n]
                out.append(payload)
                value = crc32c(pad, crc32c(payload, crc32c(header))) if crc else 0
            else:
                value = crc32c(pad, crc32c(header)) if crc else 0
            out.append(pad + crc_field(value) if crc else pad + ddp.ZERO_CRC)
            off += n
            if final:
                return out

    def place_tagged(
        self, buf: Buffer, start: int, end: int, ctrl: int, stag: int, to: int,
        target: object, off: int, crc: bool, in_order: bool,
    ) -> tuple[int, int, bool]:  # fmt: skip
        """See :class:`Kernels`."""
        dst = target if isinstance(target, memoryview) else memoryview(target)  # type: ignore[arg-type]
        span = check_tagged_target(ctrl, stag, to, dst.nbytes, off)
        if not 0 <= start <= end <= len(buf):
            return start, to, False
        unpack = ddp.TAGGED.unpack_from
        pos = start
        done = 0  # in order: payload bytes placed
        last = False
        while end - pos >= TAGGED_MIN:
            ulpdu_len, ddp_ctrl, got_ctrl, got_stag, got_to = unpack(buf, pos)
            if (
                (ddp_ctrl != DDP_TAGGED_MIDDLE and ddp_ctrl != DDP_TAGGED_LAST)
                or got_ctrl != ctrl
                or got_stag != stag
                or ulpdu_len < TAGGED_HDR_LEN - 2
            ):
                break
            n = ulpdu_len - (TAGGED_HDR_LEN - 2)
            rel = got_to - to
            if rel < 0 or rel > span or n > span - rel:
                break
            final = ddp_ctrl == DDP_TAGGED_LAST
            if in_order and (rel != done or (final and rel + n != span)):
                break
            size = _whole_fpdu(buf, pos, end, ulpdu_len, False)
            if not size:
                break
            if n:
                src = pos + TAGGED_HDR_LEN
                dst[off + rel : off + rel + n] = buf[src : src + n]
            if crc and not _whole_fpdu(buf, pos, end, ulpdu_len, crc):
                break  # placed, then checked (as siw): the general path reports the CRC
            pos += size
            if in_order:
                done += n
                if final:
                    last = True
                    break
        return pos, to + done, last


def frame_send(payload: Buffer, ctrl: int, inv: int, msn: int, crc: bool) -> bytes:
    """The FPDU of one one-FPDU Send (:func:`~.ddp.encode_send`), its arguments checked:
    ``ctrl`` one of :data:`SEND_CTRLS`, ``payload`` within one FPDU."""
    if ctrl not in SEND_CTRLS or not 0 <= len(payload) <= MAX_SEND_PAYLOAD:
        raise ValueError("frame_sends: a message is not a one-FPDU Send")
    return ddp.encode_send(payload, ctrl, inv, msn, crc)


def _whole_fpdu(buf: Buffer, pos: int, end: int, ulpdu_len: int, crc: bool) -> int:
    """The bytes of the FPDU at ``buf[pos:end]`` when it is all there and (``crc`` set)
    its CRC matches, else 0."""
    size = ddp.fpdu_len(ulpdu_len)
    body = size - ddp.TRAILER_CRC_LEN  # length field, ULPDU and PAD
    if size > end - pos:
        return 0
    if crc and crc32c(buf[pos : pos + body]) != ddp.CRC_FIELD.unpack_from(buf, pos + body)[0]:
        return 0
    return size


def _tagged_range(ctrl: int, stag: int, to: int, length: int) -> bool:
    """Whether ``ctrl`` is a tagged opcode's, ``stag`` fits 32 bits and ``[to, to + length)``
    stays below 2^64."""
    return ctrl in TAGGED_CTRLS and 0 <= stag <= U32_MAX and 0 <= to <= TO_LIMIT - length


def check_tagged_frame(ctrl: int, stag: int, to: int, total: int, chunk: int) -> None:
    """Refuse arguments of :meth:`Kernels.frame_tagged` that are not a tagged run."""
    if not 1 <= chunk <= MAX_TAGGED_PAYLOAD or not _tagged_range(ctrl, stag, to, total):
        raise ValueError("frame_tagged: not a run of tagged FPDUs")


def check_tagged_target(ctrl: int, stag: int, to: int, size: int, off: int) -> int:
    """Refuse arguments of :meth:`Kernels.place_tagged` that name no range of its target;
    the range's length."""
    span = size - off
    if not 0 <= off <= size or not _tagged_range(ctrl, stag, to, span):
        raise ValueError("place_tagged: the range is not inside its target")
    return span
