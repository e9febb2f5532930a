"""UD queue pairs: datagrams addressed by an address handle, on devices that have UD.

IB and RoCE devices (rxe) run the datagram tests; iWARP devices (siw, the
built-in engine, IBAL over them) have no UD, and the first test checks they
refuse it with a reason. A UD receive's buffer starts with the 40 bytes of
the datagram's Global Route Header on RoCE (``wc_flags`` GRH), as in libibverbs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from api.support import drain, ok, pattern, quiet

from rdmashim.verbs.attrs import AHAttr, QPCap
from rdmashim.verbs.enums import QPState, QPType, Transport, WCFlags, WCOpcode
from rdmashim.verbs.errors import NotSupported, VerbsError
from rdmashim.verbs.wr import RecvWR, SendWR

QKEY = 0x1234
GRH = 40
"""Bytes of Global Route Header before a UD receive's payload."""
IPV4_MAPPED = bytes(10) + b"\xff\xff"


def _gid_type(device_name: str, index: int) -> str:
    """The GID entry's type from sysfs ("RoCE v2", "IB/RoCE v1"), "" where unknown."""
    path = Path(f"/sys/class/infiniband/{device_name}/ports/1/gid_attrs/types/{index}")
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def local_gid(ctx: Any) -> tuple[int, bytes]:
    """The index and value of port 1's GID to address: an IPv4 one, RoCE v2 first."""
    found: list[tuple[bool, bool, int, bytes]] = []
    for index in range(min(ctx.query_port(1).gid_tbl_len, 16)):
        try:
            gid = ctx.query_gid(1, index)
        except VerbsError:
            continue  # an empty entry, on libraries that report those as errors
        if any(gid):
            ipv4 = gid.startswith(IPV4_MAPPED)
            found.append((ipv4, _gid_type(ctx.device.name, index) == "RoCE v2", -index, gid))
    if not found:
        pytest.skip("port 1 has no GID to address")
    _, _, index, gid = max(found)
    return -index, gid


def _skip_unless_ud(ctx: Any) -> None:
    if ctx.query_device().transport is Transport.IWARP:
        pytest.skip("iWARP has no UD QPs (test_ud_refused_on_iwarp checks the refusal)")


@dataclass
class UdEnd:
    """A UD QP with its CQs and a registered buffer."""

    qp: Any
    send_cq: Any
    recv_cq: Any
    mr: Any


@dataclass
class Ud:
    """Two UD QPs on one PD and an address handle to the port's own GID."""

    a: UdEnd
    b: UdEnd
    ah: Any
    mtu: int


def _end(ctx: Any, pd: Any, size: int) -> UdEnd:
    send_cq, recv_cq = ctx.create_cq(16), ctx.create_cq(16)
    qp = pd.create_qp(send_cq=send_cq, recv_cq=recv_cq, cap=QPCap(16, 16), qp_type=QPType.UD)
    qp.modify(qp_state=QPState.INIT, qkey=QKEY)
    qp.modify(qp_state=QPState.RTR)
    qp.modify(qp_state=QPState.RTS)
    return UdEnd(qp, send_cq, recv_cq, pd.reg_mr(bytearray(size)))


@pytest.fixture
async def ud(device: Any) -> AsyncIterator[Ud]:
    _skip_unless_ud(device)
    mtu = 128 << device.query_port(1).active_mtu
    index, gid = local_gid(device)
    pd = device.alloc_pd()
    size = 2 * (GRH + mtu + 64)  # room for a datagram one byte over the MTU
    ah = pd.create_ah(AHAttr(port_num=1, is_global=True, dgid=gid, sgid_index=index))
    try:
        yield Ud(_end(device, pd, size), _end(device, pd, size), ah, mtu)
    finally:
        pd.close()


def _send(src: UdEnd, dst: UdEnd, ah: Any, data: bytes, wr_id: int, qkey: int = QKEY) -> None:
    src.mr.buf[: len(data)] = data
    sges = [src.mr.sge(0, len(data))]
    src.qp.post_send(SendWR(wr_id, sg_list=sges, ah=ah, remote_qpn=dst.qp.qp_num, remote_qkey=qkey))


