"""Protection and protocol errors: the right completion status on both sides, the right
Terminate code on the wire, both QPs in ERR and all outstanding work flushed."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

from rdmashim import (
    SGE,
    Access,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    VerbsError,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.providers.softiwarp import ddp
from rdmashim.providers.softiwarp.terminate import (
    DdpTaggedCode,
    DdpUntaggedCode,
    Layer,
    RdmapCode,
    RdmapType,
    TermCode,
    ddp_tagged,
    ddp_untagged,
    rdmap,
)

from pairs import Side, make_pair, raw_initiator, settle

pytestmark = pytest.mark.usefixtures("engine_kernels")  # compiled and Python kernels

SIG = SendFlags.SIGNALED
RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


async def drain(cq, n: int) -> list:
    wcs: list = []
    with trio.fail_after(10):
        while len(wcs) < n:
            wcs += await cq.poll_wait()
    return wcs


async def both_in_error(client: Side, server: Side) -> None:
    with trio.fail_after(10):
        await client.qp.wait_closed()
        await server.qp.wait_closed()
    assert client.qp.state == server.qp.state == QPState.ERR


async def expect_terminated(
    client: Side, server: Side, code: TermCode, *, detector: Side | None = None
) -> None:
    """``detector`` (default: server) sent a Terminate with ``code``; the other side got it."""
    detector = detector or server
    other = client if detector is server else server
    await both_in_error(client, server)
    assert detector.qp.error is not None and detector.qp.error.code == code, detector.qp.error
    assert other.qp.remote_terminate == code
    # Everything posted afterwards completes at once, flushed.
    other.send_cq.poll(1000)
    other.qp.post_send(SendWR(77, WROpcode.SEND, [], SIG))
    (wc,) = await drain(other.send_cq, 1)
    assert (wc.wr_id, wc.status) == (77, WCStatus.WR_FLUSH_ERR)


async def write_to(client: Side, rkey: int, addr: int, length: int = 16) -> None:
    src = client.reg(length)
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, addr, rkey))


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("bad-stag", ddp_tagged(DdpTaggedCode.INVALID_STAG)),
        ("wrong-key", ddp_tagged(DdpTaggedCode.INVALID_STAG)),
        ("other-pd", ddp_tagged(DdpTaggedCode.STAG_NOT_ASSOC)),
        ("no-remote-write", ddp_tagged(DdpTaggedCode.INVALID_STAG)),
        ("out-of-bounds", ddp_tagged(DdpTaggedCode.BASE_BOUNDS)),
        ("deregistered", ddp_tagged(DdpTaggedCode.INVALID_STAG)),
    ],
)
async def test_write_protection(ctx, case: str, code: TermCode) -> None:
    client, server = await make_pair(ctx)
    rbufs = [server.reg(64) for _ in range(3)]
    server.qp.post_recv([RecvWR(10 + i, [b.sge()]) for i, b in enumerate(rbufs)])
    target = server.reg(4096)
    rkey, addr = target.rkey, target.addr
    if case == "bad-stag":
        rkey = 0x7FFF0000
    elif case == "wrong-key":
        rkey = (target.rkey & ~0xFF) | ((target.rkey + 1) & 0xFF)
    elif case == "other-pd":
        other = server.ctx.alloc_pd().reg_mr(bytearray(4096), RW)
        rkey, addr = other.rkey, other.addr
    elif case == "no-remote-write":
        ro = server.reg(4096, Access.LOCAL_WRITE | Access.REMOTE_READ)
        rkey, addr = ro.rkey, ro.addr
    elif case == "out-of-bounds":
        addr = target.addr + 4090
    elif case == "deregistered":
        target.close()
    await write_to(client, rkey, addr)
    # iWARP: a Write completes locally once sent; the peer's Terminate follows.
    (wc,) = await drain(client.send_cq, 1)
    assert wc.status == WCStatus.SUCCESS
    await expect_terminated(client, server, code)
    # The writer reads what may be wrong in its own words (siw's code for missing
    # rights is "invalid STag", which alone reads as a wrong rkey).
    words = {"other-pd": "another protection domain", "out-of-bounds": "outside the peer's region"}
    assert words.get(case, "without REMOTE_WRITE") in str(client.qp.error), client.qp.error
    # The responder's posted receives are flushed.
    wcs = await drain(server.recv_cq, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(10 + i, WCStatus.WR_FLUSH_ERR) for i in range(3)]


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("bad-stag", rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.INVALID_STAG)),
        ("other-pd", rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.STAG_NOT_ASSOC)),
        ("no-remote-read", rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.ACCESS_RIGHTS)),
        ("out-of-bounds", rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.BASE_BOUNDS)),
    ],
)
async def test_read_protection(ctx, case: str, code: TermCode) -> None:
    client, server = await make_pair(ctx)
    source = server.reg(4096)
    rkey, addr = source.rkey, source.addr
    if case == "bad-stag":
        rkey = 0x7FFF0000
    elif case == "other-pd":
        other = server.ctx.alloc_pd().reg_mr(bytearray(4096), RW)
        rkey, addr = other.rkey, other.addr
    elif case == "no-remote-read":
        wo = server.reg(4096, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        rkey, addr = wo.rkey, wo.addr
    elif case == "out-of-bounds":
        addr = source.addr + 1
    sink = client.reg(4096)
    client.qp.post_send(
        [
            SendWR(1, WROpcode.RDMA_READ, [sink.sge()], SIG, addr, rkey),
            SendWR(2, WROpcode.SEND, [sink.sge(0, 4)], SIG),
        ]
    )
    wcs = await drain(client.send_cq, 2)
    assert (wcs[0].wr_id, wcs[0].status, wcs[0].opcode) == (
        1, WCStatus.REM_ACCESS_ERR, WCOpcode.RDMA_READ,
    )  # fmt: skip
    # The Send behind the Read went out before the Terminate came back, or was flushed.
    assert wcs[1].wr_id == 2 and wcs[1].status in (WCStatus.SUCCESS, WCStatus.WR_FLUSH_ERR)
    await expect_terminated(client, server, code)
    words = {
        "bad-stag": "the rkey is wrong", "other-pd": "another protection domain",
        "no-remote-read": "without REMOTE_READ", "out-of-bounds": "outside the peer's region",
    }  # fmt: skip
    assert words[case] in str(client.qp.error), client.qp.error


async def test_send_without_receive(pair: tuple[Side, Side]) -> None:
    client, server = pair
    client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(b"x").sge()], SIG))
    await expect_terminated(client, server, ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER))
    assert "no receive posted" in str(client.qp.error), client.qp.error


async def test_send_longer_than_receive(pair: tuple[Side, Side]) -> None:
    client, server = pair
    rbuf = server.reg(100)
    server.qp.post_recv([RecvWR(1, [rbuf.sge()]), RecvWR(2, [rbuf.sge()])])
    client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(200000).sge()], SIG))
    wcs = await drain(server.recv_cq, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [
        (1, WCStatus.LOC_LEN_ERR),
        (2, WCStatus.WR_FLUSH_ERR),
    ]
    # Linux siw's code for a receive too short (siw_qp_rx.c), not RFC 5041's "too long".
    await expect_terminated(client, server, ddp_untagged(DdpUntaggedCode.MSN_NO_BUFFER))


async def test_receive_into_bad_memory(pair: tuple[Side, Side]) -> None:
    client, server = pair
    ro = server.reg(100, Access.REMOTE_READ)  # no LOCAL_WRITE: cannot receive into it
    server.qp.post_recv(RecvWR(1, [ro.sge()]))
    client.qp.post_send(SendWR(1, WROpcode.SEND, [client.reg(b"abc").sge()], SIG))
    (wc,) = await drain(server.recv_cq, 1)
    assert wc.status == WCStatus.LOC_PROT_ERR
    await expect_terminated(client, server, TermCode(Layer.DDP, 0, 0))
    assert bytes(ro.buf[:3]) == bytes(3)


async def test_local_protection_error(pair: tuple[Side, Side]) -> None:
    client, server = pair
    good = client.reg(b"payload")
    client.qp.post_send(
        [
            SendWR(1, WROpcode.SEND, [SGE(good.addr, 700, good.lkey)], SIG),  # past its end
            SendWR(2, WROpcode.SEND, [good.sge()], SIG),
        ]
    )  # fmt: skip
    wcs = await drain(client.send_cq, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [
        (1, WCStatus.LOC_PROT_ERR),
        (2, WCStatus.WR_FLUSH_ERR),
    ]
    await expect_terminated(
        client, server, rdmap(RdmapType.CATASTROPHIC, RdmapCode.UNSPECIFIED), detector=client
    )


async def test_an_sge_of_no_registered_region_is_refused_at_post(pair: tuple[Side, Side]) -> None:
    """A made-up lkey, or one whose MR was closed, is refused when posted, naming it
    (before: accepted, then LOC_PROT_ERR and a Terminate at completion time)."""
    client, server = pair
    closed = client.reg(b"payload")
    lkey = closed.lkey
    closed.close()
    for sge in (SGE(client.reg(8).addr, 7, 0x7FFF0000), SGE(closed.addr, 7, lkey)):
        with pytest.raises(VerbsError, match=f"lkey {sge.lkey:#x} names no registered memory"):
            client.qp.post_send(SendWR(1, WROpcode.SEND, [sge], SIG))
        with pytest.raises(VerbsError, match="names no registered memory") as refused:
            client.qp.post_recv([RecvWR(1, [client.reg(8).sge()]), RecvWR(2, [sge])])
        assert refused.value.bad_wr == 1
    # The connection is unharmed: a Send still goes.
    rbuf = server.reg(16)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    client.qp.post_send(SendWR(2, WROpcode.SEND, [client.reg(b"fine").sge()], SIG))
    ok = await drain(server.recv_cq, 1)
    assert ok[0].status == WCStatus.SUCCESS and bytes(rbuf.buf[:4]) == b"fine"


async def test_invalidated_stag_refuses_access(pair: tuple[Side, Side]) -> None:
    client, server = pair
    rbuf = server.reg(64)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    target = server.reg(4096)
    client.qp.post_send(
        SendWR(
            1, WROpcode.SEND_WITH_INV, [client.reg(b"bye").sge()], SIG, invalidate_rkey=target.rkey
        )
    )
    (wc,) = await drain(server.recv_cq, 1)
    assert wc.invalidated_rkey == target.rkey
    await write_to(client, target.rkey, target.addr)
    await expect_terminated(client, server, ddp_tagged(DdpTaggedCode.INVALID_STAG))


async def test_invalidate_unknown_stag(pair: tuple[Side, Side]) -> None:
    client, server = pair
    rbuf = server.reg(64)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    client.qp.post_send(
        SendWR(
            1, WROpcode.SEND_WITH_INV, [client.reg(b"bye").sge()], SIG, invalidate_rkey=0x7FFF0000
        )
    )
    (wc,) = await drain(server.recv_cq, 1)
    assert wc.status == WCStatus.REM_INV_REQ_ERR
    await expect_terminated(
        client, server, rdmap(RdmapType.REMOTE_OPERATION, RdmapCode.CANNOT_INVALIDATE)
    )


async def test_received_terminate_quotes_header(pair: tuple[Side, Side]) -> None:
    """The Terminate on the wire carries the offending header, as siw's does."""
    client, server = pair
    sent: list = []
    produce = server.qp.engine.produce

    def spy(*args, **kwargs):
        out = produce(*args, **kwargs)
        sent.extend(bytes(b) for b in out)
        return out

    server.qp.engine.produce = spy
    await write_to(client, 0x7FFF0000, 0x1000, 8)
    await both_in_error(client, server)
    wire = b"".join(sent)
    hdr = ddp.parse_header(wire)
    assert hdr is not None and hdr.opcode == ddp.Opcode.TERMINATE
    assert (hdr.qn, hdr.msn, hdr.mo) == (2, 1, 0)
    term = ddp.parse_terminate(wire[hdr.header_len : hdr.ulpdu_len + 2])
    assert term.code == ddp_tagged(DdpTaggedCode.INVALID_STAG) and term.ddp_header_copied
    quoted = ddp.parse_header(term.copied_header)
    assert quoted is not None and (quoted.opcode, quoted.stag, quoted.to) == (
        ddp.Opcode.WRITE,
        0x7FFF0000,
        0x1000,
    )


