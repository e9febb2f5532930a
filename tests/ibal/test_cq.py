"""CQs: creation rules, one-shot and n-entry notification, linked-list polls, wait objects."""

from __future__ import annotations

import threading

import trio
from ibal.support import (
    WAIT,
    Completions,
    connect,
    connected_pair,
    ds,
    make_end,
    poll_n,
    recv,
    send,
    status_of,
)

from rdmashim.providers.ibal import (
    IbCa,
    IbCq,
    IbStatus,
    WaitObject,
    ib_cq_create_t,
    ib_create_cq,
    ib_destroy_cq,
    ib_destroy_qp,
    ib_modify_cq,
    ib_modify_qp,
    ib_peek_cq,
    ib_poll_cq,
    ib_post_recv,
    ib_post_send,
    ib_qp_mod_t,
    ib_qp_state_t,
    ib_query_ca,
    ib_query_cq,
    ib_rearm_cq,
    ib_rearm_n_cq,
    ib_send_opt_t,
    ib_wc_status_t,
    ib_wc_t,
    ib_wc_type_t,
    link,
    walk,
    wc_list,
)

QUIET = 0.2
"""Seconds to watch for a callback that must not come."""


def test_callback_or_wait_object_exactly_one(ca: IbCa) -> None:
    both = ib_cq_create_t(16, Completions(), WaitObject())
    assert status_of(lambda: ib_create_cq(ca, both)) is IbStatus.IB_INVALID_SETTING
    neither = ib_cq_create_t(16)
    assert status_of(lambda: ib_create_cq(ca, neither)) is IbStatus.IB_INVALID_SETTING


def test_size_rules(ca: IbCa) -> None:
    assert status_of(lambda: ib_create_cq(ca, ib_cq_create_t(0, Completions()))) is (
        IbStatus.IB_INVALID_CQ_SIZE
    )
    too_big = ib_query_ca(ca).max_cqes + 1
    assert status_of(lambda: ib_create_cq(ca, ib_cq_create_t(too_big, Completions()))) is (
        IbStatus.IB_INVALID_CQ_SIZE
    )
    create = ib_cq_create_t(10, Completions())
    cq = ib_create_cq(ca, create)
    assert create.size >= 10 and ib_query_cq(cq) == create.size
    assert status_of(lambda: ib_modify_cq(cq, 0)) is IbStatus.IB_INVALID_CQ_SIZE
    # neither portable backend can resize a CQ
    assert status_of(lambda: ib_modify_cq(cq, 20)) is IbStatus.IB_UNSUPPORTED


def test_empty_cq_poll_is_not_found_and_leaves_the_free_list(ca: IbCa) -> None:
    cq = ib_create_cq(ca, ib_cq_create_t(8, Completions()))
    free = wc_list(3)
    status, rest, done = ib_poll_cq(cq, free)
    assert (status, rest, done) == (IbStatus.IB_NOT_FOUND, free, None)
    assert len(list(walk(rest))) == 3
    assert ib_poll_cq(cq, None) == (IbStatus.IB_NOT_FOUND, None, None)
    assert ib_peek_cq(cq) == 0


