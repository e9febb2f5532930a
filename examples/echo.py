"""Echo one message over the built-in engine on loopback (the README's example)."""

import trio

from rdmashim import Access, RecvWR, SendWR, WROpcode
from rdmashim.cm import open_connection, serve


async def echo(request):
    buf = request.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
    request.qp.post_recv(RecvWR(1, [buf.sge()]))  # before accepting
    conn = await request.accept(private_data=b"welcome")
    wc = (await conn.cq.poll_wait(1))[0].raise_for_status()  # one CQ takes all completions
    conn.qp.post_send(SendWR(2, WROpcode.SEND, [buf.sge(0, wc.byte_len)]))
    await conn.wait_disconnected()


async def main():
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(serve, echo, 0)
        async with open_connection("localhost", port, private_data=b"hi") as conn:
            print("server said", conn.private_data)
            buf = conn.pd.reg_mr(bytearray(b"hello, iWARP".ljust(64)), Access.LOCAL_WRITE)
            conn.qp.post_recv(RecvWR(3, [buf.sge(32, 32)]))
            conn.qp.post_send(SendWR(4, WROpcode.SEND, [buf.sge(0, 12)]))  # active side first
            while not any(wc.wr_id == 3 for wc in await conn.cq.poll_wait()):
                pass  # our Send (wr_id 4) completes in conn.cq too
            print("echoed", bytes(buf.buf[32:44]))
        nursery.cancel_scope.cancel()


trio.run(main)
