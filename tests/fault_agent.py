"""The faulted peer of the fault matrix (``test_faults.py``), in a process of its own.

Run as ``python fault_agent.py OP [PORT]`` with OP ``write`` or ``send``. It
serves one connection on 127.0.0.1 (``cm.serve``, the built-in engine), or
with PORT connects to the test there (``cm.open_connection``), and takes
:data:`BLOCKS` blocks of 1 MiB: RDMA Writes into a registered region (its
address and R_Key go to the peer in the private data), or Sends into
receives posted up front, one per block. A last small Send says the transfer
is done; the agent then checks every block against :func:`block` and reports.

JSON lines on stdout, flushed one by one: ``{"up": port}``, ``{"connected":
true}``, ``{"did": command, "t": time.monotonic()}`` for a fault done on
command (``t`` taken just before), ``{"lost": why}`` when the connection
broke, ``{"result": {...}}``.
Commands on stdin, one a line: ``reset`` (SO_LINGER 0 and close the TCP socket
under the QP, reaching into the engine's ``qp._link.sock``: private API, fine
for a fault test) and ``disconnect`` (``rdma_disconnect``). End of stdin lets
it go. Whatever happens to its connection, the agent stays until then, so the
survivor sees the fault and not the process's end.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time
import traceback
from typing import Any

import trio

from rdmashim.cm import ConnectionRequest, open_connection, open_device_for, serve
from rdmashim.verbs import Access, RecvWR, WCStatus

MiB = 1 << 20
BLOCKS = 64
DONE = 1 << 20
"""wr_id of the receive the last, small Send lands in."""
PRIVATE = struct.Struct("!QI")
"""(address, R_Key) of the agent's region, in the accept's private data."""


def block(i: int) -> bytes:
    """Block ``i`` of the transfer: its number repeated to 1 MiB."""
    return struct.pack("!I", i) * (MiB // 4)


def emit(**message: Any) -> None:
    print(json.dumps(message, separators=(",", ":")), flush=True)


def reset(qp: Any) -> None:
    """Abort the TCP connection under ``qp``: SO_LINGER 0, then close (a RST goes out)."""
    sock = qp._link.sock
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def commands(stream: Any, send: trio.MemorySendChannel[str]) -> None:
    buffer = b""
    async with send:
        while chunk := await stream.receive_some(4096):
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                await send.send(line.decode())


class Receiver:
    """The agent's side of the transfer: the region, the receives, the check."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.region = bytearray(BLOCKS * MiB)
        self.tail = bytearray(64)

    def register(self, pd: Any) -> bytes:
        """Register the buffers on ``pd``; the private data that offers the region."""
        self.mr = pd.reg_mr(self.region, Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.tail_mr = pd.reg_mr(self.tail, Access.LOCAL_WRITE)
        return PRIVATE.pack(self.mr.addr, self.mr.rkey)

    def post(self, qp: Any) -> None:
        """Post the receives (before connecting: the peer may send at once)."""
        if self.op == "send":
            qp.post_recv([RecvWR(i, [self.mr.sge(i * MiB, MiB)]) for i in range(BLOCKS)])
        qp.post_recv(RecvWR(DONE, [self.tail_mr.sge()]))

    async def run(self, conn: Any, orders: trio.MemoryReceiveChannel[str]) -> None:
        """Take the transfer and check it, obeying fault orders; then wait to be let go."""
        emit(connected=True)
        async with trio.open_nursery() as nursery:

            async def obey() -> None:
                async for order in orders:
                    now = time.monotonic()
                    if order == "reset":
                        reset(conn.qp)
                    elif order == "disconnect":
                        conn.id.disconnect()
                    emit(did=order, t=now)

            nursery.start_soon(obey)
            while True:
                (wc,) = await conn.recv_cq.poll_wait(1)
                if wc.status != WCStatus.SUCCESS:
                    emit(lost=f"{wc.status.name} on receive {wc.wr_id}")
                    break
                if wc.wr_id == DONE:
                    view = memoryview(self.region)
                    good = sum(view[i * MiB : (i + 1) * MiB] == block(i) for i in range(BLOCKS))
                    emit(result={"blocks_ok": good, "intact": good == BLOCKS})
                    break
            await trio.sleep_forever()  # until the test lets us go


async def agent(op: str, port: int) -> None:
    """Serve one connection (``port`` 0), or connect to ``port``; receive; obey stdin."""
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    send, orders = trio.open_memory_channel[str](8)
    receiver = Receiver(op)

    async def handler(request: ConnectionRequest) -> None:
        private = receiver.register(request.pd)
        receiver.post(request.qp)
        await receiver.run(await request.accept(private_data=private), orders)

    async def connect() -> None:
        async with open_device_for("127.0.0.1") as ctx:
            pd = ctx.alloc_pd()
            private = receiver.register(pd)
            async with open_connection(
                "127.0.0.1", port, pd=pd, private_data=private,
                prepare=lambda conn: receiver.post(conn.qp),
            ) as conn:  # fmt: skip
                await receiver.run(conn, orders)

    async with trio.open_nursery() as nursery:
        if port:
            nursery.start_soon(connect)
        else:
            _, listening = await nursery.start(
                lambda task_status: serve(handler, 0, host="127.0.0.1", task_status=task_status)
            )
            emit(up=listening)
        await commands(stdin, send)
        nursery.cancel_scope.cancel()  # end of stdin: the test lets us go


def main() -> None:
    try:
        trio.run(agent, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    except BaseException:
        emit(crashed=traceback.format_exc())
        sys.stdin.read()  # stay until the test lets us go


if __name__ == "__main__":
    main()
