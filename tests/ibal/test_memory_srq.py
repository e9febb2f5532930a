"""PDs, memory registration (IB_AC_* rights, ib_query_mr) and shared receive queues."""

from __future__ import annotations

import pytest
from ibal.support import connect, ds, make_end, poll_n, recv, send, status_of

from rdmashim.providers.ibal import (
    IbCa,
    IbError,
    IbPd,
    IbStatus,
    ib_access_t,
    ib_alloc_pd,
    ib_create_qp,
    ib_create_srq,
    ib_destroy_qp,
    ib_destroy_srq,
    ib_modify_srq,
    ib_mr_create_t,
    ib_pd_type_t,
    ib_post_recv,
    ib_post_send,
    ib_post_srq_recv,
    ib_qp_create_t,
    ib_query_ca,
    ib_query_mr,
    ib_query_srq,
    ib_reg_mem,
    ib_srq_attr_mask_t,
    ib_srq_attr_t,
    link,
)
from rdmashim.providers.ibal.memory import from_access, to_access
from rdmashim.verbs.enums import Access

AC = ib_access_t


def test_access_flags_map_both_ways() -> None:
    every = AC.IB_AC_RDMA_READ | AC.IB_AC_RDMA_WRITE | AC.IB_AC_ATOMIC | AC.IB_AC_LOCAL_WRITE
    every |= AC.IB_AC_MW_BIND
    assert to_access(every) == (
        Access.REMOTE_READ
        | Access.REMOTE_WRITE
        | Access.REMOTE_ATOMIC
        | Access.LOCAL_WRITE
        | Access.MW_BIND
    )
    assert from_access(to_access(every)) == every
    assert to_access(AC.IB_AC_NOT_CACHABLE) == Access.NONE


def test_registration(pd: IbPd) -> None:
    buf = bytearray(1000)
    access = AC.IB_AC_LOCAL_WRITE | AC.IB_AC_RDMA_WRITE
    lkey, rkey, mr = ib_reg_mem(pd, ib_mr_create_t(buf, 600, access))
    attr = ib_query_mr(mr)
    assert (attr.lkey, attr.rkey, attr.h_pd, attr.access_ctrl) == (lkey, rkey, pd, access)
    assert attr.local_ub - attr.local_lb == 599 == attr.remote_ub - attr.remote_lb
    assert attr.local_lb == mr.vaddr
    local_only = ib_query_mr(ib_reg_mem(pd, ib_mr_create_t(buf))[2])
    assert (local_only.remote_lb, local_only.remote_ub) == (0, 0)
    assert status_of(lambda: ib_reg_mem(pd, ib_mr_create_t(buf, 1001))) is (
        IbStatus.IB_INVALID_PARAMETER
    )
    assert status_of(lambda: ib_reg_mem(pd, ib_mr_create_t(42))) is (IbStatus.IB_INVALID_PARAMETER)
    read_only = ib_mr_create_t(b"constant", None, AC.IB_AC_LOCAL_WRITE)
    assert status_of(lambda: ib_reg_mem(pd, read_only)) is IbStatus.IB_INVALID_PERMISSION
    ib_reg_mem(pd, ib_mr_create_t(b"constant", None, AC.IB_AC_RDMA_READ))


def test_only_normal_pds(ca: IbCa) -> None:
    assert status_of(lambda: ib_alloc_pd(ca, ib_pd_type_t.IB_PDT_ALIAS)) is (
        IbStatus.IB_UNSUPPORTED
    )
    assert ib_alloc_pd(ca, ib_pd_type_t.IB_PDT_NORMAL, "pd-ctx").user_context == "pd-ctx"


def test_srq_limits_and_what_the_hca_cannot_do(ca: IbCa, pd: IbPd) -> None:
    attr = ib_query_ca(ca)
    for bad, status in (
        (ib_srq_attr_t(0, 1), IbStatus.IB_INVALID_MAX_WRS),
        (ib_srq_attr_t(attr.max_srq_wrs + 1, 1), IbStatus.IB_INVALID_MAX_WRS),
        (ib_srq_attr_t(8, attr.max_srq_sges + 1), IbStatus.IB_INVALID_MAX_SGE),
        (ib_srq_attr_t(8, 1, 4), IbStatus.IB_UNSUPPORTED),
    ):
        assert status_of(lambda b=bad: ib_create_srq(pd, b)) is status
    srq = ib_create_srq(pd, ib_srq_attr_t(8, 2))
    assert ib_query_srq(srq) == ib_srq_attr_t(8, 2, 0)
    mask = ib_srq_attr_mask_t.IB_SRQ_MAX_WR
    assert status_of(lambda: ib_modify_srq(srq, ib_srq_attr_t(16), mask)) is (
        IbStatus.IB_UNSUPPORTED
    )
    assert status_of(lambda: ib_modify_srq(srq, ib_srq_attr_t(16), ib_srq_attr_mask_t.NONE)) is (
        IbStatus.IB_INVALID_SETTING
    )


def test_receiving_through_an_srq(ca: IbCa) -> None:
    server = make_end(ca)
    srq = ib_create_srq(server.pd, ib_srq_attr_t(8, 1), "srq-ctx")
    other = make_end(ca)
    qp = ib_create_qp(
        server.pd, ib_qp_create_t(h_sq_cq=server.cq, h_rq_cq=server.cq, h_srq=srq, rq_depth=0)
    )
    assert status_of(lambda: ib_post_recv(qp, recv(1, ds(server)))) is (
        IbStatus.IB_INVALID_PARAMETER
    )
    too_many = recv(2, ds(server), ds(server, 64))
    first = recv(1, ds(server, 0, 64))
    with pytest.raises(IbError) as info:
        ib_post_srq_recv(srq, link([first, too_many]))
    assert (info.value.status, info.value.failed_wr) == (IbStatus.IB_INVALID_MAX_SGE, too_many)
    connect(ca, other.qp, qp)
    other.buf[:3] = b"srq"
    ib_post_send(other.qp, send(9, ds(other, 0, 3)))
    (wc,) = poll_n(server.cq, 1)
    assert (wc.wr_id, wc.length, bytes(server.buf[:3])) == (1, 3, b"srq")
    assert status_of(lambda: ib_destroy_srq(srq)) is IbStatus.IB_RESOURCE_BUSY
    ib_destroy_qp(qp)
    ib_destroy_srq(srq)
    assert status_of(lambda: ib_query_srq(srq)) is IbStatus.IB_INVALID_SRQ_HANDLE
