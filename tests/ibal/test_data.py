"""The data path over connected QPs: Send/Receive, RDMA Write and Read, Send with
Invalidate, and the asynchronous events of a CQ overrun."""

from __future__ import annotations

import threading

from ibal.support import WAIT, connect, connected_pair, ds, make_end, poll_n, recv, send, status_of

from rdmashim.providers.ibal import (
    IbCa,
    IbStatus,
    ib_async_event_t,
    ib_poll_cq,
    ib_post_recv,
    ib_post_send,
    ib_recv_opt_t,
    ib_remote_ops_t,
    ib_send_opt_t,
    ib_wc_status_t,
    ib_wc_type_t,
    ib_wr_type_t,
    link,
    wc_list,
)

OK = ib_wc_status_t.IB_WCS_SUCCESS


def test_send_and_receive(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    client.buf[:12] = b"hello, world"
    ib_post_send(client.qp, link([send(1, ds(client, 0, 5)), send(2, ds(client, 7, 5))]))
    sent = poll_n(client.cq, 2)
    assert [(w.wr_id, w.wc_type, w.status) for w in sent] == [
        (1, ib_wc_type_t.IB_WC_SEND, OK),
        (2, ib_wc_type_t.IB_WC_SEND, OK),
    ]
    got = poll_n(server.cq, 2)
    assert [(w.wr_id, w.length, w.recv.conn.recv_opt) for w in got] == [
        (100, 5, ib_recv_opt_t.NONE),
        (101, 5, ib_recv_opt_t.NONE),
    ]
    assert bytes(server.buf[:5]) == b"hello" and bytes(server.buf[64:69]) == b"world"


def test_rdma_write_and_read(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    client.buf[:6] = b"remote"
    there = ib_remote_ops_t(server.vaddr + 1000, server.rkey)
    write = send(1, ds(client, 0, 6), wr_type=ib_wr_type_t.WR_RDMA_WRITE, remote_ops=there)
    server.buf[2000:2004] = b"back"
    back = ib_remote_ops_t(server.vaddr + 2000, server.rkey)
    read = send(2, ds(client, 100, 4), wr_type=ib_wr_type_t.WR_RDMA_READ, remote_ops=back)
    ib_post_send(client.qp, link([write, read]))
    done = poll_n(client.cq, 2)
    assert [(w.wr_id, w.wc_type, w.status) for w in done] == [
        (1, ib_wc_type_t.IB_WC_RDMA_WRITE, OK),
        (2, ib_wc_type_t.IB_WC_RDMA_READ, OK),
    ]
    assert bytes(server.buf[1000:1006]) == b"remote"  # the Read came after the Write
    assert bytes(client.buf[100:104]) == b"back"


def test_a_read_with_a_bad_rkey_completes_with_an_error(ca: IbCa) -> None:
    """(An iWARP Write completes once sent; the peer's Terminate fails the QP later.)"""
    client, _ = connected_pair(ca)
    bad = ib_remote_ops_t(0x1000, 0xDEAD)
    ib_post_send(client.qp, send(1, ds(client), wr_type=ib_wr_type_t.WR_RDMA_READ, remote_ops=bad))
    (wc,) = poll_n(client.cq, 1)
    assert wc.status is ib_wc_status_t.IB_WCS_REM_ACCESS_ERR


def test_send_with_invalidate_reports_the_stag(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    opts = ib_send_opt_t.IB_SEND_OPT_SIGNALED | ib_send_opt_t.IB_SEND_OPT_INVALIDATE
    ib_post_send(client.qp, send(1, ds(client, 0, 4), send_opt=opts, invalidate_rkey=server.rkey))
    (wc,) = poll_n(server.cq, 1)
    assert wc.status is OK
    assert wc.recv.conn.recv_opt & ib_recv_opt_t.IB_RECV_OPT_INVALIDATE
    assert wc.recv.conn.immediate_data == server.rkey


def test_unsignaled_sends_complete_silently_unless_sq_signaled(ca: IbCa) -> None:
    client, server = connected_pair(ca)
    quiet = send(1, ds(client, 0, 4), send_opt=ib_send_opt_t.NONE)
    loud = send(2, ds(client, 0, 4))
    ib_post_send(client.qp, link([quiet, loud]))
    assert [w.wr_id for w in poll_n(client.cq, 1)] == [2]
    poll_n(server.cq, 2)
    client2, server2 = make_end(ca, sq_signaled=True), make_end(ca)
    ib_post_recv(server2.qp, recv(7, ds(server2)))
    connect(ca, client2.qp, server2.qp)
    ib_post_send(client2.qp, send(3, ds(client2, 0, 4), send_opt=ib_send_opt_t.NONE))
    assert [w.wr_id for w in poll_n(client2.cq, 1)] == [3]


def test_a_cq_overrun_raises_the_cq_and_qp_event_callbacks(ca: IbCa) -> None:
    """More completions than the CQ holds: IB_AE_CQ_ERROR to the CQ's event callback, and
    the QP completing into it fails (IB_AE_QP_FATAL to the QP's), on the callback thread."""
    seen: list[tuple[object, object, object, str]] = []
    both = threading.Event()

    def on_event(record: object) -> None:
        seen.append(
            (record.code, record.handle, record.context, threading.current_thread().name)  # type: ignore[attr-defined]
        )
        if len(seen) == 2:
            both.set()

    client, server = make_end(ca, size=4), make_end(ca)
    client.cq.pfn_event_cb = client.qp.pfn_event_cb = on_event
    ib_post_recv(server.qp, link([recv(i, ds(server, 64 * i)) for i in range(8)]))
    connect(ca, client.qp, server.qp)
    ib_post_send(client.qp, link([send(i, ds(client, 0, 4)) for i in range(8)]))
    assert both.wait(WAIT)
    assert seen == [
        (ib_async_event_t.IB_AE_CQ_ERROR, client.cq, "cq-ctx", "ibal-callbacks"),
        (ib_async_event_t.IB_AE_QP_FATAL, client.qp, "qp-ctx", "ibal-callbacks"),
    ]
    assert status_of(lambda: ib_poll_cq(client.cq, wc_list(1))) is IbStatus.IB_OVERFLOW
