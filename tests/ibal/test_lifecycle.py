"""CAs and handle lifetimes: opening by GUID, querying, destroy callbacks after outstanding
callbacks, ib_sync_destroy, cascades on ib_close_ca / ib_close_al, destroyed handles."""

from __future__ import annotations

import threading

from ibal.support import WAIT, End, connected_pair, ds, loopback_guid, make_end, send, status_of

from rdmashim.providers.ibal import (
    IbAl,
    IbCa,
    IbStatus,
    ib_alloc_pd,
    ib_close_al,
    ib_close_ca,
    ib_create_qp,
    ib_dealloc_pd,
    ib_dereg_mr,
    ib_destroy_cq,
    ib_destroy_qp,
    ib_get_ca_guids,
    ib_open_al,
    ib_open_ca,
    ib_peek_cq,
    ib_post_send,
    ib_qp_create_t,
    ib_query_ca,
    ib_query_mr,
    ib_query_qp,
    ib_rearm_cq,
    ib_sync_destroy,
)
from rdmashim.providers.ibal.ibat import iwarp_gid


def test_ca_guids_open_and_query(al: IbAl) -> None:
    guid = loopback_guid(al)
    assert guid in ib_get_ca_guids(al)
    assert status_of(lambda: ib_open_ca(al, 0x1234)) is IbStatus.IB_INVALID_GUID
    ca = ib_open_ca(al, guid, None, "ca-ctx")
    assert (ca.guid, ca.user_context, ca.al) == (guid, "ca-ctx", al)
    assert ca.context.device.name == ca.device_name
    attr = ib_query_ca(ca)
    assert attr.ca_guid == guid and attr.num_ports == len(attr.p_port_attr) >= 1
    assert attr.max_qps > 0 and attr.max_wrs > 0 and attr.max_cqes > 0
    port = attr.p_port_attr[0]
    assert (port.port_num, port.port_guid) == (1, guid)
    # iWARP: the GID IBAT derives for the port's interface (siw's: the MAC, then zeros)
    assert port.p_gid_table[0].raw == iwarp_gid(port.netdev, ca.context.device)
    assert attr.max_private_data > 0


def completion_held_back(ca: IbCa, gate: threading.Event, order: list[str]) -> End:
    """A connected server end whose CQ callback is running, waiting for ``gate``."""

    running = threading.Event()

    def on_completion(h_cq: object, context: object) -> None:
        running.set()
        gate.wait(WAIT)
        order.append("completion")

    client, server = connected_pair(ca, on_completion)
    ib_rearm_cq(server.cq, False)
    ib_post_send(client.qp, send(1, ds(client, 0, 4)))
    assert running.wait(WAIT)
    return server


def test_destroy_callback_runs_after_the_outstanding_callbacks(ca: IbCa) -> None:
    gate, order = threading.Event(), []
    server = completion_held_back(ca, gate, order)
    destroyed = threading.Event()

    def on_destroyed(context: object) -> None:
        order.append(f"destroyed {context}")
        destroyed.set()

    ib_destroy_qp(server.qp, on_destroyed)  # returns at once; the callback waits its turn
    assert order == []
    gate.set()
    assert destroyed.wait(WAIT)
    assert order == ["completion", "destroyed qp-ctx"]
    assert status_of(lambda: ib_query_qp(server.qp)) is IbStatus.IB_INVALID_QP_HANDLE


def test_sync_destroy_waits_for_outstanding_callbacks(ca: IbCa) -> None:
    gate, order = threading.Event(), []
    server = completion_held_back(ca, gate, order)
    threading.Timer(0.05, gate.set).start()
    ib_destroy_qp(server.qp, ib_sync_destroy)
    ib_destroy_cq(server.cq, ib_sync_destroy)
    assert order == ["completion"]


def test_closing_the_ca_destroys_everything_on_it(ca: IbCa) -> None:
    end = make_end(ca)
    destroyed = threading.Event()
    ib_close_ca(ca, lambda context: destroyed.set())
    assert destroyed.wait(WAIT)
    checks = [
        (lambda: ib_query_ca(ca), IbStatus.IB_INVALID_CA_HANDLE),
        (lambda: ib_query_qp(end.qp), IbStatus.IB_INVALID_QP_HANDLE),
        (lambda: ib_peek_cq(end.cq), IbStatus.IB_INVALID_CQ_HANDLE),
        (lambda: ib_query_mr(end.mr), IbStatus.IB_INVALID_MR_HANDLE),
        (lambda: ib_alloc_pd(ca), IbStatus.IB_INVALID_CA_HANDLE),
        (
            lambda: ib_create_qp(end.pd, ib_qp_create_t(h_sq_cq=end.cq, h_rq_cq=end.cq)),
            IbStatus.IB_INVALID_PD_HANDLE,
        ),
        (lambda: ib_close_ca(ca), IbStatus.IB_INVALID_CA_HANDLE),
    ]
    for call, status in checks:
        assert status_of(call) is status
    assert end.qp.destroyed and end.cq.cq._closed and ca.context._closed


def test_closing_the_al_closes_its_cas_and_connections() -> None:
    al = ib_open_al()
    ca = ib_open_ca(al, loopback_guid(al))
    client, server = connected_pair(ca)
    portable = ca.context
    ib_close_al(al)
    assert ca.destroyed and client.qp.destroyed and server.cq.destroyed
    assert portable._closed
    assert status_of(lambda: ib_query_ca(ca)) is IbStatus.IB_INVALID_CA_HANDLE
    assert status_of(lambda: ib_open_ca(al, ca.guid)) is IbStatus.IB_INVALID_AL_HANDLE


def test_dealloc_pd_and_dereg_mr(ca: IbCa) -> None:
    end = make_end(ca)
    ib_dereg_mr(end.mr)
    assert status_of(lambda: ib_dereg_mr(end.mr)) is IbStatus.IB_INVALID_MR_HANDLE
    ib_dealloc_pd(end.pd, ib_sync_destroy)
    assert end.qp.destroyed
    assert status_of(lambda: ib_dealloc_pd(end.pd)) is IbStatus.IB_INVALID_PD_HANDLE
    ib_destroy_cq(end.cq)  # its QP is gone, so it is free
