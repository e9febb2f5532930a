"""Test helpers: a connected pair of soft-iWARP queue pairs over real loopback TCP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

import rdmashim
from rdmashim.providers.softiwarp import mpa
from rdmashim.providers.softiwarp.connection import (
    MpaOptions,
    accept_qp,
    connect_qp,
    read_request,
)


@dataclass
class Side:
    """One end of a connected pair: context, PD, CQs, QP."""

    ctx: Any
    pd: Any
    send_cq: Any
    recv_cq: Any
    qp: Any
    channel: Any = None

    def reg(self, size_or_data: int | bytes, access: rdmashim.Access | None = None) -> Any:
        buf = bytearray(size_or_data)
        if access is None:
            access = (
                rdmashim.Access.LOCAL_WRITE
                | rdmashim.Access.REMOTE_WRITE
                | rdmashim.Access.REMOTE_READ
            )
        return self.pd.reg_mr(buf, access)


async def make_pair(
    ctx: Any,
    *,
    client_options: MpaOptions | None = None,
    server_options: MpaOptions | None = None,
    cap: rdmashim.QPCap | None = None,
    srq: bool = False,
    private_data: bytes = b"",
    server_ctx: Any = None,
    sq_sig_all: bool = False,
    channel: bool = False,
    listener: trio.SocketListener | None = None,
    client_cq: Any = None,
) -> tuple[Side, Side]:
    """Two QPs connected through a real loopback TCP connection: (client, server).

    Connects through ``listener`` when given (it is closed afterwards), so a
    caller can learn the port before any byte is sent. ``client_cq`` (of ``ctx``)
    is the client QP's send and receive CQ when given.
    """
    sides = []
    for c in (ctx, server_ctx or ctx):
        pd = c.alloc_pd()
        chan = c.create_comp_channel() if channel else None
        if client_cq is not None and not sides:
            scq = rcq = client_cq
        else:
            scq, rcq = c.create_cq(4096), c.create_cq(4096, chan)
        kwargs: dict[str, Any] = {
            "cap": cap or rdmashim.QPCap(max_send_sge=6, max_recv_sge=6, max_inline_data=64)
        }
        if srq:
            kwargs["srq"] = pd.create_srq(256, 6)
        qp = pd.create_qp(send_cq=scq, recv_cq=rcq, sq_sig_all=sq_sig_all, **kwargs)
        sides.append(Side(c, pd, scq, rcq, qp, chan))
    client, server = sides
    if listener is None:
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]

    async def serve() -> None:
        stream = await listener.accept()
        req = await read_request(stream)
        await accept_qp(server.qp, stream, req, options=server_options)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await connect_qp(client.qp, stream, private_data=private_data, options=client_options)
    finally:
        await listener.aclose()
    return client, server


async def settle(side: Side, remote_mr: Any) -> None:
    """Wait until every Write ``side`` posted so far is placed at the peer.

    An iWARP Write completes once sent; a Read that follows it on the same
    stream is answered only after the Write's data reached the peer's memory.
    """
    side.qp.post_send(
        rdmashim.SendWR(
            0xFFFF, rdmashim.WROpcode.RDMA_READ, [], rdmashim.SendFlags.SIGNALED,
            remote_mr.addr, remote_mr.rkey,
        )
    )  # fmt: skip
    with trio.fail_after(10):
        while True:
            for wc in await side.send_cq.poll_wait(1):
                if wc.wr_id == 0xFFFF:
                    wc.raise_for_status()
                    return


async def raw_initiator(qp: Any) -> tuple[trio.SocketStream, mpa.StartFrame, bytes]:
    """Connect a raw TCP peer to ``qp`` (accepted as the MPA responder): the peer sends
    an MPA Request and reads the Reply. Returns the peer's stream, the Reply and the
    bytes that came after it."""
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            stream = await listener.accept()
            await accept_qp(qp, stream, await read_request(stream))

        nursery.start_soon(serve)
        peer = await trio.open_tcp_stream("127.0.0.1", port)
        await peer.send_all(mpa.encode_start_frame(mpa.StartFrame(reply=False, ird=4, ord=4)))
        reply = b""
        while (parsed := mpa.parse_start_frame(reply, reply=True)) is None:
            reply += await peer.receive_some(4096)
    await listener.aclose()
    frame, used = parsed
    return peer, frame, reply[used:]