def test_linked_poll_fills_in_order_and_keeps_the_rest_free(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    ib_post_send(client.qp, link([send(i, ds(client, 0, 8 + i)) for i in range(3)]))
    poll_n(client.cq, 3)  # the sends completed
    while ib_peek_cq(server.cq) < 3:
        threading.Event().wait(0.001)
    # two free entries for three completions: both used, none left, more to come
    first, second = ib_wc_t(), ib_wc_t()
    status, free, done = ib_poll_cq(server.cq, link([first, second]))
    assert status is IbStatus.IB_SUCCESS and free is None
    assert list(walk(done)) == [first, second] and second.p_next is None
    assert [(w.wr_id, w.length, w.wc_type) for w in walk(done)] == [
        (100, 8, ib_wc_type_t.IB_WC_RECV),
        (101, 9, ib_wc_type_t.IB_WC_RECV),
    ]
    # three free entries for the last one: one moves (appended to the done list given)
    spare = wc_list(3)
    status, free, done = ib_poll_cq(server.cq, spare, done)
    assert status is IbStatus.IB_SUCCESS
    assert [w.wr_id for w in walk(done)] == [100, 101, 102]
    assert len(list(walk(free))) == 2 and spare not in walk(free)
    assert all(w.status is ib_wc_status_t.IB_WCS_SUCCESS for w in walk(done))
    assert ib_poll_cq(server.cq, free)[0] is IbStatus.IB_NOT_FOUND


def test_rearm_is_one_shot_and_unarmed_completions_notify_nobody(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    assert server.comp is not None
    ib_post_send(client.qp, send(1, ds(client, 0, 4)))
    poll_n(server.cq, 1)
    assert not server.comp.wait(1, QUIET)  # not armed: no callback
    ib_rearm_cq(server.cq, False)
    ib_post_send(client.qp, link([send(2, ds(client, 0, 4)), send(3, ds(client, 0, 4))]))
    assert server.comp.wait(1)
    poll_n(server.cq, 2)
    assert not server.comp.wait(2, QUIET)  # two completions, one notification
    (h_cq, context, thread) = server.comp.calls[0]
    assert (h_cq, context, thread) == (server.cq, "cq-ctx", "ibal-callbacks")
    ib_rearm_cq(server.cq, False)
    ib_post_send(client.qp, send(4, ds(client, 0, 4)))
    assert server.comp.wait(2)


def test_rearm_n_notifies_once_n_are_queued(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    assert server.comp is not None
    ib_rearm_n_cq(server.cq, 3)
    ib_post_send(client.qp, link([send(i, ds(client, 0, 4)) for i in range(2)]))
    poll_n(client.cq, 2)
    assert not server.comp.wait(1, QUIET)
    ib_post_send(client.qp, send(2, ds(client, 0, 4)))
    assert server.comp.wait(1)
    assert ib_peek_cq(server.cq) == 3
    assert status_of(lambda: ib_rearm_n_cq(server.cq, 0)) is IbStatus.IB_INVALID_PARAMETER
    too_many = ib_query_cq(server.cq) + 1
    assert status_of(lambda: ib_rearm_n_cq(server.cq, too_many)) is (IbStatus.IB_INVALID_PARAMETER)


def test_solicited_rearm_waits_for_a_solicited_send(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    assert server.comp is not None
    ib_rearm_cq(server.cq, True)
    ib_post_send(client.qp, send(1, ds(client, 0, 4)))
    poll_n(server.cq, 1)
    assert not server.comp.wait(1, QUIET)
    opts = ib_send_opt_t.IB_SEND_OPT_SIGNALED | ib_send_opt_t.IB_SEND_OPT_SOLICITED
    ib_post_send(client.qp, send(2, ds(client, 0, 4), send_opt=opts))
    assert server.comp.wait(1)


def test_a_callback_polls_and_rearms_as_ibal_programs_do(ca: IbCa) -> None:
    polled: list[int] = []
    three = threading.Event()

    def drain(h_cq: IbCq) -> None:
        while True:
            status, _, done = ib_poll_cq(h_cq, wc_list(4))
            if status is IbStatus.IB_NOT_FOUND:
                return
            polled.extend(w.wr_id for w in walk(done))

    def on_completion(h_cq: IbCq, context: object) -> None:
        drain(h_cq)
        ib_rearm_cq(h_cq, False)
        drain(h_cq)  # what came between the poll and the rearm notifies nobody
        if len(polled) >= 3:
            three.set()

    client, server = connected_pair(ca, on_completion)
    ib_rearm_cq(server.cq, False)
    for i in range(3):
        ib_post_send(client.qp, send(i, ds(client, 0, 4)))
    assert three.wait(WAIT)
    assert polled == [100, 101, 102]


def test_wait_object_is_signalled_per_arm(ca: IbCa) -> None:
    client, server = make_end(ca), make_end(ca, wait_object=True)
    assert server.wait_obj is not None
    ib_post_recv(server.qp, link([recv(100 + i, ds(server, 64 * i)) for i in range(4)]))
    connect(ca, client.qp, server.qp)
    assert server.wait_obj.wait(1000) is IbStatus.IB_TIMEOUT
    ib_rearm_cq(server.cq, False)
    ib_post_send(client.qp, send(1, ds(client, 0, 4)))
    assert server.wait_obj.wait(int(WAIT * 1e6)) is IbStatus.IB_SUCCESS
    assert server.wait_obj.wait(int(QUIET * 1e6)) is IbStatus.IB_TIMEOUT  # auto-reset
    poll_n(server.cq, 1)


async def test_a_trio_program_awaits_the_wait_object(ca: IbCa) -> None:
    client, server = make_end(ca), make_end(ca, wait_object=True)
    assert server.wait_obj is not None
    ib_post_recv(server.qp, recv(100, ds(server)))
    await trio.to_thread.run_sync(connect, ca, client.qp, server.qp)
    ib_rearm_cq(server.cq, False)
    ib_post_send(client.qp, send(1, ds(client, 0, 4)))
    with trio.fail_after(WAIT):
        await server.wait_obj.wait_async()
    status, _, done = ib_poll_cq(server.cq, wc_list(1))
    assert status is IbStatus.IB_SUCCESS and done is not None and done.wr_id == 100


def test_error_state_flushes_held_receives_into_the_cq(ca: IbCa) -> None:
    end = make_end(ca)
    assert end.comp is not None
    ib_post_recv(end.qp, link([recv(1, ds(end)), recv(2, ds(end, 64))]))
    ib_rearm_cq(end.cq, False)
    ib_modify_qp(end.qp, ib_qp_mod_t(ib_qp_state_t.IB_QPS_ERROR))
    assert end.comp.wait(1)
    flushed = poll_n(end.cq, 2)
    assert [(w.wr_id, w.status) for w in flushed] == [
        (1, ib_wc_status_t.IB_WCS_WR_FLUSHED_ERR),
        (2, ib_wc_status_t.IB_WCS_WR_FLUSHED_ERR),
    ]


def test_a_cq_in_use_cannot_be_destroyed(ca: IbCa) -> None:
    end = make_end(ca)
    assert status_of(lambda: ib_destroy_cq(end.cq)) is IbStatus.IB_RESOURCE_BUSY
    ib_destroy_qp(end.qp)
    ib_destroy_cq(end.cq)
    assert status_of(lambda: ib_poll_cq(end.cq, wc_list(1))) is IbStatus.IB_INVALID_CQ_HANDLE
