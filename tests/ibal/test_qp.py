"""QPs: creation checks, IBAL's state rules, binding, and the failure pointer of posted chains."""

from __future__ import annotations

import pytest
from ibal.support import connect, connected_pair, ds, error_of, make_end, poll_n, recv, send

from rdmashim.providers.ibal import (
    IbCa,
    IbError,
    IbPd,
    IbStatus,
    ib_cq_create_t,
    ib_create_cq,
    ib_create_qp,
    ib_modify_qp,
    ib_post_recv,
    ib_post_send,
    ib_qp_create_t,
    ib_qp_mod_t,
    ib_qp_state_t,
    ib_qp_type_t,
    ib_query_ca,
    ib_query_qp,
    ib_remote_ops_t,
    ib_send_opt_t,
    ib_wc_status_t,
    ib_wr_type_t,
    link,
)

S = ib_qp_state_t


def test_creation_checks(ca: IbCa, pd: IbPd) -> None:
    cq = ib_create_cq(ca, ib_cq_create_t(16, lambda *_: None))
    attr = ib_query_ca(ca)

    def create(**fields: object) -> object:
        return ib_create_qp(pd, ib_qp_create_t(**{"h_sq_cq": cq, "h_rq_cq": cq, **fields}))

    cases = [
        ({"qp_type": ib_qp_type_t.IB_QPT_UNRELIABLE_DGRM}, IbStatus.IB_UNSUPPORTED),
        ({"h_rq_cq": None}, IbStatus.IB_INVALID_CQ_HANDLE),
        ({"sq_depth": 0}, IbStatus.IB_INVALID_MAX_WRS),
        ({"rq_depth": attr.max_wrs + 1}, IbStatus.IB_INVALID_MAX_WRS),
        ({"sq_sge": attr.max_sges + 1}, IbStatus.IB_INVALID_MAX_SGE),
        ({"sq_max_inline": attr.max_inline + 1}, IbStatus.IB_INVALID_SETTING),
    ]
    for fields, status in cases:
        assert error_of(lambda f=fields: create(**f)).status is status, fields
    qp = create(qp_type=ib_qp_type_t.IB_QPT_RELIABLE_CONN)
    got = ib_query_qp(qp)
    assert (got.state, got.num, got.h_pd, got.h_sq_cq) == (S.IB_QPS_RESET, 0, pd, cq)


def test_state_rules_before_binding(ca: IbCa) -> None:
    qp = make_end(ca).qp

    def move(state: ib_qp_state_t) -> None:
        ib_modify_qp(qp, ib_qp_mod_t(state))

    for bad in (S.IB_QPS_RTR, S.IB_QPS_RTS):
        assert error_of(lambda b=bad: move(b)).status is IbStatus.IB_INVALID_QP_STATE
    for good in (S.IB_QPS_INIT, S.IB_QPS_INIT, S.IB_QPS_RTR, S.IB_QPS_RTS, S.IB_QPS_RTS):
        move(good)
        assert ib_query_qp(qp).state is good
    assert error_of(lambda: move(S.IB_QPS_INIT)).status is IbStatus.IB_INVALID_QP_STATE
    move(S.IB_QPS_ERROR)
    assert error_of(lambda: move(S.IB_QPS_RTS)).status is IbStatus.IB_INVALID_QP_STATE
    move(S.IB_QPS_RESET)
    move(S.IB_QPS_INIT)
    assert error_of(lambda: ib_modify_qp(qp, ib_qp_mod_t(0x3))).status is (
        IbStatus.IB_INVALID_SETTING
    )


def test_sends_need_a_bound_qp_in_rts(ca: IbCa) -> None:
    end = make_end(ca)
    ib_modify_qp(end.qp, ib_qp_mod_t(S.IB_QPS_INIT))
    ib_modify_qp(end.qp, ib_qp_mod_t(S.IB_QPS_RTR))
    ib_modify_qp(end.qp, ib_qp_mod_t(S.IB_QPS_RTS))
    wr = send(1, ds(end))
    error = error_of(lambda: ib_post_send(end.qp, wr))
    assert (error.status, error.failed_wr) == (IbStatus.IB_INVALID_QP_STATE, wr)


def test_held_receives_are_bounded_by_rq_depth(ca: IbCa) -> None:
    end = make_end(ca, rq_depth=2)
    wrs = [recv(i, ds(end)) for i in range(3)]
    error = error_of(lambda: ib_post_recv(end.qp, link(wrs)))
    assert (error.status, error.failed_wr) == (IbStatus.IB_INSUFFICIENT_RESOURCES, wrs[2])
    assert end.qp._held and [w.wr_id for w in end.qp._held] == [0, 1]


