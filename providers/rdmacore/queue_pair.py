"""Queue pairs and shared receive queues over libibverbs; work requests encoded for C.

``post_send``/``post_recv`` build the ``ibv_send_wr``/``ibv_recv_wr`` chain and
call the provider through the context's ops table (the static-inline verbs).
A rejected request raises :class:`VerbsError` with ``bad_wr``, the index of the
first request not posted (those before it are posted), as libibverbs reports.

A :class:`~rdmashim.verbs.wr.SendBatch` or :class:`~rdmashim.verbs.wr.RecvBatch`
is encoded once into a linked C array kept with the batch (:class:`WRChain`;
entries set since are encoded again) and posted from there: the first
``count`` entries by ending the chain after them for the call, chosen entries
by copying them into a chain of their own.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from rdmashim.providers.rdmacore import lib
from rdmashim.providers.rdmacore.base import Resource
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.verbs.attrs import AHAttr, QPAttr, QPCap
from rdmashim.verbs.enums import QPState, QPType, SendFlags, Transport, WROpcode
from rdmashim.verbs.errors import NotSupported, VerbsError, refused_wr
from rdmashim.verbs.wr import (
    SGE,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendWR,
    request_problem,
    requests_of,
)

if TYPE_CHECKING:
    from rdmashim.providers.rdmacore.completion import CQ
    from rdmashim.providers.rdmacore.memory import PD

log = logging.getLogger(__name__)

IBV_QP_STATE = 1 << 0
IBV_QP_ACCESS_FLAGS = 1 << 3
IBV_QP_PKEY_INDEX = 1 << 4
IBV_QP_PORT = 1 << 5
IBV_QP_QKEY = 1 << 6
IBV_QP_SQ_PSN = 1 << 16
_TO_INIT_MASK = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PORT
_UD_MASKS = {
    QPState.INIT: IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
    QPState.RTS: IBV_QP_STATE | IBV_QP_SQ_PSN,
}
"""What a UD QP's moves carry besides the state (RTR needs no path)."""
IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13
IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17
IBV_QP_CAP = 1 << 19
_QUERY_MASK = IBV_QP_STATE | IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_CAP

_INLINE = int(SendFlags.INLINE)
_WITH_IMM = frozenset({WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.SEND_WITH_IMM})
_ATOMIC = frozenset({WROpcode.ATOMIC_CMP_AND_SWP, WROpcode.ATOMIC_FETCH_AND_ADD})
_STATES = {s.value: s for s in QPState}


def _posting_error(rc: int, operation: str, bad: Any, first: Any, size: int) -> VerbsError:
    index = (lib.address(bad[0]) - lib.address(first)) // size if bad[0] != ffi.NULL else 0
    err = abs(rc) if rc != -1 else lib.last_errno()
    exc = VerbsError(err, operation, f"work request {index} not posted")
    exc.bad_wr = index
    return exc


def _encode_sges(c: Any, sges: Sequence[Any], keep: list[Any], inline: bool, i: int) -> None:
    """Point ``c.sg_list`` at a new ``ibv_sge`` array for ``sges`` (kept alive in ``keep``).

    With ``inline`` an element may be any bytes-like object; the provider copies
    inline data while posting.
    """
    if not sges:
        c.sg_list, c.num_sge = ffi.NULL, 0
        return
    sg = ffi.new("struct ibv_sge[]", len(sges))
    keep.append(sg)
    for j, s in enumerate(sges):
        if isinstance(s, SGE):
            sg[j].addr, sg[j].length, sg[j].lkey = s.addr, s.length, s.lkey
        elif inline:
            data = ffi.from_buffer(s)
            keep.append(data)
            sg[j].addr, sg[j].length = lib.address(data), len(data)
        else:
            raise VerbsError(errno.EINVAL, "post_send", f"work request {i}: raw bytes need INLINE")
    c.sg_list = sg
    c.num_sge = len(sges)


def _encode_recv_wr(c: Any, w: RecvWR, keep: list[Any], i: int) -> None:
    problem = request_problem(w)
    if problem:
        raise refused_wr(errno.EINVAL, "post_recv", i, problem)
    c.wr_id = w.wr_id
    _encode_sges(c, w.sg_list, keep, False, i)


