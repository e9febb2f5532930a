"""Protection domains and memory regions over libibverbs.

``reg_mr`` registers any buffer-protocol object in place: the buffer is
pinned (:func:`rdmashim.verbs.buffers.pin`: a ``bytearray`` cannot be resized
while registered) and its address goes to ``ibv_reg_mr``, so the device reads
and writes the Python object's own memory.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rdmashim.providers.rdmacore import lib
from rdmashim.providers.rdmacore.base import Resource
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.completion import CQ
from rdmashim.providers.rdmacore.queue_pair import AH, QP, SRQ
from rdmashim.verbs import abc
from rdmashim.verbs.attrs import AHAttr, QPCap
from rdmashim.verbs.backend import own
from rdmashim.verbs.buffers import PinnedBuffer, PinnedRegion, pin
from rdmashim.verbs.enums import Access, QPType, Transport
from rdmashim.verbs.errors import NotSupported, VerbsError, check_access

IGNORES_IOVA = frozenset({0x626D74})
"""Vendor ids of devices that take ``ibv_reg_mr_iova`` but address the region by its
virtual address anyway: Linux siw (``siw_reg_user_mr``: "rnic_va: not used by siw")."""

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from rdmashim.providers.rdmacore.device import Context


class PD(Resource):
    """A protection domain (``ibv_pd``)."""

    _kind = "protection domain"

    def __init__(self, context: Context) -> None:
        super().__init__(context)
        self.context = context
        self._ptr = lib.check_ptr(lib.verbs().ibv_alloc_pd(context._ptr), "ibv_alloc_pd")
        self._created()

    def reg_mr(
        self, buffer: Buffer, access: Access = Access.LOCAL_WRITE, *, iova: int | None = None
    ) -> MR:
        """Register any buffer-protocol object without copying it.

        ``iova`` is the address the region's first byte has for local and remote
        access (``ibv_reg_mr_iova``; 0 gives a zero-based region); by default it
        is the buffer's own address.
        """
        self._check_open("reg_mr")
        return MR(self, buffer, check_access("reg_mr", access), iova)

    def create_qp(
        self,
        *,
        send_cq: abc.CQ,
        recv_cq: abc.CQ,
        cap: QPCap | None = None,
        srq: abc.SRQ | None = None,
        sq_sig_all: bool = False,
        qp_type: QPType = QPType.RC,
    ) -> QP:
        """A queue pair; a CM id (or the application, on IB) connects it."""
        return self._create_qp(
            send_cq, recv_cq, cap, srq, sq_sig_all, qp_type,
            lambda attr: lib.check_ptr(lib.verbs().ibv_create_qp(self._ptr, attr), "ibv_create_qp"),
        )  # fmt: skip

    def _create_qp(
        self,
        send_cq: abc.CQ,
        recv_cq: abc.CQ,
        cap: QPCap | None,
        srq: abc.SRQ | None,
        sq_sig_all: bool,
        qp_type: QPType,
        create: Callable[[Any], Any],
    ) -> QP:
        """A QP whose C object ``create(init_attr)`` makes (ibv_create_qp, rdma_create_qp)."""
        self._check_open("create_qp")
        if qp_type == QPType.UD:
            self._check_ud("create_qp")
        return QP(
            self,
            own(send_cq, CQ, "create_qp"),
            own(recv_cq, CQ, "create_qp"),
            cap or QPCap(),
            None if srq is None else own(srq, SRQ, "create_qp"),
            sq_sig_all,
            qp_type,
            create,
        )

    def create_srq(self, max_wr: int = 128, max_sge: int = 1) -> SRQ:
        """A shared receive queue for QPs of this PD."""
        self._check_open("create_srq")
        return SRQ(self, max_wr, max_sge)

    def create_ah(self, attr: AHAttr) -> AH:
        """An address handle for UD sends (``ibv_create_ah``)."""
        self._check_open("create_ah")
        self._check_ud("create_ah")
        return AH(self, attr)

    def _check_ud(self, operation: str) -> None:
        if self.context.device.transport is Transport.IWARP:
            raise NotSupported(operation, "UD (iWARP has no UD: RC only)")

    def _destroy(self) -> None:
        lib.check(lib.verbs().ibv_dealloc_pd(self._ptr), "ibv_dealloc_pd")


class MR(PinnedRegion, Resource):
    """A registered memory region (``ibv_mr``) over a pinned Python buffer."""

    _kind = "memory region"

    def __init__(self, pd: PD, buffer: Buffer, access: Access, iova: int | None) -> None:
        super().__init__(pd)
        self.pd = pd
        self.access = access
        """Access rights the region was registered with."""
        pinned: PinnedBuffer = pin(buffer, writable=bool(access & Access.LOCAL_WRITE))
        start = ffi.cast("void *", pinned.addr)
        try:
            if iova is None:
                mr = lib.verbs().ibv_reg_mr(pd._ptr, start, pinned.length, int(access))
            else:
                if not 0 <= iova <= (1 << 64) - pinned.length:
                    raise VerbsError(errno.EINVAL, "reg_mr", f"iova {iova} does not fit 64 bits")
                if iova != pinned.addr and pd.context.query_device().vendor_id in IGNORES_IOVA:
                    raise NotSupported(
                        "reg_mr", "this device addresses regions by virtual address only "
                        "(Linux siw: rnic_va is not used)",
                    )  # fmt: skip
                reg = lib.function(lib.verbs(), "ibv_reg_mr_iova")
                mr = reg(pd._ptr, start, pinned.length, iova, int(access))
            self._ptr = lib.check_ptr(mr, "ibv_reg_mr")
        except BaseException:
            pinned.release()
            raise
        self._pinned = pinned
        self._iova: int = pinned.addr if iova is None else iova
        self._lkey: int = self._ptr.lkey
        self._rkey: int = self._ptr.rkey
        self._created()

    @property
    def iova(self) -> int:
        """The address of the first byte for work requests and the peer."""
        return self._iova

    @property
    def lkey(self) -> int:
        """Local key."""
        return self._lkey

    @property
    def rkey(self) -> int:
        """Remote key."""
        return self._rkey

    def _destroy(self) -> None:
        lib.check(lib.verbs().ibv_dereg_mr(self._ptr), "ibv_dereg_mr")
        self._pinned.release()

    dereg = Resource.close
