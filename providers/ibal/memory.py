"""Protection domains and memory regions: ``ib_alloc_pd`` ... ``ib_dereg_mr``.

A region is any writable Python buffer (``bytearray``, ``memoryview``,
``mmap``, numpy array), registered without copying; its address for work
requests and for the peer (``vaddr`` in ``ib_local_ds_t`` and
``remote_ops``) is the buffer's own address, which :attr:`IbMr.vaddr` and
``ib_query_mr`` report.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any

from rdmashim.providers.ibal.al import DestroyCallback, Handle
from rdmashim.providers.ibal.ca import IbCa, close_quietly
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.verbs.enums import Access


class ib_pd_type_t(IntEnum):
    """``ib_pd_type_t``; only IB_PDT_NORMAL (a PD for connected QPs) is supported."""

    IB_PDT_NORMAL = 0
    IB_PDT_ALIAS = 1
    IB_PDT_SQP = 2
    IB_PDT_UD = 3


class ib_access_t(IntFlag):
    """``ib_access_t``: the ``IB_AC_*`` access rights, IBAL's values."""

    NONE = 0
    IB_AC_RDMA_READ = 0x1
    IB_AC_RDMA_WRITE = 0x2
    IB_AC_ATOMIC = 0x4
    IB_AC_LOCAL_WRITE = 0x8
    IB_AC_MW_BIND = 0x10
    IB_AC_NOT_CACHABLE = 0x80000000


_ACCESS = (
    (ib_access_t.IB_AC_RDMA_READ, Access.REMOTE_READ),
    (ib_access_t.IB_AC_RDMA_WRITE, Access.REMOTE_WRITE),
    (ib_access_t.IB_AC_ATOMIC, Access.REMOTE_ATOMIC),
    (ib_access_t.IB_AC_LOCAL_WRITE, Access.LOCAL_WRITE),
    (ib_access_t.IB_AC_MW_BIND, Access.MW_BIND),
)


def to_access(access_ctrl: int) -> Access:
    """The portable access flags of ``IB_AC_*`` flags (IB_AC_NOT_CACHABLE has none)."""
    out = Access.NONE
    for ib, portable in _ACCESS:
        if access_ctrl & ib:
            out |= portable
    return out


def from_access(access: Access) -> ib_access_t:
    """The ``IB_AC_*`` flags of portable access flags."""
    out = ib_access_t.NONE
    for ib, portable in _ACCESS:
        if access & portable:
            out |= ib
    return out


class IbPd(Handle):
    """A protection domain (``ib_pd_handle_t``); ``pd`` is the portable PD, ``ca`` its CA."""

    invalid = IbStatus.IB_INVALID_PD_HANDLE

    def __init__(self, ca: IbCa, portable: Any, pd_type: ib_pd_type_t, pd_context: Any) -> None:
        super().__init__(ca.al, ca, pd_context)
        self.ca = ca
        self.pd = portable
        self.pd_type = pd_type

    def _close_resources(self) -> None:
        close_quietly(self.pd)


@dataclass(slots=True)
class ib_mr_create_t:
    """``ib_mr_create_t``: the region (a writable buffer), its length and access rights.

    ``vaddr`` is the buffer itself (IBAL's pointer); ``length`` bytes from its
    start are registered (None: all of it).
    """

    vaddr: Any
    length: int | None = None
    access_ctrl: ib_access_t = ib_access_t.IB_AC_LOCAL_WRITE
    iova: int | None = None
    """An extension: the address work requests and the peer use for the first byte
    (``ibv_reg_mr_iova``; None: the buffer's own address, as IBAL)."""


@dataclass(frozen=True, slots=True)
class ib_mr_attr_t:
    """``ib_mr_attr_t``: the region's PD, bounds (inclusive upper bounds), rights and keys."""

    h_pd: IbPd
    local_lb: int
    local_ub: int
    remote_lb: int
    remote_ub: int
    access_ctrl: ib_access_t
    lkey: int
    rkey: int