def _encode_send_wr(c: Any, w: SendWR, keep: list[Any], i: int) -> None:
    problem = request_problem(w)
    if problem:
        raise refused_wr(errno.EINVAL, "post_send", i, problem)
    try:
        _fill_send_wr(c, w, keep, i)
    except OverflowError as exc:  # rkey, remote_addr, imm_data, ... wider than C's
        raise refused_wr(
            errno.EINVAL, "post_send", i, f"a field outside its C type ({exc})"
        ) from None


def _fill_send_wr(c: Any, w: SendWR, keep: list[Any], i: int) -> None:
    c.wr_id = w.wr_id
    opcode = WROpcode(w.opcode)
    c.opcode = opcode
    c.send_flags = int(w.send_flags)
    _encode_sges(c, w.sg_list, keep, bool(c.send_flags & _INLINE), i)
    c.imm_data = 0
    if opcode in _WITH_IMM:
        c.imm_data = socket.htonl(w.imm_data)
    elif opcode == WROpcode.SEND_WITH_INV:
        c.invalidate_rkey = w.invalidate_rkey
    if opcode in _ATOMIC:
        atomic = c.wr.atomic
        atomic.remote_addr, atomic.rkey = w.remote_addr, w.rkey
        atomic.compare_add, atomic.swap = w.compare_add, w.swap
    elif w.ah is not None:
        if not isinstance(w.ah, AH):
            raise VerbsError(errno.EINVAL, "post_send", f"work request {i}: ah of another backend")
        ud = c.wr.ud
        ud.ah, ud.remote_qpn, ud.remote_qkey = w.ah._ptr, w.remote_qpn, w.remote_qkey
    else:
        c.wr.rdma.remote_addr = w.remote_addr
        c.wr.rdma.rkey = w.rkey


def _encode(ctype: str, encode: Callable[..., None], wrs: list[Any]) -> tuple[Any, list[Any]]:
    chain = ffi.new(f"{ctype}[]", len(wrs))
    keep = [chain]
    for i, w in enumerate(wrs):
        encode(chain[i], w, keep, i)
        if i + 1 < len(wrs):
            chain[i].next = chain + (i + 1)
    return chain, keep


def encode_recv(wrs: list[RecvWR]) -> tuple[Any, list[Any]]:
    """An ``ibv_recv_wr`` chain for ``wrs`` and the cdata that must live while it is used."""
    return _encode("struct ibv_recv_wr", _encode_recv_wr, wrs)


def encode_send(wrs: list[SendWR]) -> tuple[Any, list[Any]]:
    """An ``ibv_send_wr`` chain for ``wrs`` and the cdata that must live while it is used.

    With ``SendFlags.INLINE`` an SGE may be any bytes-like object; the provider
    copies inline data while posting.
    """
    return _encode("struct ibv_send_wr", _encode_send_wr, wrs)


class WRChain:
    """A batch's entries encoded once into a linked C array (:meth:`SendBatch.prepared`).

    An entry that cannot be encoded (raw bytes without INLINE) keeps its error,
    raised when a post reaches it; ``imm`` holds the entries with immediate data.
    """

    def __init__(self, ctype: str, encode: Callable[..., None], n: int) -> None:
        self.ctype = ctype
        self.size = ffi.sizeof(ctype)
        self._encode = encode
        self.chain = ffi.new(f"{ctype}[]", n)
        for i in range(n - 1):
            self.chain[i].next = self.chain + (i + 1)
        self.keep: list[list[Any]] = [[] for _ in range(n)]
        self.errors: dict[int, str] = {}
        """Entries that could not be encoded, and why (EINVAL when a post reaches them)."""
        self.imm: set[int] = set()

    def set(self, i: int, wr: Any) -> None:
        keep: list[Any] = []
        self.errors.pop(i, None)
        try:
            self._encode(self.chain[i], wr, keep, i)
        except VerbsError as exc:
            self.errors[i] = exc.detail.partition(": ")[2]
        self.keep[i] = keep
        if getattr(wr, "opcode", None) in _WITH_IMM:
            self.imm.add(i)
        else:
            self.imm.discard(i)

    def first(self, entries: Sequence[int], among: Collection[int]) -> int | None:
        """The position in ``entries`` of the first entry in ``among``, if any."""
        if not among:
            return None
        if isinstance(entries, range):
            hits = [i for i in among if i < entries.stop]
            return min(hits) if hits else None
        return next((k for k, i in enumerate(entries) if i in among), None)

    def post(
        self, post: Callable[[Any, Any, Any], int], handle: Any, bad: Any, operation: str,
        entries: Sequence[int],
    ) -> None:  # fmt: skip
        """Post ``entries`` with one call of ``post``; the first refused raises."""
        k = len(entries)
        if not k:
            return
        if isinstance(entries, range):
            head, last, scratch = self.chain, self.chain[k - 1], None
            saved = last.next
            last.next = ffi.NULL
        else:
            head = scratch = ffi.new(f"{self.ctype}[]", k)
            for j, i in enumerate(entries):
                scratch[j] = self.chain[i]
                scratch[j].next = scratch + (j + 1) if j + 1 < k else ffi.NULL
        try:
            rc = post(handle, head, bad)
        finally:
            if scratch is None:
                last.next = saved
        if rc:
            raise _posting_error(rc, operation, bad, head, self.size)


