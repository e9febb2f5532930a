"""The native engine's core, seen from Python: a device's memory table, completion
queues and queue pairs whose protocol state lives in C (``_engine.c``).

This is the first layer of the native provider (``docs/native-engine.md``): each
call here is one call into C, which frames, parses, checks and places without
Python. It is sans-IO, like :mod:`.engine`, which it is held to byte for byte by
``tests/test_native_engine.py``: received bytes go in through
:meth:`NativeQP.receive`, the bytes to send come out of :meth:`NativeQP.take`
and :meth:`NativeQP.taken`, and completions collect in :class:`NativeCQ`.

Available when the compiled extension was built (:data:`AVAILABLE`, and
:data:`WHY_NOT` otherwise).
"""

from __future__ import annotations

import errno
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from rdmashim.providers.softiwarp.ddp import Opcode
from rdmashim.providers.softiwarp.jobs import EngineConfig, EngineState
from rdmashim.providers.softiwarp.terminate import TermCode
from rdmashim.verbs.enums import Access, WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.wr import WC, RecvWR, SendWR

try:
    from rdmashim.providers.softiwarp._accel import ffi, lib
except ImportError as exc:  # no compiler at install time
    ffi = lib = None
    WHY_NOT = f"the compiled extension is not built ({exc})"
else:
    WHY_NOT = ""
AVAILABLE = lib is not None

_STATES = {0: EngineState.IDLE, 1: EngineState.RTS, 2: EngineState.TERMINATE, 3: EngineState.ERROR}
_RTR = {None: 0, Opcode.WRITE: 1, Opcode.READ_REQUEST: 2}
MAX_SGE = 6
"""SGEs a work request may carry (the engine's ``MAX_SGE``)."""


def _need() -> Any:
    if lib is None:
        raise RuntimeError(f"the native engine is unavailable: {WHY_NOT}")
    return lib


class NativeMemory:
    """A device's memory table in C: regions by STag, checked on every access."""

    def __init__(self) -> None:
        self._ptr = _need().rs_mem_new()
        if self._ptr == ffi.NULL:
            raise MemoryError("rs_mem_new")
        self.view = lib.rs_mem_view_of(self._ptr)
        """``epoch``: regions removed or invalidated ever (``rs_mem_view``, read, no call)."""
        self._pds: dict[int, tuple[Callable[[], object], int]] = {}
        self._numbers = itertools.count(1)

    def pd_id(self, pd: object) -> int:
        """The number the C side knows a protection domain by (never another's: a PD
        freed and a new one at its address get different numbers)."""
        entry = self._pds.get(id(pd))
        if entry is not None and entry[0]() is pd:
            return entry[1]
        try:
            ref: Callable[[], object] = weakref.ref(pd)
        except TypeError:  # (an object without weak references: kept)
            ref = lambda: pd  # noqa: E731
        number = next(self._numbers)
        self._pds[id(pd)] = (ref, number)
        return number

    def add(self, stag: int, addr: int, iova: int, length: int, access: Access, pd: object) -> None:
        """Register ``length`` bytes at process address ``addr`` as ``stag``."""
        base = ffi.cast("uint8_t *", addr)
        err = lib.rs_mem_add(self._ptr, stag, base, iova, length, int(access), self.pd_id(pd))
        if err:
            raise VerbsError(-err, "reg_mr", f"STag {stag:#010x}")

    def remove(self, stag: int) -> None:
        """Deregister ``stag``: no QP uses the region after this returns."""
        lib.rs_mem_remove(self._ptr, stag)

    def valid(self, stag: int) -> bool:
        """Whether ``stag`` names a valid region."""
        return bool(lib.rs_mem_valid(self._ptr, stag))

    def close(self) -> None:
        """Free the table (its QPs first)."""
        if self._ptr is not None:
            lib.rs_mem_free(self._ptr)
            self._ptr = None


class NativeCQ:
    """A completion queue ring of ``cqe`` entries in C."""

    def __init__(self, cqe: int) -> None:
        self._ptr = _need().rs_cq_new(cqe)
        if self._ptr == ffi.NULL:
            raise VerbsError(errno.EINVAL, "create_cq", f"cqe={cqe}")
        self.view = lib.rs_cq_view_of(self._ptr)
        """Completions pushed, notable, queued, and whether one did not fit (``rs_cq_view``)."""
        self._buf = ffi.new("rs_wc[]", 256)

    def poll(self, n: int = 256) -> list[WC]:
        """Up to ``n`` completions, oldest first."""
        out: list[WC] = []
        while n > len(out):
            k = lib.rs_cq_poll(self._ptr, self._buf, min(256, n - len(out)))
            if not k:
                break
            for i in range(k):
                w = self._buf[i]
                out.append(
                    WC(
                        w.wr_id, WCStatus(w.status), WCOpcode(w.opcode), w.byte_len, w.qp_num,
                        WCFlags(w.wc_flags), w.invalidated_rkey, 0, bool(w.solicited),
                    )
                )  # fmt: skip
        return out

    def close(self) -> None:
        """Free the ring."""
        if self._ptr is not None:
            lib.rs_cq_free(self._ptr)
            self._ptr = None


