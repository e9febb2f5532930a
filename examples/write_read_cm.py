"""The one-sided Write and Read of write_read.py, with librdmacm's own calls.

Each side has an event channel and CM ids, as a C program does: a call that
starts something (resolve_addr, resolve_route, connect, listen, accept) returns
at once, and what came of it arrives as an event on the channel. The comments
name the C call each line stands for. The server and the client run as two tasks
with a channel each, as two programs would.
Run it: ``python examples/write_read_cm.py`` (built-in engine, loopback).
"""

import struct

import trio

from rdmashim import Access, SendWR, WROpcode
from rdmashim.cm import CMEventType, ConnParam, EventChannel

REGION = struct.Struct("!QI")  # the server's buffer: (address, rkey), in its accept
REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
MESSAGE = b"written by RDMA"


async def expect(channel, kind):
    """rdma_get_cm_event, check the event's type, rdma_ack_cm_event."""
    event = await channel.get_event()
    event.ack()
    if event.event != kind:
        raise ConnectionError(f"expected {kind.name}, got {event}")
    return event


def resources(cm_id):
    """ibv_alloc_pd, ibv_create_cq and rdma_create_qp on the device the CM chose."""
    ctx = cm_id.context  # id->verbs
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(16)
    cm_id.create_qp(pd, send_cq=cq, recv_cq=cq)
    return pd, cq


def release(cm_id, pd, cq):
    """rdma_destroy_qp, rdma_destroy_id, ibv_destroy_cq, ibv_dealloc_pd."""
    cm_id.qp.close()
    cm_id.destroy()
    cq.close()
    pd.close()  # and the regions registered on it (C deregisters them first)


async def server(task_status=trio.TASK_STATUS_IGNORED):
    async with EventChannel() as channel:  # rdma_create_event_channel
        listener = channel.create_id()  # rdma_create_id(channel, &id, NULL, RDMA_PS_TCP)
        listener.bind_addr(("127.0.0.1", 0))  # rdma_bind_addr (port 0: any free one)
        listener.listen()  # rdma_listen
        task_status.started(listener.local_addr[1])
        request = await expect(channel, CMEventType.CONNECT_REQUEST)
        cm_id = request.id  # a new id for this connection
        pd, cq = resources(cm_id)  # nothing completes on our side: the client does it all
        board = pd.reg_mr(bytearray(64), REMOTE)  # ibv_reg_mr
        cm_id.accept(ConnParam(REGION.pack(board.iova, board.rkey)))  # rdma_accept
        await expect(channel, CMEventType.ESTABLISHED)
        await expect(channel, CMEventType.DISCONNECTED)  # the client is done
        print("the server's buffer holds", bytes(board.buf[: len(MESSAGE)]))
        release(cm_id, pd, cq)
        listener.destroy()


async def client(port):
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        cm_id.resolve_addr(None, ("127.0.0.1", port))  # rdma_resolve_addr
        await expect(channel, CMEventType.ADDR_RESOLVED)
        cm_id.resolve_route()  # rdma_resolve_route
        await expect(channel, CMEventType.ROUTE_RESOLVED)
        pd, cq = resources(cm_id)
        cm_id.connect(ConnParam())  # rdma_connect
        established = await expect(channel, CMEventType.ESTABLISHED)
        addr, rkey = REGION.unpack(established.private_data)
        source = pd.reg_mr(bytearray(MESSAGE))
        sink = pd.reg_mr(bytearray(len(MESSAGE)), Access.LOCAL_WRITE)
        cm_id.qp.post_send(  # ibv_post_send of a chain of two work requests
            [
                SendWR(1, WROpcode.RDMA_WRITE, [source.sge()], remote_addr=addr, rkey=rkey),
                SendWR(2, WROpcode.RDMA_READ, [sink.sge()], remote_addr=addr, rkey=rkey),
            ]
        )
        done = []
        while len(done) < 2:  # ibv_poll_cq until both completed
            done += [wc.raise_for_status() for wc in await cq.poll_wait()]
        print("read back", bytes(sink.buf))
        cm_id.disconnect()  # rdma_disconnect
        await expect(channel, CMEventType.DISCONNECTED)
        release(cm_id, pd, cq)


async def main():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server)
        nursery.start_soon(client, port)


trio.run(main)
