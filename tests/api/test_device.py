"""Devices: the list, opening by name or by default, and the limits they report."""

from __future__ import annotations

import errno

import pytest

import rdmashim
from rdmashim import (
    AtomicCap,
    BackendUnavailable,
    DeviceAttr,
    Mtu,
    NodeType,
    PortAttr,
    PortState,
    Transport,
    VerbsError,
)


def test_device_list_names_each_device_once() -> None:
    devices = rdmashim.get_device_list()
    assert devices, f"backend {rdmashim.chosen_backend()} lists no devices"
    names = [d.name for d in devices]
    assert all(isinstance(n, str) and n for n in names)
    assert len(set(names)) == len(names), names


async def test_open_default_then_by_name() -> None:
    names = [d.name for d in rdmashim.get_device_list()]
    async with rdmashim.open_device() as ctx:
        name = ctx.device.name
        guid = ctx.query_device().node_guid
    assert name in names
    async with rdmashim.open_device(name) as again:
        assert again.device.name == name
        assert again.query_device().node_guid == guid


async def test_two_contexts_of_one_device_at_once() -> None:
    async with rdmashim.open_device() as a, rdmashim.open_device(a.device.name) as b:
        assert a is not b
        pa, pb = a.alloc_pd(), b.alloc_pd()
        ma, mb = pa.reg_mr(bytearray(64)), pb.reg_mr(bytearray(64))
        assert ma.addr != mb.addr


async def test_unknown_device_is_enodev() -> None:
    with pytest.raises(VerbsError) as info:
        async with rdmashim.open_device("no-such-device-9"):
            pass
    assert info.value.errno == errno.ENODEV


async def test_unknown_backend_says_so() -> None:
    with pytest.raises(BackendUnavailable, match="no-such-backend"):
        async with rdmashim.open_device(backend="no-such-backend"):
            pass


async def test_query_device_limits_are_consistent(device) -> None:
    attr = device.query_device()
    assert isinstance(attr, DeviceAttr)
    assert attr == device.query_device()  # stable
    for limit in ("max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_pd"):
        assert getattr(attr, limit) >= 1, limit
    assert attr.phys_port_cnt >= 1
    assert attr.max_mr_size >= 1 << 20
    assert attr.page_size_cap != 0
    assert 1 <= attr.max_sge_rd <= attr.max_sge
    # An RDMA device serves and issues RDMA Reads.
    assert attr.max_qp_rd_atom >= 1 and attr.max_qp_init_rd_atom >= 1
    if attr.max_srq:
        assert attr.max_srq_wr >= 1 and attr.max_srq_sge >= 1
    assert attr.max_inline_data >= 0
    assert isinstance(attr.atomic_cap, AtomicCap)
    assert isinstance(attr.transport, Transport) and isinstance(attr.node_type, NodeType)
    if attr.transport == Transport.IWARP:
        assert attr.node_type == NodeType.RNIC
        # MPA carries at most 512 bytes of private data (RFC 5044), less in v2.
        assert 0 < attr.max_private_data <= 512
    assert attr.max_private_data > 0


async def test_query_port(device) -> None:
    attr = device.query_device()
    port = device.query_port(1)
    assert isinstance(port, PortAttr)
    assert port.state == PortState.ACTIVE  # the suite runs on loopback, which is up
    assert isinstance(port.active_mtu, Mtu) and port.active_mtu <= port.max_mtu
    assert port.max_msg_sz >= 1
    for bad in (0, attr.phys_port_cnt + 1):
        with pytest.raises(VerbsError) as info:
            device.query_port(bad)
        assert info.value.errno == errno.EINVAL, bad


async def test_closed_context_refuses_use() -> None:
    async with rdmashim.open_device() as ctx:
        pass
    with pytest.raises(VerbsError):
        ctx.alloc_pd()
    with pytest.raises(VerbsError):
        ctx.create_cq(4)
