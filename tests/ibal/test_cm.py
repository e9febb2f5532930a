"""The IB CM over the built-in iWARP engine on loopback: real MPA connections set up IBAL's way."""

from __future__ import annotations

import gc
import socket
import threading
import time
from typing import Any

import pytest
from ibal.cmsupport import Recorder, free_port, poll_one, service_id
from ibal.support import End, loopback_guid, make_end

from rdmashim.providers.ibal import (
    IbAl,
    IbCa,
    IbError,
    IbStatus,
    ib_close_al,
    ib_open_al,
    ib_open_ca,
    ib_post_recv,
    ib_post_send,
)
from rdmashim.providers.ibal.cm import (
    CaCm,
    ib_cm_cancel,
    ib_cm_drep,
    ib_cm_dreq,
    ib_cm_listen,
    ib_cm_mra,
    ib_cm_rej,
    ib_cm_rep,
    ib_cm_req,
    ib_cm_rtu,
)
from rdmashim.providers.ibal.cm_state import PDATA_SIZE, CmMsg, ib_rej_status_t
from rdmashim.providers.ibal.cm_types import (
    ib_cm_drep_t,
    ib_cm_dreq_t,
    ib_cm_listen_t,
    ib_cm_mra_t,
    ib_cm_rej_t,
    ib_cm_rep_t,
    ib_cm_req_t,
    ib_cm_rtu_t,
)
from rdmashim.providers.ibal.cq import ib_wc_status_t
from rdmashim.providers.ibal.ibat import ibat_query_path
from rdmashim.providers.ibal.wr import ib_local_ds_t, ib_recv_wr_t, ib_send_wr_t
from rdmashim.providers.softiwarp.engine import Engine

R = ib_rej_status_t
HOST = "127.0.0.1"


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def port() -> int:
    return free_port()


def listen(al: IbAl, rec: Recorder, port: int, **fields: Any) -> Any:
    info = ib_cm_listen_t(service_id(port), pfn_cm_req_cb=rec.cb("req"), **fields)
    return ib_cm_listen(al, info, "listen-ctx")


def request(end: End, rec: Recorder, port: int, pdata: bytes = b"hello", **fields: Any) -> None:
    path = ibat_query_path(None, HOST)
    ib_cm_req(
        ib_cm_req_t(
            service_id(port),
            end.qp,
            path,
            pfn_cm_rep_cb=rec.cb("rep"),
            pfn_cm_rej_cb=rec.cb("rej"),
            pfn_cm_mra_cb=rec.cb("mra"),
            p_req_pdata=pdata,
            **fields,
        )
    )


def reply(req: Any, end: End, rec: Recorder, pdata: bytes = b"welcome") -> None:
    ib_cm_rep(
        req.h_cm_req,
        ib_cm_rep_t(
            end.qp,
            pdata,
            pfn_cm_rtu_cb=rec.cb("rtu"),
            pfn_cm_rej_cb=rec.cb("p-rej"),
            pfn_cm_dreq_cb=rec.cb("p-dreq"),
        ),
    )


