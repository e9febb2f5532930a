"""The engine's data-path kernels: their interface and the pure-Python reference.

A kernel does the per-FPDU work of one burst of small Sends in one call: TX
frames a run of one-FPDU Sends into one buffer, RX scans the staging buffer
for the run of whole one-FPDU Sends it may complete and places their payloads.
The engine decides everything else (which work requests qualify, which
receives take the messages, completions, errors) and calls the kernels
through :mod:`~rdmashim.verbs.softiwarp.fastpath`, which picks these
functions or their compiled twins in ``_accel.c`` (:mod:`.accel`). This
module is the reference: the compiled kernels must give the same bytes, the
same placements and the same stop offsets, which ``tests/test_accel.py``
checks; both raise ``ValueError`` for arguments they refuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from crc32c import crc32c

from rdmashim.verbs.softiwarp import ddp
from rdmashim.verbs.softiwarp.ddp import Opcode
from rdmashim.verbs.softiwarp.memory import Region

Buffer = bytes | bytearray | memoryview

UNTAGGED_HDR_LEN = ddp.UNTAGGED_HDR_LEN
SEND_MIN = ddp.UNTAGGED_HDR_LEN + ddp.TRAILER_CRC_LEN
"""Fewest bytes that hold a whole Send FPDU (header and CRC field, no payload)."""
MAX_SEND_PAYLOAD = ddp.MAX_ULPDU - (ddp.UNTAGGED_HDR_LEN - 2)
"""Most payload one untagged FPDU carries."""
MSG_WORDS = 3
"""Words per scanned message: payload offset, payload length, solicited (0 or 1)."""
DDP_UNTAGGED_LAST = ddp.DDP_LAST | ddp.DDP_VERSION
SEND_CTRLS = frozenset(
    ddp.RDMAP_VERSION | op
    for op in (Opcode.SEND, Opcode.SEND_INV, Opcode.SEND_SE, Opcode.SEND_SE_INV)
)
"""RDMAP control bytes :meth:`Kernels.frame_sends` writes."""
CTRL_SEND = ddp.RDMAP_VERSION | Opcode.SEND
CTRL_SEND_SE = ddp.RDMAP_VERSION | Opcode.SEND_SE
_U32 = 0xFFFFFFFF
_UNTAGGED = ddp.UNTAGGED
_CRC_FIELD = ddp.CRC_FIELD
_ZERO_CRC = bytes(ddp.TRAILER_CRC_LEN)


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
        self, payloads: Sequence[bytes], ctrls: Buffer, invs: Sequence[int], msn: int, crc: bool
    ) -> Buffer:
        """The FPDUs of one-FPDU Sends: payload ``payloads[i]``, RDMAP control byte
        ``ctrls[i]``, invalidate STag ``invs[i]``, MSN ``msn + i`` (mod 2^32), QN 0,
        MO 0, last; zero PAD and the CRC (zero field when ``crc`` is false)."""
        ...

    def scan_sends(
        self, buf: Buffer, start: int, end: int, msn: int, crc: bool
    ) -> tuple[int, list[int]]:
        """The run of whole one-FPDU Sends (with SE or not) at ``buf[start:end]``
        whose MSNs count up from ``msn``: the offset after the run and
        :data:`MSG_WORDS` words per message (payload offset, length, solicited).
        It stops before the first FPDU that is anything else or fails its CRC."""
        ...

    def place(self, buf: Buffer, msgs: Sequence[int], targets: Targets) -> None:
        """Copy the payloads of the first ``len(targets.nsegs)`` messages of a scan
        into their targets."""
        ...

    def handle(self, region: Region) -> object:
        """What :class:`Targets` names a registered region's memory by."""
        ...


class PyKernels:
    """The reference kernels, in Python (the fallback when ``_accel`` is not built)."""

    accelerated = False
    name = "Python"

    def crc32c(self, data: Buffer, value: int = 0) -> int:
        """See :class:`Kernels`."""
        return int(crc32c(data, value))

    def frame_sends(
        self, payloads: Sequence[bytes], ctrls: Buffer, invs: Sequence[int], msn: int, crc: bool
    ) -> Buffer:
        """See :class:`Kernels`."""
        if not len(payloads) == len(ctrls) == len(invs):
            raise ValueError("frame_sends: payloads, ctrls and invs differ in length")
        pack = _UNTAGGED.pack
        crc_field = _CRC_FIELD.pack
        parts: list[bytes] = []
        for i, payload in enumerate(payloads):
            ctrl = ctrls[i]
            if ctrl not in SEND_CTRLS or len(payload) > MAX_SEND_PAYLOAD:
                raise ValueError(f"frame_sends: message {i} is not a one-FPDU Send")
            ulpdu_len = UNTAGGED_HDR_LEN - 2 + len(payload)
            body = (
                pack(ulpdu_len, DDP_UNTAGGED_LAST, ctrl, invs[i], 0, (msn + i) & _U32, 0) + payload
            )
            pad = ddp.pad_len(ulpdu_len)
            if pad:
                body += ddp.ZERO_PAD[pad]
            parts.append(body)
            parts.append(crc_field(crc32c(body)) if crc else _ZERO_CRC)
        return b"".join(parts)

    def scan_sends(
        self, buf: Buffer, start: int, end: int, msn: int, crc: bool
    ) -> tuple[int, list[int]]:
        """See :class:`Kernels`."""
        out: list[int] = []
        if not 0 <= start <= end <= len(buf) or len(buf) > _U32:
            return start, out
        unpack = _UNTAGGED.unpack_from
        wire_crc = _CRC_FIELD.unpack_from
        pos = start
        while end - pos >= SEND_MIN:
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
            body = ulpdu_len + 2 + ddp.pad_len(ulpdu_len)
            if body + ddp.TRAILER_CRC_LEN > end - pos:
                break
            if crc and crc32c(buf[pos : pos + body]) != wire_crc(buf, pos + body)[0]:
                break
            out += (
                pos + UNTAGGED_HDR_LEN,
                ulpdu_len - (UNTAGGED_HDR_LEN - 2),
                ctrl == CTRL_SEND_SE,
            )
            msn = (msn + 1) & _U32
            pos += body + ddp.TRAILER_CRC_LEN
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

    def handle(self, region: Region) -> object:
        """See :class:`Kernels`: the region's own memoryview."""
        return region.view