class IbMr(Handle):
    """A registered region (``ib_mr_handle_t``); ``mr`` is the portable MR."""

    invalid = IbStatus.IB_INVALID_MR_HANDLE

    def __init__(self, pd: IbPd, portable: Any) -> None:
        super().__init__(pd.al, pd, None)
        self.pd = pd
        self.mr = portable

    @property
    def vaddr(self) -> int:
        """The address of the region's first byte in work requests."""
        return int(self.mr.iova)

    @property
    def length(self) -> int:
        """The region's length in bytes."""
        return int(self.mr.length)

    def query(self) -> ib_mr_attr_t:
        """The ``ib_query_mr`` body."""
        self.check("ib_query_mr")
        access = from_access(self.mr.access)
        last = self.vaddr + self.length - 1
        remote = bool(access & (ib_access_t.IB_AC_RDMA_READ | ib_access_t.IB_AC_RDMA_WRITE))
        return ib_mr_attr_t(
            h_pd=self.pd,
            local_lb=self.vaddr,
            local_ub=last,
            remote_lb=self.vaddr if remote else 0,
            remote_ub=last if remote else 0,
            access_ctrl=access,
            lkey=self.mr.lkey,
            rkey=self.mr.rkey,
        )

    def _close_resources(self) -> None:
        close_quietly(self.mr)


def ib_alloc_pd(
    h_ca: IbCa, pd_type: ib_pd_type_t = ib_pd_type_t.IB_PDT_NORMAL, pd_context: Any = None
) -> IbPd:
    """A new protection domain on the CA (``ib_alloc_pd``); IB_PDT_NORMAL only."""
    h_ca.check("ib_alloc_pd")
    if pd_type != ib_pd_type_t.IB_PDT_NORMAL:
        raise IbError(IbStatus.IB_UNSUPPORTED, "ib_alloc_pd", f"{ib_pd_type_t(pd_type).name}")
    return h_ca.al.call("ib_alloc_pd", _alloc_pd, h_ca, pd_type, pd_context)


def _alloc_pd(ca: IbCa, pd_type: ib_pd_type_t, pd_context: Any) -> IbPd:
    ca.check("ib_alloc_pd")
    return IbPd(ca, ca.context.alloc_pd(), ib_pd_type_t(pd_type), pd_context)


def ib_dealloc_pd(h_pd: IbPd, pfn_destroy_cb: DestroyCallback = None) -> None:
    """Destroy the PD and what was created on it (``ib_dealloc_pd``)."""
    h_pd.destroy("ib_dealloc_pd", pfn_destroy_cb)


def ib_reg_mem(h_pd: IbPd, mr_create: ib_mr_create_t) -> tuple[int, int, IbMr]:
    """Register a buffer (``ib_reg_mem``): returns ``(lkey, rkey, h_mr)``."""
    h_pd.check("ib_reg_mem")
    mr = h_pd.al.call("ib_reg_mem", _reg_mem, h_pd, mr_create)
    return mr.mr.lkey, mr.mr.rkey, mr


def _reg_mem(pd: IbPd, create: ib_mr_create_t) -> IbMr:
    pd.check("ib_reg_mem")
    try:
        view = memoryview(create.vaddr).cast("B")
    except TypeError as exc:
        raise IbError(IbStatus.IB_INVALID_PARAMETER, "ib_reg_mem", "vaddr is not a buffer") from exc
    length = view.nbytes if create.length is None else create.length
    if not 0 < length <= view.nbytes:
        raise IbError(
            IbStatus.IB_INVALID_PARAMETER, "ib_reg_mem", f"length {length} of {view.nbytes} bytes"
        )
    access = to_access(create.access_ctrl)
    try:
        portable = pd.pd.reg_mr(view[:length], access, iova=create.iova)
    except (BufferError, TypeError) as exc:
        raise IbError(IbStatus.IB_INVALID_PERMISSION, "ib_reg_mem", str(exc)) from exc
    except OSError as exc:
        if exc.errno == errno.EACCES:  # write access to a read-only buffer
            raise IbError(IbStatus.IB_INVALID_PERMISSION, "ib_reg_mem", str(exc)) from exc
        raise
    return IbMr(pd, portable)


def ib_query_mr(h_mr: IbMr) -> ib_mr_attr_t:
    """The region's attributes (``ib_query_mr``)."""
    return h_mr.al.call("ib_query_mr", h_mr.query)


def ib_dereg_mr(h_mr: IbMr) -> None:
    """Deregister the region (``ib_dereg_mr``; synchronous, as in IBAL)."""
    h_mr.destroy("ib_dereg_mr", None)