def _post_batch(
    chains: WRChain, post: Callable[[Any, Any, Any], int], handle: Any, bad: Any,
    operation: str, entries: Sequence[int], refusal: Callable[[int], VerbsError] | None = None,
) -> None:  # fmt: skip
    """Post the batch's ``entries`` up to the first that cannot go (an entry that failed
    to encode, or one ``refusal`` refuses: its error is raised with ``bad_wr``)."""
    stop = chains.first(entries, chains.errors)
    refused = None
    if refusal is not None:
        refused = chains.first(entries, chains.imm)
    cut = min((k for k in (stop, refused) if k is not None), default=None)
    chains.post(post, handle, bad, operation, entries if cut is None else entries[:cut])
    if cut is not None:
        if cut == stop:
            raise refused_wr(errno.EINVAL, operation, cut, chains.errors[entries[cut]])
        assert refusal is not None
        exc = refusal(cut)
        exc.bad_wr = cut
        raise exc


def _send_chain(n: int) -> WRChain:
    return WRChain("struct ibv_send_wr", _encode_send_wr, n)


def _recv_chain(n: int) -> WRChain:
    return WRChain("struct ibv_recv_wr", _encode_recv_wr, n)


class AH(Resource):
    """An address handle (``ibv_ah``) for UD sends."""

    _kind = "address handle"

    def __init__(self, pd: PD, attr: AHAttr) -> None:
        super().__init__(pd)
        self.pd = pd
        self.attr = attr
        """What it was created with."""
        if len(attr.dgid) != 16:
            raise VerbsError(errno.EINVAL, "create_ah", f"dgid of {len(attr.dgid)} bytes, not 16")
        c = ffi.new("struct ibv_ah_attr *")
        c.dlid, c.sl, c.port_num = attr.dlid, attr.sl, attr.port_num
        c.src_path_bits, c.static_rate = attr.src_path_bits, attr.static_rate
        c.is_global = int(attr.is_global)
        grh = c.grh
        grh.dgid.raw = attr.dgid
        grh.sgid_index, grh.hop_limit = attr.sgid_index, attr.hop_limit
        grh.flow_label, grh.traffic_class = attr.flow_label, attr.traffic_class
        self._ptr = lib.check_ptr(lib.verbs().ibv_create_ah(pd._ptr, c), "ibv_create_ah")
        self._created()

    def _destroy(self) -> None:
        lib.check(lib.verbs().ibv_destroy_ah(self._ptr), "ibv_destroy_ah")


