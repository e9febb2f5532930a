"""Work requests: ``ib_send_wr_t``, ``ib_recv_wr_t``, ``ib_local_ds_t``, and posting chains.

IBAL posts chains of work requests linked through ``p_next``; a refused
request is reported through a failure pointer and the ones before it stay
posted. The facade hands a chain to the HCA in one post (as a verbs provider
takes a linked list and rings its doorbell once) and, at the first request
refused, raises :class:`IbError` whose ``failed_wr`` is that request.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any, TypeVar

from rdmashim.providers.ibal.al import as_status
from rdmashim.providers.ibal.linked import walk
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.verbs.enums import SendFlags, WROpcode
from rdmashim.verbs.wr import SGE, RecvWR, SendWR

W = TypeVar("W")
P = TypeVar("P")


class ib_wr_type_t(IntEnum):
    """``ib_wr_type_t``, value for value."""

    WR_SEND = 0
    WR_RDMA_WRITE = 1
    WR_RDMA_READ = 2
    WR_COMPARE_SWAP = 3
    WR_FETCH_ADD = 4
    WR_LSO = 5
    WR_NOP = 6
    WR_LOCAL_INV = 7
    WR_FAST_REG_MR = 8
    WR_UNKNOWN = 9


class ib_send_opt_t(IntFlag):
    """``ib_send_opt_t``: the ``IB_SEND_OPT_*`` flags, IBAL's values.

    IB_SEND_OPT_INVALIDATE is the facade's own (IBAL has no spelling for
    iWARP's Send with Invalidate): with WR_SEND it invalidates
    ``invalidate_rkey`` at the peer.
    """

    NONE = 0
    IB_SEND_OPT_IMMEDIATE = 0x1
    IB_SEND_OPT_FENCE = 0x2
    IB_SEND_OPT_SIGNALED = 0x4
    IB_SEND_OPT_SOLICITED = 0x8
    IB_SEND_OPT_INLINE = 0x10
    IB_SEND_OPT_LOCAL = 0x20
    IB_SEND_OPT_TX_IP_CSUM = 0x40
    IB_SEND_OPT_TX_TCP_UDP_CSUM = 0x80
    IB_SEND_OPT_INVALIDATE = 0x100


@dataclass(slots=True)
class ib_local_ds_t:
    """``ib_local_ds_t``: ``length`` bytes at ``vaddr`` in the region of ``lkey``."""

    vaddr: int
    length: int
    lkey: int


@dataclass(slots=True)
class ib_remote_ops_t:
    """``ib_send_wr_t.remote_ops``: the peer's buffer for RDMA (and atomic operands)."""

    vaddr: int = 0
    rkey: int = 0
    atomic1: int = 0
    atomic2: int = 0


@dataclass(slots=True)
class ib_send_wr_t:
    """``ib_send_wr_t``: a send queue work request, linked through ``p_next``.

    ``ds_array`` holds :class:`ib_local_ds_t`; ``num_ds`` (None: all of them)
    how many count. ``immediate_data`` (host order) goes with
    IB_SEND_OPT_IMMEDIATE, ``invalidate_rkey`` with IB_SEND_OPT_INVALIDATE.
    """

    wr_id: int = 0
    p_next: ib_send_wr_t | None = None
    ds_array: list[ib_local_ds_t] = field(default_factory=list)
    num_ds: int | None = None
    wr_type: ib_wr_type_t = ib_wr_type_t.WR_SEND
    send_opt: ib_send_opt_t = ib_send_opt_t.IB_SEND_OPT_SIGNALED
    immediate_data: int = 0
    invalidate_rkey: int = 0
    remote_ops: ib_remote_ops_t = field(default_factory=ib_remote_ops_t)


@dataclass(slots=True)
class ib_recv_wr_t:
    """``ib_recv_wr_t``: a receive work request, linked through ``p_next``."""

    p_next: ib_recv_wr_t | None = None
    wr_id: int = 0
    ds_array: list[ib_local_ds_t] = field(default_factory=list)
    num_ds: int | None = None


def _sges(call: str, wr: Any, max_sge: int) -> list[SGE]:
    ds = wr.ds_array if wr.num_ds is None else wr.ds_array[: wr.num_ds]
    if wr.num_ds is not None and not 0 <= wr.num_ds <= len(wr.ds_array):
        raise IbError(IbStatus.IB_INVALID_PARAMETER, call, f"num_ds {wr.num_ds}")
    if len(ds) > max_sge:
        raise IbError(IbStatus.IB_INVALID_MAX_SGE, call, f"{len(ds)} segments > {max_sge}")
    return [SGE(d.vaddr, d.length, d.lkey) for d in ds]