async def test_peer_closing_mid_transfer(pair: tuple[Side, Side]) -> None:
    client, server = pair
    src = client.reg(1 << 20)
    dst = server.reg(1 << 20)
    rbuf = client.reg(16)
    client.qp.post_recv([RecvWR(100 + i, [rbuf.sge()]) for i in range(2)])
    client.qp.post_send(
        [SendWR(i, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey) for i in range(64)]
    )
    await trio.lowlevel.checkpoint()
    server.qp.close()  # the peer goes away while Writes are in flight
    wcs = await drain(client.send_cq, 64)
    statuses = [w.status for w in wcs]
    assert [w.wr_id for w in wcs] == list(range(64))
    assert WCStatus.WR_FLUSH_ERR in statuses
    first_flush = statuses.index(WCStatus.WR_FLUSH_ERR)
    assert set(statuses[:first_flush]) <= {WCStatus.SUCCESS}
    assert set(statuses[first_flush:]) == {WCStatus.WR_FLUSH_ERR}
    recv = await drain(client.recv_cq, 2)
    assert {w.status for w in recv} == {WCStatus.WR_FLUSH_ERR}
    await both_in_error(client, server)
    assert isinstance(client.qp.error, ConnectionError)


async def test_user_moves_qp_to_error(pair: tuple[Side, Side]) -> None:
    client, server = pair
    rbuf = server.reg(16)
    server.qp.post_recv(RecvWR(5, [rbuf.sge()]))
    server.qp.modify(qp_state=QPState.ERR)
    (wc,) = await drain(server.recv_cq, 1)
    assert (wc.wr_id, wc.status) == (5, WCStatus.WR_FLUSH_ERR)
    server.qp.post_recv(RecvWR(6, [rbuf.sge()]))  # posting in ERR flushes at once
    (wc,) = await drain(server.recv_cq, 1)
    assert (wc.wr_id, wc.status) == (6, WCStatus.WR_FLUSH_ERR)
    await both_in_error(client, server)
    with pytest.raises(OSError, match="connected by the CM"):
        client.qp.modify(qp_state=QPState.RTS)