class SRQ(Resource):
    """A shared receive queue (``ibv_srq``)."""

    _kind = "shared receive queue"

    def __init__(self, pd: PD, max_wr: int, max_sge: int) -> None:
        super().__init__(pd)
        self.pd = pd
        attr = ffi.new("struct ibv_srq_init_attr *")
        attr.attr.max_wr = max_wr
        attr.attr.max_sge = max_sge
        self._ptr = lib.check_ptr(lib.verbs().ibv_create_srq(pd._ptr, attr), "ibv_create_srq")
        self.max_wr: int = attr.attr.max_wr
        self.max_sge: int = attr.attr.max_sge
        self._post = pd.context._ptr.ops.post_srq_recv
        self._bad = ffi.new("struct ibv_recv_wr **")
        pd.context._track(self._ptr, self)
        self._created()

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them."""
        self._check_open("post_srq_recv")
        wrs = requests_of(wr, RecvWR, "post_srq_recv")
        if not wrs:
            return
        chain, _keep = encode_recv(wrs)
        rc = self._post(self._ptr, chain, self._bad)
        if rc:
            raise _posting_error(
                rc, "post_srq_recv", self._bad, chain, ffi.sizeof("struct ibv_recv_wr")
            )

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch from its C chain (see :class:`WRChain`)."""
        self._check_open("post_srq_recv")
        entries = batch.select("post_srq_recv", count, indices)
        chains = batch.prepared(WRChain, _recv_chain)
        _post_batch(chains, self._post, self._ptr, self._bad, "post_srq_recv", entries)

    def _destroy(self) -> None:
        lib.check(lib.verbs().ibv_destroy_srq(self._ptr), "ibv_destroy_srq")


