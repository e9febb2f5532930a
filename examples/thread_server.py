"""A request-reply server whose connection is served by a thread of its own.

A server that answers each message at once can let ``cq.serve_in_thread`` take the
completions: on the built-in engine's native engine a thread waits in C without the
GIL, and the callback runs in that thread for each batch, posting the replies itself;
no trio task wakes for a message (docs/verbs.md). Where the backend cannot (the
Python engine, rdma-core, IBAL) it returns False at once and the server waits the
usual way, with ``poll_wait_into``: the same callback serves both.
Run it: ``python examples/thread_server.py`` (built-in engine, loopback).
"""

import threading
from functools import partial

import trio

from rdmashim import (
    Access,
    QPCap,
    RecvBatch,
    RecvWR,
    SendFlags,
    SendWR,
    WCArray,
    WCOpcode,
    WROpcode,
)
from rdmashim.cm import open_connection, serve

SLOTS = 8  # receives the server keeps posted: the client's credits
SIZE = 64
REQUESTS = 2000


class Server:
    """Answers each request with its bytes upper-cased, in the thread that received it."""

    def __init__(self, request):
        self.qp = request.qp
        self.slots = request.pd.reg_mr(bytearray(SLOTS * SIZE), Access.LOCAL_WRITE)
        self.recvs = RecvBatch(RecvWR(i, [self.slots.sge(i * SIZE, SIZE)]) for i in range(SLOTS))
        self.qp.post_recv_batch(self.recvs)
        self.answered = 0
        self.threads = set()

    def on_completions(self, wcs, n):
        """Called with ``n`` new completions; False gives the connection back."""
        self.threads.add(threading.get_ident())
        for i in range(n):
            wcs[i].raise_for_status()  # (the peer went away: flushed receives)
            if wcs.opcode[i] != WCOpcode.RECV:
                continue  # (our own Sends complete here too)
            slot = wcs.wr_id[i]
            start = slot * SIZE
            reply = bytes(self.slots.buf[start : start + wcs.byte_len[i]]).upper()
            self.qp.post_send(SendWR(slot, WROpcode.SEND, [reply], SendFlags.INLINE))
            # The receive again after the reply: off the round trip's path; the client
            # has one request in flight and SLOTS receives stay posted (docs/verbs.md,
            # "Answer first").
            self.qp.post_recv_batch(self.recvs, indices=[slot])
            self.answered += 1
        return self.answered < REQUESTS


async def handle(request, finished):
    server = Server(request)
    conn = await request.accept()
    wcs = WCArray(32)
    if not await conn.cq.serve_in_thread(wcs, server.on_completions):
        while server.on_completions(wcs, await conn.cq.poll_wait_into(wcs)):
            pass  # (this backend cannot: the event loop's way, same callback)
    where = "a thread of its own" if threading.get_ident() not in server.threads else "trio"
    print(f"server: answered {server.answered} requests in {where}")
    finished.set()


async def main():
    finished = trio.Event()
    async with trio.open_nursery() as nursery:
        cap = QPCap(max_send_wr=SLOTS, max_recv_wr=SLOTS, max_inline_data=SIZE)
        _, port = await nursery.start(
            partial(serve, partial(handle, finished=finished), 0, cap=cap)
        )
        async with open_connection("127.0.0.1", port, cap=cap) as conn:
            answers = conn.pd.reg_mr(bytearray(SLOTS * SIZE), Access.LOCAL_WRITE)
            for i in range(SLOTS):
                conn.qp.post_recv(RecvWR(i, [answers.sge(i * SIZE, SIZE)]))
            wcs = WCArray(SLOTS)
            for k in range(REQUESTS):  # one at a time: a round trip each
                request = SendWR(k, WROpcode.SEND, [b"request %d" % k], SendFlags.INLINE)
                conn.qp.post_send(request)
                got = None
                while got is None:
                    n = await conn.cq.poll_wait_into(wcs)
                    for i in range(n):
                        wcs[i].raise_for_status()
                        if wcs.opcode[i] == WCOpcode.RECV:
                            slot = wcs.wr_id[i]
                            got = bytes(answers.buf[slot * SIZE : slot * SIZE + wcs.byte_len[i]])
                            conn.qp.post_recv(RecvWR(slot, [answers.sge(slot * SIZE, SIZE)]))
                assert got == b"REQUEST %d" % k, got
            print(f"client: {REQUESTS} replies, each its request upper-cased")
            await finished.wait()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main)