def _recv(end: UdEnd, length: int, wr_id: int = 0) -> None:
    """A receive into the second half of the end's buffer (the first half sends)."""
    half = len(end.mr.buf) // 2
    end.qp.post_recv(RecvWR(wr_id, [end.mr.sge(half, length)]))


def _received(end: UdEnd, wc: Any) -> bytes:
    half = len(end.mr.buf) // 2
    return bytes(end.mr.buf[half + GRH : half + wc.byte_len])


async def test_ud_refused_on_iwarp(device: Any) -> None:
    if device.query_device().transport is not Transport.IWARP:
        pytest.skip("the device has UD (the test_ud_* datagram tests run)")
    with device.alloc_pd() as pd:
        cq = device.create_cq(4)
        with pytest.raises(NotSupported, match="no UD"):
            pd.create_qp(send_cq=cq, recv_cq=cq, qp_type=QPType.UD)
        with pytest.raises(NotSupported, match="no UD"):
            pd.create_ah(AHAttr())
        cq.close()


async def test_ud_datagrams_both_ways(ud: Ud) -> None:
    """Each side's datagram arrives whole behind its GRH, naming the sender's QP."""
    for src, dst, seed in ((ud.a, ud.b, 1), (ud.b, ud.a, 2)):
        data = pattern(ud.mtu, seed)
        _recv(dst, GRH + ud.mtu, wr_id=seed)
        _send(src, dst, ud.ah, data, wr_id=10 + seed)
        (sent,) = ok(await drain(src.send_cq, 1))
        assert (sent.wr_id, sent.opcode) == (10 + seed, WCOpcode.SEND)
        (wc,) = ok(await drain(dst.recv_cq, 1))
        assert (wc.wr_id, wc.opcode, wc.byte_len) == (seed, WCOpcode.RECV, GRH + ud.mtu)
        assert wc.wc_flags & WCFlags.GRH
        assert wc.src_qp == src.qp.qp_num
        assert wc.qp_num == dst.qp.qp_num
        assert _received(dst, wc) == data


async def test_ud_datagram_above_path_mtu_is_not_delivered(ud: Ud) -> None:
    """A datagram one byte over the path MTU never arrives: the provider refuses it at
    post, or, as IBA's C10-93.1.1 has it (rxe), completes it without sending a packet
    and without an error. A datagram of the MTU then arrives."""
    _recv(ud.b, GRH + ud.mtu + 1, wr_id=5)
    try:
        _send(ud.a, ud.b, ud.ah, pattern(ud.mtu + 1), wr_id=1)
    except VerbsError:
        pass
    else:
        (sent,) = await drain(ud.a.send_cq, 1)
        assert sent.wr_id == 1
    assert await quiet(ud.b.recv_cq) == []
    _send(ud.a, ud.b, ud.ah, pattern(ud.mtu, 3), wr_id=2)
    ok(await drain(ud.a.send_cq, 1))
    (wc,) = ok(await drain(ud.b.recv_cq, 1))
    assert (wc.wr_id, wc.byte_len) == (5, GRH + ud.mtu)
    assert _received(ud.b, wc) == pattern(ud.mtu, 3)


async def test_ud_wrong_qkey_is_dropped(ud: Ud) -> None:
    """A datagram with another Q_Key is dropped silently; the next right one arrives."""
    _recv(ud.b, GRH + 64, wr_id=7)
    _send(ud.a, ud.b, ud.ah, b"wrong key", wr_id=1, qkey=QKEY + 1)
    ok(await drain(ud.a.send_cq, 1))
    assert await quiet(ud.b.recv_cq) == []
    _send(ud.a, ud.b, ud.ah, b"right key", wr_id=2)
    ok(await drain(ud.a.send_cq, 1))
    (wc,) = ok(await drain(ud.b.recv_cq, 1))
    assert (wc.wr_id, wc.src_qp) == (7, ud.a.qp.qp_num)
    assert _received(ud.b, wc) == b"right key"