def _fill_sges(dst: Any, sges: Sequence[Any]) -> None:
    if len(sges) > MAX_SGE:
        raise VerbsError(errno.EINVAL, "post", f"{len(sges)} SGEs > {MAX_SGE}")
    dst.num_sge = len(sges)
    for i, s in enumerate(sges):
        dst.sg_list[i].addr, dst.sg_list[i].length, dst.sg_list[i].lkey = s


class NativeQP:
    """One queue pair's protocol state in C (sans-IO: bytes in, bytes out)."""

    def __init__(
        self, memory: NativeMemory, pd: object, qp_num: int, send_cq: NativeCQ, recv_cq: NativeCQ,
        *, max_send_wr: int = 1024, max_recv_wr: int = 1024, sq_sig_all: bool = False,
        srq: Any = None,
    ) -> None:  # fmt: skip
        self.memory = memory
        self.qp_num = qp_num
        self._ptr = lib.rs_qp_new(
            memory._ptr, memory.pd_id(pd), qp_num, send_cq._ptr, recv_cq._ptr,
            ffi.NULL if srq is None else srq, max_send_wr, max_recv_wr, int(sq_sig_all),
        )  # fmt: skip
        if self._ptr == ffi.NULL:
            raise MemoryError("rs_qp_new")
        self.view = lib.rs_qp_view_of(self._ptr)
        """News, send queue depth, bytes owed, work to send (``rs_qp_view``, read, no call)."""
        self._len = ffi.new("size_t *")
        self._why = ffi.new("int *")

    def start(self, config: EngineConfig) -> None:
        """Enter RTS with what MPA negotiated."""
        rtr = _RTR[config.rtr_to_send]
        if lib.rs_qp_start(
            self._ptr, config.crc, config.ird, config.ord, config.max_fpdu, rtr,
            config.wait_for_rtr,
        ):  # fmt: skip
            raise ValueError(f"max_fpdu {config.max_fpdu} or IRD/ORD out of range")

    def post_send(self, wrs: Sequence[SendWR]) -> None:
        """Queue send work requests (inline data is copied now)."""
        arr = ffi.new("rs_send_wr[]", len(wrs))
        for i, w in enumerate(wrs):
            a = arr[i]
            a.wr_id, a.opcode, a.flags = w.wr_id, int(w.opcode), int(w.send_flags)
            a.remote_addr, a.rkey, a.invalidate_rkey = w.remote_addr, w.rkey, w.invalidate_rkey
            _fill_sges(a, w.sg_list)
        taken = lib.rs_qp_post_send(self._ptr, arr, len(wrs), self._why)
        if taken < len(wrs):
            raise VerbsError(self._why[0], "post_send", f"work request {taken}")

    def post_recv(self, wrs: Sequence[RecvWR]) -> None:
        """Queue receives."""
        arr = ffi.new("rs_recv_wr[]", len(wrs))
        for i, w in enumerate(wrs):
            arr[i].wr_id = w.wr_id
            _fill_sges(arr[i], w.sg_list)
        if lib.rs_qp_post_recv(self._ptr, arr, len(wrs)) < len(wrs):
            raise VerbsError(errno.ENOMEM, "post_recv", "receive queue full")

    def receive(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer."""
        lib.rs_qp_rx(self._ptr, ffi.from_buffer(data), len(data))

    def take(self) -> bytes:
        """A copy of the bytes to send now (the next :meth:`taken` says how many went)."""
        ptr = lib.rs_qp_tx(self._ptr, self._len)
        return bytes(ffi.buffer(ptr, self._len[0])) if self._len[0] else b""

    def taken(self, n: int) -> None:
        """``n`` of the bytes :meth:`take` gave went to TCP."""
        lib.rs_qp_tx_done(self._ptr, n)

    def read_fd(self, fd: int) -> int:
        """Read what the connected socket ``fd`` has and take it: the bytes read, 0 at the
        peer's FIN (the QP goes to ERROR), -errno (-EAGAIN: nothing there)."""
        return int(lib.rs_qp_read_fd(self._ptr, fd))

    def write_fd(self, fd: int) -> int:
        """Write what is ready to ``fd``: the bytes written, 0 when nothing is ready,
        -errno (-EAGAIN: no room in the socket)."""
        return int(lib.rs_qp_write_fd(self._ptr, fd))

    def set_error(self, message: str = "QP moved to ERROR") -> None:
        """Move to ERROR and flush."""
        lib.rs_qp_set_error(self._ptr, 5, message.encode()[:150])

    @property
    def sq_depth(self) -> int:
        """Send work requests posted and not yet completed."""
        return int(self.view.sq_depth)

    @property
    def state(self) -> EngineState:
        """The protocol state (the Python engine's names)."""
        return _STATES[lib.rs_qp_state(self._ptr)]

    @property
    def error(self) -> tuple[int, TermCode, str]:
        """Why the QP went to ERROR: the kind (``RS_ERR_*``), the Terminate code sent or
        received, and what happened."""
        out = ffi.new("rs_error *")
        lib.rs_qp_error(self._ptr, out)
        return (
            out.kind,
            TermCode(out.layer, out.etype, out.ecode),
            ffi.string(out.message).decode(),
        )

    def close(self) -> None:
        """Free the QP."""
        if self._ptr is not None:
            lib.rs_qp_free(self._ptr)
            self._ptr = None


__all__ = ["AVAILABLE", "MAX_SGE", "WHY_NOT", "NativeCQ", "NativeMemory", "NativeQP", "ffi", "lib"]
