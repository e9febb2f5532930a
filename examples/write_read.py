"""One-sided RDMA: the client writes into the server's memory, then reads it back.

The server registers a buffer the peer may write and read, and hands its address
and rkey to the client in the private data of its accept. The client RDMA Writes
into that buffer and RDMA Reads it back; the server's CPU takes no part in either.
Run it: ``python examples/write_read.py`` (built-in engine, loopback).
"""

import struct
from functools import partial

import trio

from rdmashim import Access, SendWR, WROpcode
from rdmashim.cm import open_connection, serve

REGION = struct.Struct("!QI")  # what the server hands over: (address, rkey)
REMOTE = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
MESSAGE = b"written by RDMA"


async def server(request, finished):
    board = request.pd.reg_mr(bytearray(64), REMOTE)  # the peer may write and read it
    conn = await request.accept(private_data=REGION.pack(board.iova, board.rkey))
    await conn.wait_disconnected()  # nothing to do meanwhile: the client does it all
    print("the server's buffer holds", bytes(board.buf[: len(MESSAGE)]))
    finished.set()


async def main():
    finished = trio.Event()
    async with trio.open_nursery() as nursery:
        # serve calls server(request, finished) for each connection; port 0: any free one
        _, port = await nursery.start(serve, partial(server, finished=finished), 0)
        async with open_connection("127.0.0.1", port) as conn:
            addr, rkey = REGION.unpack(conn.private_data)
            source = conn.pd.reg_mr(bytearray(MESSAGE))  # what we write
            sink = conn.pd.reg_mr(bytearray(len(MESSAGE)), Access.LOCAL_WRITE)  # a Read lands here
            conn.qp.post_send(
                [
                    SendWR(1, WROpcode.RDMA_WRITE, [source.sge()], remote_addr=addr, rkey=rkey),
                    SendWR(2, WROpcode.RDMA_READ, [sink.sge()], remote_addr=addr, rkey=rkey),
                ]
            )
            # Both complete in the connection's one CQ. The Write completes once it is
            # handed to TCP; the Read behind it completes after the peer placed the Write.
            done = []
            while len(done) < 2:
                done += [wc.raise_for_status() for wc in await conn.cq.poll_wait()]
            print("read back", bytes(sink.buf))
        await finished.wait()
        nursery.cancel_scope.cancel()


trio.run(main)
