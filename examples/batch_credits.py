"""A stream of small messages with flow control, posted and polled in batches.

iWARP has no RNR retry: a Send that finds no receive posted at the peer ends the
connection. So the receiver posts its receives ahead and gives the sender that
many credits; the sender never has more Sends out than it has credits, and the
receiver gives credits back (a small Send of its own) as it posts its receives
again. Both sides post and poll many work requests per call: RecvBatch,
SendBatch and WCArray (docs/verbs.md, "Batch verbs").
Run it: ``python examples/batch_credits.py`` (built-in engine, loopback).
"""

import struct
from functools import partial

import trio

from rdmashim import (
    Access,
    QPCap,
    RecvBatch,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    WCArray,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import open_connection, serve

WINDOW = 64  # receives the receiver keeps posted: the sender's credits
BATCH = 16  # Sends per post
SIZE = 32  # bytes per message; each starts with its sequence number
TOTAL = 10_000  # messages (a multiple of BATCH)
SEQ = struct.Struct("!Q")
CREDITS = struct.Struct("!I")  # a credit message: how many receives were posted again


def received(wcs, n):
    """The wr_ids of the receives among the first ``n`` completions in ``wcs`` (our
    own Sends complete in the same CQ); any failure ends the program."""
    if wcs.status[:n].count(WCStatus.SUCCESS) != n:  # flushed or failed: the connection is gone
        wcs[next(i for i in range(n) if wcs.status[i] != WCStatus.SUCCESS)].raise_for_status()
    return [wcs.wr_id[i] for i in range(n) if wcs.opcode[i] == WCOpcode.RECV]


async def receiver(request, finished):
    slots = request.pd.reg_mr(bytearray(WINDOW * SIZE), Access.LOCAL_WRITE)
    recvs = RecvBatch(RecvWR(i, [slots.sge(i * SIZE, SIZE)]) for i in range(WINDOW))
    request.qp.post_recv_batch(recvs)  # all WINDOW receives, before accepting
    conn = await request.accept(private_data=CREDITS.pack(WINDOW))  # the first credits
    wcs = WCArray(2 * WINDOW)
    expected = 0
    while expected < TOTAL:
        n = await conn.cq.poll_wait_into(wcs)
        done = received(wcs, n)
        for slot in done:  # in the order they arrived
            (seq,) = SEQ.unpack_from(slots.buf, slot * SIZE)
            assert seq == expected, f"message {seq} where {expected} was due"
            expected += 1
        if done:
            conn.qp.post_recv_batch(recvs, indices=done)  # the same receives again...
            back = CREDITS.pack(len(done))  # ...and as many credits back to the sender
            conn.qp.post_send(
                SendWR(0, WROpcode.SEND, [back], SendFlags.INLINE | SendFlags.SIGNALED)
            )
    print(f"received {expected} messages in order")
    finished.set()
    await conn.wait_disconnected()


async def sender(conn, finished):
    (credits,) = CREDITS.unpack(conn.private_data)
    inbox = conn.pd.reg_mr(bytearray(WINDOW * CREDITS.size), Access.LOCAL_WRITE)
    credit_recvs = RecvBatch(
        RecvWR(i, [inbox.sge(i * CREDITS.size, CREDITS.size)]) for i in range(WINDOW)
    )
    conn.qp.post_recv_batch(credit_recvs)  # room for the receiver's credit messages
    messages = conn.pd.reg_mr(bytearray(BATCH * SIZE))
    # BATCH Sends, one message slot each; only the last asks for a completion
    flags = [SendFlags.INLINE] * (BATCH - 1) + [SendFlags.INLINE | SendFlags.SIGNALED]
    batch = SendBatch(
        SendWR(i, WROpcode.SEND, [messages.sge(i * SIZE, SIZE)], flags[i]) for i in range(BATCH)
    )
    wcs = WCArray(2 * WINDOW)
    sent = 0
    while sent < TOTAL or credits < WINDOW:  # until every credit is back
        if sent < TOTAL and credits >= BATCH:
            for i in range(BATCH):
                SEQ.pack_into(messages.buf, i * SIZE, sent + i)
            conn.qp.post_send_batch(batch)  # inline: the bytes are copied now
            sent += BATCH
            credits -= BATCH
            continue
        n = await conn.cq.poll_wait_into(wcs)  # wait for credits
        back = received(wcs, n)
        credits += sum(CREDITS.unpack_from(inbox.buf, i * CREDITS.size)[0] for i in back)
        conn.qp.post_recv_batch(credit_recvs, indices=back)
    await finished.wait()
    print(f"sent {sent} messages, {BATCH} per post, at most {WINDOW} in flight")


async def main():
    finished = trio.Event()
    cap = QPCap(max_send_wr=2 * WINDOW, max_recv_wr=WINDOW, max_inline_data=SIZE)
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(
            partial(serve, partial(receiver, finished=finished), 0, cap=cap)
        )
        async with open_connection("127.0.0.1", port, cap=cap) as conn:
            await sender(conn, finished)
        nursery.cancel_scope.cancel()


trio.run(main)