def test_binding_posts_the_held_receives_and_the_state_follows(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    assert ib_query_qp(client.qp).state is S.IB_QPS_RTS
    assert ib_query_qp(server.qp).state is S.IB_QPS_RTS
    assert ib_query_qp(client.qp).num == client.qp.qp.qp_num != 0
    error = error_of(lambda: client.qp.bind(None))
    assert error.status is IbStatus.IB_INVALID_STATE
    ib_post_send(client.qp, send(1, ds(client, 0, 5)))
    (wc,) = poll_n(server.cq, 1)
    assert (wc.wr_id, wc.length) == (100, 5)
    # a bound QP is moved by its connection, except to ERROR
    error = error_of(lambda: ib_modify_qp(client.qp, ib_qp_mod_t(S.IB_QPS_RESET)))
    assert error.status is IbStatus.IB_UNSUPPORTED
    ib_modify_qp(client.qp, ib_qp_mod_t(S.IB_QPS_RTS))  # where it is: nothing to do
    ib_modify_qp(client.qp, ib_qp_mod_t(S.IB_QPS_ERROR))
    assert ib_query_qp(client.qp).state is S.IB_QPS_ERROR


def test_a_refused_request_is_the_failure_pointer_and_those_before_are_posted(
    ca: IbCa,
) -> None:
    client, server = connected_pair(ca)
    too_many = [ds(client)] * (ib_query_qp(client.qp).sq_sge + 1)
    first, second, third = send(1, ds(client, 0, 3)), send(2, *too_many), send(3, ds(client))
    error = error_of(lambda: ib_post_send(client.qp, link([first, second, third])))
    assert (error.status, error.failed_wr) == (IbStatus.IB_INVALID_MAX_SGE, second)
    (sent,) = poll_n(client.cq, 1)
    assert (sent.wr_id, sent.status) == (1, ib_wc_status_t.IB_WCS_SUCCESS)
    (got,) = poll_n(server.cq, 1)
    assert (got.wr_id, got.length) == (100, 3)


def test_a_chain_reaches_the_hca_in_one_post(ca: IbCa, monkeypatch: pytest.MonkeyPatch) -> None:
    """One post of the whole chain (one doorbell), as a verbs provider takes a linked list:
    kernel siw sends a request inside the doorbell that finds its send queue idle, so a
    post per request let a long chain of Writes leave before the caller's next call."""
    client, server = connected_pair(ca)
    hca_qp = client.qp.qp
    posts: list[list[int]] = []

    def post_send(wrs: list) -> None:
        posts.append([w.wr_id for w in wrs])
        type(hca_qp).post_send(hca_qp, wrs)

    monkeypatch.setattr(hca_qp, "post_send", post_send)
    ib_post_send(client.qp, link([send(i, ds(client, 0, 4)) for i in (1, 2, 3)]))
    assert posts == [[1, 2, 3]]
    assert [wc.wr_id for wc in poll_n(client.cq, 3)] == [1, 2, 3]
    # The HCA refusing one of the chain (its send queue is full) names that request.
    depth = ib_query_qp(client.qp).sq_depth
    there = ib_remote_ops_t(server.vaddr, server.rkey)
    write = {"wr_type": ib_wr_type_t.WR_RDMA_WRITE, "remote_ops": there}
    chain = [send(10 + i, ds(client, 0, 4), **write) for i in range(depth + 2)]
    error = error_of(lambda: ib_post_send(client.qp, link(chain)))
    assert (error.status, error.failed_wr) == (IbStatus.IB_INSUFFICIENT_RESOURCES, chain[depth])
    assert len(posts) == 2


def test_work_request_types_the_hca_lacks(ca: IbCa) -> None:
    client, _ = connected_pair(ca)
    atomic = send(1, ds(client, 0, 8), wr_type=ib_wr_type_t.WR_FETCH_ADD)
    error = error_of(lambda: ib_post_send(client.qp, atomic))
    assert (error.status, error.failed_wr) == (IbStatus.IB_UNSUPPORTED, atomic)
    unknown = send(2, ds(client), wr_type=42)
    assert error_of(lambda: ib_post_send(client.qp, unknown)).status is (
        IbStatus.IB_INVALID_WR_TYPE
    )
    both = ib_send_opt_t.IB_SEND_OPT_IMMEDIATE | ib_send_opt_t.IB_SEND_OPT_INVALIDATE
    assert error_of(lambda: ib_post_send(client.qp, send(3, send_opt=both))).status is (
        IbStatus.IB_INVALID_SETTING
    )


def test_binding_an_errored_qp_is_refused(ca: IbCa) -> None:
    end, other = make_end(ca), make_end(ca)
    ib_modify_qp(end.qp, ib_qp_mod_t(S.IB_QPS_ERROR))
    with pytest.raises(IbError) as info:
        connect(ca, end.qp, other.qp)
    assert info.value.status is IbStatus.IB_INVALID_QP_STATE