def establish(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> tuple[End, End, Any]:
    """A client and a server end connected REQ/REP/RTU; returns (client, server, REP record)."""
    server, client = make_end(ca), make_end(ca)
    listen(al, rec, port)
    request(client, rec, port)
    reply(rec.wait("req"), server, rec)
    rep = rec.wait("rep")
    ib_cm_rtu(rep.h_cm_rep, ib_cm_rtu_t(pfn_cm_dreq_cb=rec.cb("a-dreq")))
    rec.wait("rtu")
    return client, server, rep


def test_req_rep_rtu_establishes_and_data_flows(
    al: IbAl, ca: IbCa, rec: Recorder, port: int
) -> None:
    server, client = make_end(ca), make_end(ca)
    h_listen = listen(al, rec, port)
    ib_post_recv(
        server.qp, ib_recv_wr_t(wr_id=7, ds_array=[ib_local_ds_t(server.vaddr, 64, server.lkey)])
    )
    request(client, rec, port, b"hello")
    req = rec.wait("req")
    assert req.p_req_pdata == b"hello" and req.context == "listen-ctx"
    assert req.h_cm_listen is h_listen and req.qp_type == 0
    assert req.primary_path.src_ip == HOST and req.primary_path.dst_ip == HOST
    reply(req, server, rec, b"welcome")
    rep = rec.wait("rep")
    assert rep.p_rep_pdata == b"welcome" and rep.qp_context == "qp-ctx"
    ib_cm_rtu(rep.h_cm_rep, ib_cm_rtu_t(pfn_cm_dreq_cb=rec.cb("a-dreq")))
    rtu = rec.wait("rtu")
    assert rtu.h_qp is server.qp and rtu.qp_context == "qp-ctx" and rtu.p_rtu_pdata == b""

    client.buf[:5] = b"ibal!"
    send = ib_send_wr_t(wr_id=9, ds_array=[ib_local_ds_t(client.vaddr, 5, client.lkey)])
    ib_post_send(client.qp, send)
    got = poll_one(server.cq)
    assert (got.wr_id, got.status, got.length) == (7, ib_wc_status_t.IB_WCS_SUCCESS, 5)
    assert bytes(server.buf[:5]) == b"ibal!"
    assert poll_one(client.cq).wr_id == 9
    assert rec.threads() == {"ibal-callbacks"}
    assert "rej" not in rec.names() and "p-rej" not in rec.names()


def test_dreq_from_the_active_side(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    client, _, _ = establish(al, ca, rec, port)
    ib_cm_dreq(ib_cm_dreq_t(client.qp, pfn_cm_drep_cb=rec.cb("a-drep")))
    dreq = rec.wait("p-dreq")
    assert dreq.qp_context == "qp-ctx" and dreq.p_dreq_pdata == b""
    ib_cm_drep(dreq.h_cm_dreq, ib_cm_drep_t())
    drep = rec.wait("a-drep")
    assert drep.cm_status is IbStatus.IB_SUCCESS and drep.h_qp is client.qp
    with pytest.raises(IbError) as info:  # the connection is over
        ib_cm_drep(dreq.h_cm_dreq, ib_cm_drep_t())
    assert info.value.status is IbStatus.IB_INVALID_STATE
    assert "a-dreq" not in rec.names()


def test_dreq_from_the_passive_side(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    _, server, _ = establish(al, ca, rec, port)
    ib_cm_dreq(ib_cm_dreq_t(server.qp, pfn_cm_drep_cb=rec.cb("p-drep")))
    dreq = rec.wait("a-dreq")
    ib_cm_drep(dreq.h_cm_dreq, ib_cm_drep_t())
    assert rec.wait("p-drep").cm_status is IbStatus.IB_SUCCESS
    assert "p-dreq" not in rec.names()


def test_dreq_race_ends_both_with_drep(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    """Both sides call ib_cm_dreq before either hears of the other's: both get their DREP."""
    client, server, _ = establish(al, ca, rec, port)

    def both() -> None:  # on the progress thread: no CM event is handled in between
        ib_cm_dreq(ib_cm_dreq_t(client.qp, pfn_cm_drep_cb=rec.cb("a-drep")))
        ib_cm_dreq(ib_cm_dreq_t(server.qp, pfn_cm_drep_cb=rec.cb("p-drep")))

    al.run(both)
    assert rec.wait("a-drep").cm_status is IbStatus.IB_SUCCESS
    assert rec.wait("p-drep").cm_status is IbStatus.IB_SUCCESS
    al.sync_callbacks()
    assert "a-dreq" not in rec.names() and "p-dreq" not in rec.names()


def test_rej_with_private_data(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    server, client = make_end(ca), make_end(ca)
    listen(al, rec, port)
    request(client, rec, port)
    req = rec.wait("req")
    ib_cm_rej(req.h_cm_req, ib_cm_rej_t(R.IB_REJ_INSUF_RESOURCES, p_rej_pdata=b"full, sorry"))
    rej = rec.wait("rej")
    assert rej.rej_status is R.IB_REJ_USER_DEFINED  # MPA Reject carries no reason
    assert rej.p_rej_pdata == b"full, sorry" and rej.h_qp is client.qp
    with pytest.raises(IbError) as info:
        reply(req, server, rec)
    assert info.value.status is IbStatus.IB_INVALID_STATE


def test_active_rej_of_the_rep(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    server, client = make_end(ca), make_end(ca)
    listen(al, rec, port)
    request(client, rec, port)
    reply(rec.wait("req"), server, rec)
    rep = rec.wait("rep")
    ib_cm_rej(rep.h_cm_rep, ib_cm_rej_t())
    # The passive side was ESTABLISHED already (its RTU came with the MPA Reply): it sees
    # the end of the connection as a DREQ.
    rec.wait("rtu")
    rec.wait("p-dreq")
    with pytest.raises(IbError) as info:
        ib_cm_rtu(rep.h_cm_rep, ib_cm_rtu_t())
    assert info.value.status is IbStatus.IB_INVALID_STATE


def test_compare_buffer_mismatch_is_invalid_sid(
    al: IbAl, ca: IbCa, rec: Recorder, port: int
) -> None:
    client, other = make_end(ca), make_end(ca)
    listen(al, rec, port, p_compare_buffer=b"RDS", compare_offset=2, compare_length=3)
    request(client, rec, port, b"xxNFS")
    assert rec.wait("rej").rej_status is R.IB_REJ_INVALID_SID
    assert "req" not in rec.names()
    request(other, rec, port, b"xxRDS!")
    assert rec.wait("req").p_req_pdata == b"xxRDS!"


def test_two_listens_share_a_service_id_by_compare_buffer(al: IbAl, ca: IbCa, port: int) -> None:
    first, second, rec = Recorder(), Recorder(), Recorder()
    listen(al, first, port, p_compare_buffer=b"A", compare_length=1)
    listen(al, second, port, p_compare_buffer=b"B", compare_length=1)
    with pytest.raises(IbError) as info:
        listen(al, Recorder(), port, p_compare_buffer=b"B", compare_length=1)
    assert info.value.status is IbStatus.IB_INVALID_SETTING
    request(make_end(ca), rec, port, b"B")
    assert second.wait("req").p_req_pdata == b"B"
    request(make_end(ca), rec, port, b"A")
    assert first.wait("req").p_req_pdata == b"A"


def test_a_listen_directed_at_the_ca(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    listen(al, rec, port, ca_guid=ca.guid, port_guid=ca.guid)
    request(make_end(ca), rec, port)
    assert rec.wait("req").primary_path.device_name == ca.device_name


def test_no_listener_is_invalid_sid(ca: IbCa, rec: Recorder, port: int) -> None:
    request(make_end(ca), rec, port)
    rej = rec.wait("rej")
    assert rej.rej_status is R.IB_REJ_INVALID_SID and rej.qp_context == "qp-ctx"


def test_a_listener_that_never_answers_times_out(ca: IbCa, rec: Recorder) -> None:
    with socket.socket() as silent:
        silent.bind((HOST, 0))
        silent.listen()
        port = silent.getsockname()[1]
        started = time.monotonic()
        request(make_end(ca), rec, port, timeout_ms=300)
        rej = rec.wait("rej")
    assert rej.rej_status is R.IB_REJ_TIMEOUT
    assert time.monotonic() - started < 5


def test_an_unanswered_req_times_out_and_a_late_rep_ends_the_passive_side(
    al: IbAl, ca: IbCa, rec: Recorder, port: int
) -> None:
    """The requester gives up; the REP that comes too late meets a closed TCP connection.

    Whether the MPA Reply still went out before the reset arrived is up to TCP: the
    passive side sees a REJ (IB_REJ_TIMEOUT), or its RTU and at once a DREQ.
    """
    server, client = make_end(ca), make_end(ca)
    listen(al, rec, port)
    request(client, rec, port, timeout_ms=300)
    req = rec.wait("req")
    assert rec.wait("rej").rej_status is R.IB_REJ_TIMEOUT
    reply(req, server, rec)
    deadline = time.monotonic() + 10
    while not {"p-rej", "p-dreq"} & set(rec.names()) and time.monotonic() < deadline:
        time.sleep(0.01)
    if "p-rej" in rec.names():
        assert rec.wait("p-rej").rej_status is R.IB_REJ_TIMEOUT
    else:
        assert rec.names()[-2:] == ["rtu", "p-dreq"]
    assert "rep" not in rec.names()


def test_mra_is_local(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    server, client = make_end(ca), make_end(ca)
    listen(al, rec, port)
    request(client, rec, port)
    req = rec.wait("req")
    ib_cm_mra(req.h_cm_req, ib_cm_mra_t(svc_timeout=20))
    with pytest.raises(IbError) as info:
        ib_cm_mra(req.h_cm_req, ib_cm_mra_t(svc_timeout=20))
    assert info.value.status is IbStatus.IB_INVALID_STATE
    with pytest.raises(IbError) as info:
        ib_cm_mra(req.h_cm_req, ib_cm_mra_t(p_mra_pdata=b"wait"))
    assert info.value.status is IbStatus.IB_INVALID_STATE
    reply(req, server, rec)
    rep = rec.wait("rep")
    with pytest.raises(IbError) as info:
        ib_cm_mra(rep.h_cm_rep, ib_cm_mra_t(p_mra_pdata=b"wait"))
    assert info.value.status is IbStatus.IB_UNSUPPORTED  # no MRA message on iWARP
    ib_cm_mra(rep.h_cm_rep, ib_cm_mra_t(svc_timeout=3))
    ib_cm_rtu(rep.h_cm_rep, ib_cm_rtu_t())
    rec.wait("rtu")
    assert "mra" not in rec.names()


def test_private_data_limits(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    client = make_end(ca)
    with pytest.raises(IbError) as info:
        request(client, rec, port, bytes(PDATA_SIZE[CmMsg.REQ] + 1))
    assert info.value.status is IbStatus.IB_INVALID_SETTING
    server = make_end(ca)
    listen(al, rec, port)
    request(client, rec, port, bytes(PDATA_SIZE[CmMsg.REQ]))  # the limit itself is fine
    req = rec.wait("req")
    assert req.p_req_pdata == bytes(92)
    with pytest.raises(IbError) as info:
        reply(req, server, rec, bytes(PDATA_SIZE[CmMsg.REP] + 1))
    assert info.value.status is IbStatus.IB_INVALID_SETTING
    with pytest.raises(IbError) as info:
        ib_cm_rej(req.h_cm_req, ib_cm_rej_t(p_rej_pdata=bytes(PDATA_SIZE[CmMsg.REJ] + 1)))
    assert info.value.status is IbStatus.IB_INVALID_SETTING
    reply(req, server, rec, bytes(PDATA_SIZE[CmMsg.REP]))
    rep = rec.wait("rep")
    assert rep.p_rep_pdata == bytes(196)
    with pytest.raises(IbError) as info:
        ib_cm_rtu(rep.h_cm_rep, ib_cm_rtu_t(p_rtu_pdata=b"x"))
    assert info.value.status is IbStatus.IB_UNSUPPORTED
    ib_cm_rtu(rep.h_cm_rep, ib_cm_rtu_t())
    rec.wait("rtu")
    with pytest.raises(IbError) as info:
        ib_cm_dreq(ib_cm_dreq_t(client.qp, p_dreq_pdata=bytes(PDATA_SIZE[CmMsg.DREQ] + 1)))
    assert info.value.status is IbStatus.IB_INVALID_SETTING
    with pytest.raises(IbError) as info:
        ib_cm_dreq(ib_cm_dreq_t(client.qp, p_dreq_pdata=b"bye"))
    assert info.value.status is IbStatus.IB_UNSUPPORTED


def test_cancel_stops_listening_and_runs_the_destroy_callback(
    al: IbAl, ca: IbCa, rec: Recorder, port: int
) -> None:
    h_listen = listen(al, rec, port)
    destroyed = threading.Event()
    seen: list[Any] = []

    def on_destroy(context: Any) -> None:
        seen.append((context, threading.current_thread().name))
        destroyed.set()

    ib_cm_cancel(h_listen, on_destroy)
    assert destroyed.wait(5)
    assert seen == [("listen-ctx", "ibal-callbacks")]
    with pytest.raises(IbError) as info:
        ib_cm_cancel(h_listen)
    assert info.value.status is IbStatus.IB_INVALID_HANDLE
    request(make_end(ca), rec, port)
    assert rec.wait("rej").rej_status is R.IB_REJ_INVALID_SID
    listen(al, rec, port)  # the port is free again


def test_bad_requests(al: IbAl, ca: IbCa, rec: Recorder, port: int) -> None:
    client = make_end(ca)
    for svc_id, why in [(service_id(0), "port 0"), (0x0000000001110000 | port, "UDP space")]:
        with pytest.raises(IbError) as info:
            ib_cm_listen(al, ib_cm_listen_t(svc_id, pfn_cm_req_cb=rec.cb("req")))
        assert info.value.status is IbStatus.IB_INVALID_SETTING, why
    with pytest.raises(IbError) as info:
        ib_cm_listen(al, ib_cm_listen_t(service_id(port)))
    assert info.value.status is IbStatus.IB_INVALID_PARAMETER
    with pytest.raises(IbError) as info:
        ib_cm_listen(al, ib_cm_listen_t(service_id(port), ca_guid=1, pfn_cm_req_cb=rec.cb("r")))
    assert info.value.status is IbStatus.IB_INVALID_GUID
    with pytest.raises(IbError) as info:
        ib_cm_req(ib_cm_req_t(service_id(port), client.qp, None))
    assert info.value.status is IbStatus.IB_INVALID_PARAMETER
    with pytest.raises(IbError) as info:
        ib_cm_dreq(ib_cm_dreq_t(client.qp))
    assert info.value.status is IbStatus.IB_INVALID_STATE
    with pytest.raises(IbError) as info:
        ib_cm_rep("not a handle", ib_cm_rep_t(client.qp))  # type: ignore[arg-type]
    assert info.value.status is IbStatus.IB_INVALID_HANDLE
    request(client, rec, port)
    with pytest.raises(IbError) as info:  # one connection per QP
        request(client, rec, port)
    assert info.value.status is IbStatus.IB_INVALID_STATE


def test_closing_the_al_leaves_nothing_of_its_connections(rec: Recorder, port: int) -> None:
    """After ib_close_al nothing holds a CA, its CM or an HCA QP: a long-running program
    that opens and closes ALs does not grow (a registry of CMs once kept them all)."""

    def alive() -> list[object]:
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, (Engine, IbCa, CaCm))]

    before = len(alive())
    al = ib_open_al()
    ca = ib_open_ca(al, loopback_guid(al))
    server, client = make_end(ca), make_end(ca)
    listen(al, rec, port)
    request(client, rec, port, b"hello")
    reply(rec.wait("req"), server, rec, b"welcome")
    ib_cm_rtu(rec.wait("rep").h_cm_rep, ib_cm_rtu_t())
    rec.wait("rtu")
    ib_close_al(al)
    del al, ca, server, client
    rec.calls.clear()
    assert len(alive()) == before, alive()
