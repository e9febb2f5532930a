"""The backend ``ibal``: its Backend object, devices naming their HCA, the rdma_cm IP header
codec, and Send / RDMA Write / RDMA Read through the portable API over IBAL."""

from __future__ import annotations

from functools import partial

import pytest
import trio

import rdmashim
from rdmashim import Access, RecvWR, SendWR, WROpcode
from rdmashim.cm import open_connection, serve
from rdmashim.cm.types import PortSpace
from rdmashim.providers.ibal import cma_header
from rdmashim.providers.ibal.port_cm import service_id
from rdmashim.providers.ibal.port_device import Context
from rdmashim.registry import load_backend

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


def test_backend_object_and_devices_name_their_hca() -> None:
    backend = load_backend("ibal")
    assert backend.name == "ibal" and backend.transport_options == frozenset()
    assert backend.unavailable_reason() == load_backend("softiwarp").unavailable_reason()
    hca = {d.name: d for d in load_backend("softiwarp").get_device_list()}
    devices = backend.get_device_list()
    assert devices and len(devices) == len(hca)
    for dev in devices:
        assert dev.name == "ibal_" + dev.hca_device  # type: ignore[attr-defined]
        assert dev.hca_backend == "softiwarp"  # type: ignore[attr-defined]
        assert dev.node_guid == hca[dev.hca_device].node_guid  # type: ignore[attr-defined]
        assert dev.sits_on == f"{dev.hca_device} (softiwarp)"  # type: ignore[attr-defined]


def test_ibal_cannot_sit_on_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMASHIM_IBAL_HCA", "ibal")
    assert "itself" in (load_backend("ibal").unavailable_reason() or "")


def test_rdma_cm_service_id() -> None:
    assert service_id(PortSpace.TCP, 7471) == 0x0000000001061D2F


@pytest.mark.parametrize(
    ("src", "port", "dst"), [("192.0.2.1", 4791, "192.0.2.9"), ("fe80::1", 1, "2001:db8::2")]
)
def test_cma_header_round_trip(src: str, port: int, dst: str) -> None:
    raw = cma_header.encode(cma_header.CmaHeader(src, port, dst))
    assert len(raw) == cma_header.HEADER_LEN == 36
    header, rest = cma_header.decode(raw + b"app")
    assert (header.src_ip, header.src_port, header.dst_ip, rest) == (src, port, dst, b"app")


def test_cma_header_layout_is_linux_cma_hdr() -> None:
    raw = cma_header.encode(cma_header.CmaHeader("10.0.0.1", 0x1234, "10.0.0.2"))
    assert raw[:4] == bytes([0x00, 0x40, 0x12, 0x34])  # version, IPv4 << 4, port
    assert raw[4:20] == bytes(12) + bytes([10, 0, 0, 1])
    assert raw[20:36] == bytes(12) + bytes([10, 0, 0, 2])


@pytest.mark.parametrize(
    "raw",
    [b"\0" * 35, b"\x01\x40" + bytes(34), b"\x00\x50" + bytes(34), b"\x00\x40" + b"\x01" * 34],
    ids=["short", "cma-version", "ip-version", "v4-padding"],
)
def test_cma_header_refuses_malformed(raw: bytes) -> None:
    with pytest.raises(cma_header.CmaHeaderError):
        cma_header.decode(raw)


async def test_open_device_is_an_al_and_a_ca() -> None:
    async with rdmashim.open_device(backend="ibal") as ctx:
        assert isinstance(ctx, Context) and ctx.device.name == "ibal_siw_lo"
        attr = ctx.query_device()
        assert attr.max_private_data == 92  # IBAL's REQ limit, no CMA header on iWARP
        assert ctx.query_port(1).netdev == "lo"
        assert ctx.ca.device_name == "siw_lo"


async def test_a_failing_hand_over_is_logged_and_the_application_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a callback hands to the application's loop runs in ``run_sync_soon``, where an
    exception would end the whole trio run (TrioInternalError): it is logged instead."""

    def broken() -> None:
        raise RuntimeError("hand-over bug")

    async with rdmashim.open_device(backend="ibal") as ctx:
        assert isinstance(ctx, Context)
        ran = trio.Event()
        await trio.to_thread.run_sync(ctx.to_app, broken)  # as a callback thread would
        await trio.to_thread.run_sync(ctx.to_app, ran.set)
        with trio.fail_after(5):
            await ran.wait()
    assert "hand-over bug" in caplog.text


async def test_send_write_read_over_ibal() -> None:
    async def handler(request) -> None:  # type: ignore[no-untyped-def]
        region = request.pd.reg_mr(bytearray(64), RW)
        request.qp.post_recv(RecvWR(1, [region.sge()]))
        conn = await request.accept(
            private_data=region.iova.to_bytes(8, "big") + region.rkey.to_bytes(4, "big")
        )
        wc = (await conn.recv_cq.poll_wait(1))[0].raise_for_status()
        assert bytes(region.buf[: wc.byte_len]) == b"ping"
        region.buf[32:37] = b"there"
        conn.qp.post_send(SendWR(2, WROpcode.SEND, [region.sge(0, 4)]))
        await conn.wait_disconnected()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(
                partial(serve, handler, 0, host="127.0.0.1", backend="ibal")
            )
            async with open_connection("127.0.0.1", port, backend="ibal") as conn:
                assert conn.qp.context.backend == "ibal"
                # the transport's endpoints, as the other backends report them
                assert conn.local_addr is not None and conn.local_addr[1] != 0
                assert conn.peer_addr is not None and conn.peer_addr[1] == port
                addr = int.from_bytes(conn.private_data[:8], "big")
                rkey = int.from_bytes(conn.private_data[8:12], "big")
                mine = conn.pd.reg_mr(bytearray(b"ping".ljust(64, b"\0")), RW)
                conn.qp.post_recv(RecvWR(3, [mine.sge(8, 8)]))
                conn.qp.post_send(SendWR(4, WROpcode.SEND, [mine.sge(0, 4)]))
                done: dict[int, object] = {}
                while 3 not in done:
                    for wc in await conn.recv_cq.poll_wait():
                        done[wc.wr_id] = wc.raise_for_status()
                assert bytes(mine.buf[8:12]) == b"ping"
                mine.buf[16:21] = b"hello"
                conn.qp.post_send(
                    SendWR(
                        5, WROpcode.RDMA_WRITE, [mine.sge(16, 5)], remote_addr=addr + 40, rkey=rkey
                    )
                )
                conn.qp.post_send(
                    SendWR(
                        6, WROpcode.RDMA_READ, [mine.sge(48, 5)], remote_addr=addr + 32, rkey=rkey
                    )
                )
                while 6 not in done:
                    for wc in await conn.send_cq.poll_wait():
                        done[wc.wr_id] = wc.raise_for_status()
                assert bytes(mine.buf[48:53]) == b"there"
            nursery.cancel_scope.cancel()