def to_recv_wr(call: str, wr: ib_recv_wr_t, max_sge: int) -> RecvWR:
    """The portable receive request of ``wr`` (IB_INVALID_MAX_SGE past ``max_sge``)."""
    return RecvWR(wr.wr_id, _sges(call, wr, max_sge))


_FLAGS = (
    (ib_send_opt_t.IB_SEND_OPT_SIGNALED, SendFlags.SIGNALED),
    (ib_send_opt_t.IB_SEND_OPT_FENCE, SendFlags.FENCE),
    (ib_send_opt_t.IB_SEND_OPT_SOLICITED, SendFlags.SOLICITED),
    (ib_send_opt_t.IB_SEND_OPT_INLINE, SendFlags.INLINE),
)
Opt = ib_send_opt_t


def _opcode(wr: ib_send_wr_t) -> WROpcode:
    kind, opt = wr.wr_type, wr.send_opt
    if kind == ib_wr_type_t.WR_SEND:
        if opt & Opt.IB_SEND_OPT_IMMEDIATE and opt & Opt.IB_SEND_OPT_INVALIDATE:
            raise IbError(IbStatus.IB_INVALID_SETTING, "ib_post_send", "immediate and invalidate")
        if opt & Opt.IB_SEND_OPT_IMMEDIATE:
            return WROpcode.SEND_WITH_IMM
        return WROpcode.SEND_WITH_INV if opt & Opt.IB_SEND_OPT_INVALIDATE else WROpcode.SEND
    if kind == ib_wr_type_t.WR_RDMA_WRITE:
        if opt & Opt.IB_SEND_OPT_IMMEDIATE:
            return WROpcode.RDMA_WRITE_WITH_IMM
        return WROpcode.RDMA_WRITE
    if kind == ib_wr_type_t.WR_RDMA_READ:
        return WROpcode.RDMA_READ
    if kind == ib_wr_type_t.WR_LOCAL_INV:
        return WROpcode.LOCAL_INV
    try:
        name = ib_wr_type_t(kind).name
    except ValueError:
        raise IbError(IbStatus.IB_INVALID_WR_TYPE, "ib_post_send", f"wr_type {kind}") from None
    raise IbError(IbStatus.IB_UNSUPPORTED, "ib_post_send", f"{name} over the portable API")


def to_send_wr(wr: ib_send_wr_t, max_sge: int) -> SendWR:
    """The portable send request of ``wr``.

    Atomics, LSO, NOP and fast registration have no portable spelling
    (IB_UNSUPPORTED); an unknown ``wr_type`` is IB_INVALID_WR_TYPE.
    """
    opcode = _opcode(wr)
    flags = SendFlags.NONE
    for ib, portable in _FLAGS:
        if wr.send_opt & ib:
            flags |= portable
    return SendWR(
        wr_id=wr.wr_id,
        opcode=opcode,
        sg_list=_sges("ib_post_send", wr, max_sge),
        send_flags=flags,
        remote_addr=wr.remote_ops.vaddr,
        rkey=wr.remote_ops.rkey,
        invalidate_rkey=wr.invalidate_rkey,
        imm_data=wr.immediate_data,
    )


def post_chain(
    call: str,
    head: W | None,
    convert: Callable[[W], P],
    post: Callable[[list[P]], None],
) -> None:
    """Post the chain at ``head``: each request made portable with ``convert``, then all
    of them with one ``post`` call (one doorbell for the HCA, as ``ibv_post_send`` of a
    linked list rings once).

    The first request refused, by ``convert`` or by ``post`` (whose error names it by
    its index, ``bad_wr``), raises :class:`IbError` (a portable error mapped to its
    status) with ``failed_wr`` set to that request; those before it stay posted.
    """
    if head is None:
        raise IbError(IbStatus.IB_INVALID_PARAMETER, call, "no work request")
    chain = list(walk(head))
    portable: list[P] = []
    refused: IbError | None = None
    for wr in chain:
        try:
            portable.append(convert(wr))
        except IbError as exc:
            exc.failed_wr = wr
            refused = exc
            break
    if portable:
        try:
            with as_status(call):
                try:
                    post(portable)
                except IbError:
                    raise
                except OSError as exc:
                    status = _POST_STATUS.get(exc.errno or 0)
                    if status is None:
                        raise
                    raise IbError(status, call, str(exc)) from exc
        except IbError as exc:
            cause = exc if exc.__cause__ is None else exc.__cause__
            exc.failed_wr = chain[getattr(cause, "bad_wr", None) or 0]
            raise
    if refused is not None:
        raise refused


_POST_STATUS = {
    errno.ENOMEM: IbStatus.IB_INSUFFICIENT_RESOURCES,  # the queue is full
    errno.ENOTCONN: IbStatus.IB_INVALID_QP_STATE,
}
"""Where a post's refusal means something more precise than the general errno map."""
