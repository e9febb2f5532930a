"""Completions as fixed binary rows: ``cq.poll_rows`` writes each one as a ``WC_ROW`` row
(the layout of a C struct) into a buffer of yours, for code that reads them there (C
through the buffer, ``struct``, numpy) with no Python object per completion
(docs/verbs.md, "Completions as rows").
Run it: ``python examples/poll_rows.py`` (built-in engine, loopback).
"""

from functools import partial

import trio

from rdmashim import (
    WC_ROW,
    Access,
    RecvWR,
    SendBatch,
    SendFlags,
    SendWR,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import open_connection, serve

COUNT = 32  # messages; message i is i bytes long
SLOT = 64  # bytes per receive


async def receiver(request, finished):
    slots = request.pd.reg_mr(bytearray(COUNT * SLOT), Access.LOCAL_WRITE)
    request.qp.post_recv([RecvWR(i, [slots.sge(i * SLOT, SLOT)]) for i in range(COUNT)])
    conn = await request.accept()
    rows = bytearray(8 * WC_ROW.size)  # room for 8 completions, taken again at each poll
    lengths = []
    while len(lengths) < COUNT:
        await conn.cq.wait()
        n = conn.cq.poll_rows(rows)  # up to 8 completions, oldest first, as rows 0..n-1
        for wr_id, status, opcode, byte_len, *_ in WC_ROW.iter_unpack(
            memoryview(rows)[: n * WC_ROW.size]
        ):
            if status != WCStatus.SUCCESS:
                raise SystemExit(f"receive {wr_id}: {WCStatus(status).name}")
            if opcode == WCOpcode.RECV:
                lengths.append((wr_id, byte_len))
    in_order = lengths == [(i, i) for i in range(COUNT)]
    print(f"received {COUNT} messages as rows, each its own length, in order: {in_order}")
    finished.set()
    await conn.wait_disconnected()


async def main():
    finished = trio.Event()
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(partial(serve, partial(receiver, finished=finished), 0))
        async with open_connection("localhost", port) as conn:
            src = conn.pd.reg_mr(bytearray(range(COUNT)), Access.LOCAL_WRITE)
            sends = SendBatch(SendWR(i, WROpcode.SEND, [src.sge(0, i)]) for i in range(COUNT))
            sends.set(COUNT - 1, send_flags=SendFlags.SIGNALED)  # the last one retires all
            conn.qp.post_send_batch(sends)
            (wc,) = await conn.cq.poll_wait(1)
            wc.raise_for_status()
            await finished.wait()
        nursery.cancel_scope.cancel()


trio.run(main)