class QP(Resource):
    """A queue pair (``ibv_qp``).

    Created by :meth:`PD.create_qp`, or by a CM id (``rdma_create_qp``), which
    then connects it; ``wait_closed`` waits for the CM to report the connection
    gone.
    """

    _kind = "queue pair"

    def __init__(
        self,
        pd: PD,
        send_cq: CQ,
        recv_cq: CQ,
        cap: QPCap,
        srq: SRQ | None,
        sq_sig_all: bool,
        qp_type: QPType,
        create: Callable[[Any], Any],
    ) -> None:
        super().__init__(pd, send_cq, recv_cq, srq)
        self.pd = pd
        self.context = pd.context
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self.srq = srq
        self.sq_sig_all = sq_sig_all
        attr = ffi.new("struct ibv_qp_init_attr *")
        attr.send_cq = send_cq._ptr
        attr.recv_cq = recv_cq._ptr
        attr.srq = srq._ptr if srq is not None else ffi.NULL
        attr.cap.max_send_wr = cap.max_send_wr
        attr.cap.max_recv_wr = 0 if srq is not None else cap.max_recv_wr
        attr.cap.max_send_sge = cap.max_send_sge
        attr.cap.max_recv_sge = 0 if srq is not None else cap.max_recv_sge
        attr.cap.max_inline_data = cap.max_inline_data
        attr.qp_type = QPType(qp_type)
        attr.sq_sig_all = int(sq_sig_all)
        self._ptr = create(attr)
        self._state_hint = _STATES.get(self._ptr.state, QPState.RESET)
        self._error: Exception | None = None
        c = attr.cap
        self.cap = QPCap(
            c.max_send_wr, c.max_recv_wr, c.max_send_sge, c.max_recv_sge, c.max_inline_data
        )
        """What the provider gave (at least what was asked)."""
        self.qp_num: int = self._ptr.qp_num
        self.qp_type = QPType(qp_type)
        ops = self.context._ptr.ops
        self._post_send = ops.post_send
        self._post_recv = ops.post_recv
        self._bad_send = ffi.new("struct ibv_send_wr **")
        self._bad_recv = ffi.new("struct ibv_recv_wr **")
        self._connection_over = trio.Event()
        self._connection_over.set()
        self.close_listeners: list[Callable[[], None]] = []
        """Called when the QP is destroyed (a CM id forgets it)."""
        self.error_listeners: list[Callable[[Exception], None]] = []
        """Called with the cause when the QP goes to ERR (a CM id ends its connection)."""
        self._immediate_data = self.context.immediate_data
        self.context._track(self._ptr, self)
        self.context._track_qp(self.qp_num, self)
        self._created()

    # ---------------------------------------------------------------- posting
    def post_send(self, wr: SendWR | Iterable[SendWR]) -> None:
        """Post one send work request or a list of them (never blocks).

        An opcode with immediate data on a device without it (iWARP) raises
        :class:`NotSupported` with ``bad_wr`` naming it; the requests before it
        are posted, as a provider refusing it would leave them.
        """
        self._check_open("post_send")
        wrs = requests_of(wr, SendWR, "post_send")
        if not wrs:
            return
        refused = None
        if not self._immediate_data:
            refused = next((i for i, w in enumerate(wrs) if w.opcode in _WITH_IMM), None)
            if refused is not None:
                wrs = wrs[:refused]
        if wrs:
            chain, _keep = encode_send(wrs)
            rc = self._post_send(self._ptr, chain, self._bad_send)
            if rc:
                raise _posting_error(
                    rc, "post_send", self._bad_send, chain, ffi.sizeof("struct ibv_send_wr")
                )
        if refused is not None:
            exc = self._no_immediate_data(refused)
            exc.bad_wr = refused
            raise exc

    def _no_immediate_data(self, i: int) -> VerbsError:
        return NotSupported(
            "post_send",
            f"work request {i}: {self.context.device.transport.name} carries no "
            "immediate data (RFC 7306 is not offered)",
        )

    def post_send_batch(
        self, batch: SendBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch from its C chain (see :class:`WRChain`): one
        ``ibv_post_send``, inline data copied by the provider now."""
        self._check_open("post_send")
        entries = batch.select("post_send", count, indices)
        chains = batch.prepared(WRChain, _send_chain)
        refusal = None if self._immediate_data else self._no_immediate_data
        _post_batch(
            chains, self._post_send, self._ptr, self._bad_send, "post_send", entries, refusal
        )

    def post_recv_batch(
        self, batch: RecvBatch, count: int | None = None, *, indices: Sequence[int] | None = None
    ) -> None:
        """Post entries of a prepared batch from its C chain (see :class:`WRChain`)."""
        self._check_open("post_recv")
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        entries = batch.select("post_recv", count, indices)
        chains = batch.prepared(WRChain, _recv_chain)
        _post_batch(chains, self._post_recv, self._ptr, self._bad_recv, "post_recv", entries)

    def run_native_handler(self) -> bool:
        """Not here (False): no native handler is called (``cq.set_native_handler``)."""
        self._check_open("run_native_handler")
        return False

    def native_runner(self) -> tuple[int, int] | None:
        """None: no native handler to run (see :meth:`run_native_handler`)."""
        return None

    def post_recv(self, wr: RecvWR | Iterable[RecvWR]) -> None:
        """Post one receive work request or a list of them (never blocks)."""
        self._check_open("post_recv")
        if self.srq is not None:
            raise VerbsError(errno.EINVAL, "post_recv", "QP uses an SRQ; post to the SRQ")
        wrs = requests_of(wr, RecvWR, "post_recv")
        if not wrs:
            return
        chain, _keep = encode_recv(wrs)
        rc = self._post_recv(self._ptr, chain, self._bad_recv)
        if rc:
            raise _posting_error(
                rc, "post_recv", self._bad_recv, chain, ffi.sizeof("struct ibv_recv_wr")
            )

    # ---------------------------------------------------------------- state
    def _query(self) -> Any:
        self._check_open("query_qp")
        attr = ffi.new("struct ibv_qp_attr *")
        init = ffi.new("struct ibv_qp_init_attr *")
        lib.check(lib.verbs().ibv_query_qp(self._ptr, attr, _QUERY_MASK, init), "ibv_query_qp")
        return attr

    def _current_state(self, reported: int) -> QPState:
        state = _STATES.get(reported, QPState.ERR)
        if state is QPState.RESET and self._state_hint is not QPState.RESET:
            return self._state_hint  # the device does not report QP states (Linux siw)
        return state

    @property
    def state(self) -> QPState:
        """The current state, as the device reports it.

        Linux siw always reports RESET; then the state is the last one this QP was
        moved to: INIT once a CM id made it, RTS when the CM connected it, ERR after
        the id's ``disconnect()``, the CM's DISCONNECTED, a completion with an error
        status (flushes included) or a fatal async event, or what :meth:`modify` set.
        """
        return self._current_state(self._query().qp_state)

    def query(self) -> QPAttr:
        """Current attributes."""
        attr = self._query()
        c = attr.cap
        return QPAttr(
            qp_state=self._current_state(attr.qp_state),
            qp_type=self.qp_type,
            qp_num=self.qp_num,
            cap=QPCap(
                c.max_send_wr, c.max_recv_wr, c.max_send_sge, c.max_recv_sge, c.max_inline_data
            ),
            max_rd_atomic=attr.max_rd_atomic,
            max_dest_rd_atomic=attr.max_dest_rd_atomic,
            sq_sig_all=self.sq_sig_all,
        )

    def modify(self, *, qp_state: QPState, qkey: int | None = None) -> None:
        """Move the QP to ``qp_state`` (``ibv_modify_qp`` with IBV_QP_STATE).

        ERR is reached from any state, as on iWARP: an IB or RoCE QP still in RESET
        is moved to INIT first, since the kernel's state table for those devices
        (``ib_modify_qp_is_ok``) allows ERR only from INIT on. A UD QP moves to
        INIT with its Q_Key ``qkey`` (default 0) on port 1, pkey index 0, and to RTS
        with send PSN 0; other QPs refuse ``qkey``.
        """
        self._check_open("modify_qp")
        qp_state = QPState(qp_state)
        if self.qp_type is QPType.UD and qp_state in _UD_MASKS:
            fields = {"qkey": qkey or 0, "port_num": 1} if qp_state is QPState.INIT else {}
            self._set_state(qp_state, _UD_MASKS[qp_state], **fields)
            self._state_hint = qp_state
            return
        if qkey is not None:
            raise VerbsError(errno.EINVAL, "modify_qp", "qkey is for a UD QP moving to INIT")
        if (
            qp_state is QPState.ERR
            and self.context.device.transport is not Transport.IWARP
            and self._query().qp_state == QPState.RESET
        ):
            self._set_state(QPState.INIT, _TO_INIT_MASK, port_num=1)
        self._set_state(qp_state, IBV_QP_STATE)
        self._state_hint = qp_state
        if qp_state is QPState.ERR:
            self._went_to_err(ConnectionAbortedError("QP moved to ERROR"))
        elif qp_state is QPState.RESET:
            self._error = None

    def _set_state(self, state: QPState, mask: int, **fields: int) -> None:
        attr = ffi.new("struct ibv_qp_attr *")
        attr.qp_state = state
        for name, value in fields.items():
            setattr(attr, name, value)
        lib.check(lib.verbs().ibv_modify_qp(self._ptr, attr, mask), "ibv_modify_qp")

    def _went_to_err(self, why: Exception) -> None:
        """The QP is in ERR: keep the first cause and tell the error listeners once."""
        self._state_hint = QPState.ERR
        if self._error is None:
            self._error = why
            for listener in list(self.error_listeners):
                listener(why)

    @property
    def error(self) -> Exception | None:
        """Why the QP went to ERR (the first cause seen: a failed completion, the
        connection's end, ``modify``, a fatal async event), if it did."""
        return self._error

    def _connected(self) -> None:
        """A CM id connected this QP; wait_closed now waits for the disconnect."""
        self._state_hint = QPState.RTS
        self._connection_over = trio.Event()

    def _failed(self, why: Exception) -> None:
        """The QP is in ERR: an error or flush completion came from it, an async
        event reported it fatal, or the id's ``rdma_disconnect`` moved it there."""
        if self._state_hint is not QPState.RESET:
            self._went_to_err(why)

    def _disconnected(self, why: Exception, flush: bool = False) -> None:
        """The connection is gone: the QP is in ERR (moved there when ``flush``).

        ``flush`` is for the CM's DISCONNECTED event: then the QP is moved to ERR
        for real, so what is still posted is flushed. Devices that reach ERR on
        their own when the connection ends take this as a no-op; Linux siw does
        not when it drops the connection itself after a failed send (siw_qp_tx.c,
        siw_qp_sq_process calls siw_qp_cm_drop(qp, 0), which never reaches
        siw_qp_llp_close, so the QP stays RTS with its queues unflushed).
        """
        if flush and not self._closed:
            attr = ffi.new("struct ibv_qp_attr *")
            attr.qp_state = QPState.ERR
            rc = lib.verbs().ibv_modify_qp(self._ptr, attr, IBV_QP_STATE)
            if rc:
                log.debug("QP %d to ERR after the disconnect: rc %d", self.qp_num, rc)
        self._state_hint = QPState.ERR
        self._error = self._error or why
        self._connection_over.set()

    async def wait_closed(self) -> None:
        """Wait until the connection is gone (the CM reported DISCONNECTED)."""
        await self._connection_over.wait()

    def _destroy(self) -> None:
        lib.check(lib.verbs().ibv_destroy_qp(self._ptr), "ibv_destroy_qp")
        self._connection_over.set()
        for listener in self.close_listeners:
            listener()
