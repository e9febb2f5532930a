"""A request-reply server whose connection is served by a thread of its own.

A server that answers each message at once can let ``cq.serve_in_thread`` take the
completions: on the built-in engine's native engine a thread waits in C without the
GIL, and the callback runs in that thread for each batch, posting the replies itself;
no trio task wakes for a message (docs/verbs.md). Where the backend cannot (the
Python engine, rdma-core, IBAL) it returns False at once and the server waits the
usual way, with ``poll_wait_into``: the same callback serves both.

With ``--slots`` the server answers from slots instead (``SlotServer``): it hands
its Receive and Send slots to the backend (``cq.serve_in_thread(wcs, on_completions,
slots)``, docs/verbs.md, "Answering from slots"), and the native engine's thread posts
each reply from its Send slot, posts the Receive again and frees the Send slots as
their completions come, all in C: Python only writes a reply (``answer``), with no
completion row, no work request and no post of its own. Where the backend cannot,
every completion goes to ``on_completions``, which does the same with the same
``Slots`` (``take_send``, ``completed``, ``give_back``).

Run it: ``python examples/thread_server.py [--slots]`` (built-in engine, loopback).
"""

import sys
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
    WCStatus,
    WROpcode,
)
from rdmashim.cm import open_connection, serve
from rdmashim.verbs.slots import Slots

SLOTS = 8  # receives the server keeps posted: the client's credits
SIZE = 64
REQUESTS = 2000


class Server:
    """Answers each request with its bytes upper-cased, in the thread that received it."""

    def __init__(self, request):
        self.qp = request.qp
        self.buffer = request.pd.reg_mr(bytearray(SLOTS * SIZE), Access.LOCAL_WRITE)
        self.recvs = RecvBatch(RecvWR(i, [self.buffer.sge(i * SIZE, SIZE)]) for i in range(SLOTS))
        self.qp.post_recv_batch(self.recvs)
        self.slots = None  # (it posts its replies itself)
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
            reply = bytes(self.buffer.buf[start : start + wcs.byte_len[i]]).upper()
            self.qp.post_send(SendWR(slot, WROpcode.SEND, [reply], SendFlags.INLINE))
            # The receive again after the reply: off the round trip's path; the client
            # has one request in flight and SLOTS receives stay posted (docs/verbs.md,
            # "Answer first").
            self.qp.post_recv_batch(self.recvs, indices=[slot])
            self.answered += 1
        return self.answered < REQUESTS


class SlotServer(Server):
    """Answers each request with its bytes upper-cased, from a Send slot (``--slots``)."""

    def __init__(self, request):
        super().__init__(request)  # (its buffer: the Receive slots, wr_id i for slot i)
        sends = 2 * SLOTS  # a Send may complete after the client's next request came
        self.send_mr = request.pd.reg_mr(bytearray(sends * SIZE))
        self.slots = Slots(
            recv=self.buffer.sge(0, SIZE), nrecv=SLOTS,
            send=self.send_mr.sge(0, SIZE), nsend=sends, send_base=SLOTS,  # wr_id SLOTS + j
            signal_every=4, repost_every=2, room=sends, free=list(range(sends)),
            answer=self.answer,
        )  # fmt: skip

    def answer(self, recv_slot, length, send_slot):
        """A request of ``length`` bytes in Receive slot ``recv_slot``: its reply written
        into Send slot ``send_slot``; returns the reply's length (the engine posts it)."""
        self.threads.add(threading.get_ident())
        start = recv_slot * SIZE
        reply = bytes(self.buffer.buf[start : start + length]).upper()
        self.send_mr.buf[send_slot * SIZE : send_slot * SIZE + len(reply)] = reply
        self.answered += 1
        return len(reply)

    def on_completions(self, wcs, n):
        """The completions the engine leaves to Python (all of them where it does not
        answer from slots); False (the client went away) gives the connection back."""
        self.threads.add(threading.get_ident())
        for i in range(n):
            if wcs.status[i] != WCStatus.SUCCESS:
                return False  # (flushed: the connection is closing)
            if wcs.opcode[i] != WCOpcode.RECV:
                self.slots.completed(wcs.wr_id[i] - SLOTS)  # (a signaled Send of ours)
                continue
            slot, signaled = self.slots.take_send()
            length = self.answer(wcs.wr_id[i], wcs.byte_len[i], slot)
            flags = SendFlags.SIGNALED if signaled else SendFlags.NONE
            sge = self.send_mr.sge(slot * SIZE, length)
            self.qp.post_send(SendWR(SLOTS + slot, WROpcode.SEND, [sge], flags))
            again = self.slots.give_back(wcs.wr_id[i])
            if again:
                self.qp.post_recv_batch(self.recvs, indices=again)
        return True


async def handle(request, finished, slots):
    server = SlotServer(request) if slots else Server(request)
    conn = await request.accept()
    wcs = WCArray(32)
    if not await conn.cq.serve_in_thread(wcs, server.on_completions, server.slots):
        while server.on_completions(wcs, await conn.cq.poll_wait_into(wcs)):
            pass  # (this backend cannot: the event loop's way, same callback)
    where = "a thread of its own" if threading.get_ident() not in server.threads else "trio"
    print(f"server: answered {server.answered} requests in {where}")
    finished.set()


async def main(slots):
    finished = trio.Event()
    async with trio.open_nursery() as nursery:
        cap = QPCap(max_send_wr=2 * SLOTS, max_recv_wr=SLOTS, max_inline_data=SIZE)
        _, port = await nursery.start(
            partial(serve, partial(handle, finished=finished, slots=slots), 0, cap=cap)
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
        await finished.wait()  # (the client's connection closed: the server gives it up)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, sys.argv[1:] == ["--slots"])