async def test_read_whose_sink_wraps_terminates_and_the_process_goes_on(ctx) -> None:
    """Issue 10: one Read Request whose sink TO + size passes 2^64, from a raw TCP peer,
    used to kill the responder (struct.error building the second Read Response FPDU).
    Now it gets RDMAP / remote protection / TO wrap, and a new connection still works."""
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(16)
    qp = pd.create_qp(send_cq=cq, recv_cq=cq)
    source = pd.reg_mr(bytearray(128 * 1024), RW)
    peer, frame, got = await raw_initiator(qp)
    hdr = ddp.encode_read_request(1, 0x1234, (1 << 64) - 100, source.length, source.rkey,
                                  source.addr)  # fmt: skip
    await peer.send_all(b"".join(bytes(b) for b in ddp.encode_fpdu(hdr, crc=frame.crc)))
    with trio.fail_after(10):
        while len(got) < 24:
            got += await peer.receive_some(4096)
    term = ddp.parse_header(got)
    assert term is not None and term.opcode is ddp.Opcode.TERMINATE
    code = rdmap(RdmapType.REMOTE_PROTECTION, RdmapCode.TO_WRAP)
    assert ddp.parse_terminate(got[20 : 2 + term.ulpdu_len]).code == code
    await peer.aclose()
    with trio.fail_after(10):
        await qp.wait_closed()
    assert qp.state == QPState.ERR and qp.error.code == code
    client, server = await make_pair(ctx)  # the device and the process go on
    dst, src = server.reg(16), client.reg(b"still running ok")
    client.qp.post_send(SendWR(1, WROpcode.RDMA_WRITE, [src.sge()], SIG, dst.addr, dst.rkey))
    await settle(client, dst)
    assert bytes(dst.buf) == b"still running ok"
