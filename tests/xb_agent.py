"""One side of a cross-backend connection: Send, RDMA Write and RDMA Read, both ways.

Used by ``tests/test_cross_backend.py`` on both machines: imported by the
host's test (the built-in engine, in the test bed's namespace) and run as a script
in the guest (``RDMASHIM_BACKEND=rdmacore``, the kernel's siw)::

    python3 xb_agent.py serve PORT [--ready FILE]   # answer one connection
    python3 xb_agent.py connect HOST PORT

Each side registers a region of ``2 * SIZE`` bytes: the first half for the
peer to write into, the second holding its own pattern for the peer to read.
The client speaks first, as MPA wants of the initiator (a Send with its
region's address, R_Key and backend), after ``first_after`` seconds: the
kernel's siw as responder can lose track of an FPDU that arrives right after
its MPA Reply (the accept race in ``docs/interop.md``). The server answers the
same way, then each side RDMA-writes its pattern into the peer's first half,
RDMA-reads the peer's second half, and sends ``done``. A side checks both
halves once the peer's ``done`` arrived (RDMAP orders the peer's Write before
its Send) and prints one JSON line: what it saw and whether the bytes are right.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import trio

from rdmashim import Access, RecvWR, SendWR, WCOpcode, WROpcode
from rdmashim.cm import ConnectionRequest, open_connection, serve
from rdmashim.registry import chosen_backend

SIZE = 1 << 20
"""Bytes each side writes and reads: many FPDUs, many TCP segments."""
INFO = struct.Struct("!QII16s")
"""A side's first Send: region iova, R_Key, SIZE, its backend's name."""
RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
LIMIT = 60.0
"""Seconds any one step may take (TCG guests are slow)."""


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes that differ per seed (and per position)."""
    return bytes((i * 7 + seed) & 0xFF for i in range(251)) * (n // 251) + bytes(n % 251)


class Side:
    """A connected side's buffers and its half of the exchange."""

    def __init__(self, pd: Any, qp: Any, cq: Any, seed: int) -> None:
        self.qp, self.cq, self.seed = qp, cq, seed
        self.msgs = pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
        self.region = pd.reg_mr(bytearray(2 * SIZE), RW)
        self.region.buf[SIZE:] = pattern(SIZE, seed + 100)
        self.out = pd.reg_mr(pattern(SIZE, seed), Access(0))
        self.back = pd.reg_mr(bytearray(SIZE), Access.LOCAL_WRITE)
        self.received: list[bytes] = []
        self.pending: list[Any] = []
        # Receives first: the peer may send as soon as the connection is up.
        qp.post_recv([RecvWR(i, [self.msgs.sge(64 * i, 64)]) for i in range(2)])

    async def completion(self, wr_id: int) -> Any:
        """Wait for the completion of ``wr_id`` (others seen meanwhile are kept)."""
        with trio.fail_after(LIMIT):
            while True:
                for wc in self.pending:
                    if wc.wr_id == wr_id:
                        self.pending.remove(wc)
                        return wc.raise_for_status()
                self.pending += await self.cq.poll_wait(16)

    async def receive(self, slot: int) -> bytes:
        wc = await self.completion(slot)
        assert wc.opcode == WCOpcode.RECV
        return bytes(self.msgs.buf[64 * slot : 64 * slot + wc.byte_len])

    def send(self, wr_id: int, data: bytes) -> None:
        self.msgs.buf[128 : 128 + len(data)] = data
        self.qp.post_send(SendWR(wr_id, WROpcode.SEND, [self.msgs.sge(128, len(data))]))

    def info(self) -> bytes:
        return INFO.pack(self.region.iova, self.region.rkey, SIZE, chosen_backend().encode())

    async def exchange(self, theirs: bytes) -> dict[str, Any]:
        """Write into and read from the peer's region, say done, check what it did here."""
        addr, rkey, size, backend = INFO.unpack(theirs)
        self.qp.post_send(
            [
                SendWR(21, WROpcode.RDMA_WRITE, [self.out.sge()], remote_addr=addr, rkey=rkey),
                SendWR(
                    22, WROpcode.RDMA_READ, [self.back.sge()], remote_addr=addr + size, rkey=rkey
                ),
            ]
        )
        for wr_id in (21, 22):
            await self.completion(wr_id)
        read_ok = bytes(self.back.buf) == pattern(SIZE, 100 + (3 - self.seed))
        self.send(23, b"done")
        await self.completion(23)
        done = await self.receive(1)
        written_ok = bytes(self.region.buf[:SIZE]) == pattern(SIZE, 3 - self.seed)
        return {
            "backend": chosen_backend(),
            "peer backend": backend.rstrip(b"\0").decode(),
            "peer done": done.decode(errors="replace"),
            "read ok": read_ok,
            "written ok": written_ok,
        }


async def serve_once(port: int, ready: Path | None = None) -> dict[str, Any]:
    """Answer one connection on ``port`` (all addresses) and run the server's half."""
    result: dict[str, Any] = {}
    finished = trio.Event()

    async def handler(request: ConnectionRequest) -> None:
        side = Side(request.pd, request.qp, request.recv_cq, seed=1)
        conn = await request.accept(private_data=b"xb server " + chosen_backend().encode())
        result["private data"] = request.private_data.decode(errors="replace")
        result["device"] = conn.context.device.name
        theirs = await side.receive(0)  # the initiator speaks first
        side.send(10, side.info())
        await side.completion(10)
        result.update(await side.exchange(theirs))
        finished.set()
        await conn.wait_disconnected()

    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve(handler, port, task_status=task_status))
        if ready is not None:
            await trio.Path(ready).touch()
        with trio.fail_after(3 * LIMIT):
            await finished.wait()
        nursery.cancel_scope.cancel()
    return {"role": "server", **result}


async def connect_once(host: str, port: int, first_after: float = 0.0) -> dict[str, Any]:
    """Connect to ``host``:``port`` and run the client's half, speaking first after
    ``first_after`` seconds."""
    holder: list[Side] = []
    with trio.fail_after(3 * LIMIT):
        async with open_connection(
            host, port, private_data=b"xb client " + chosen_backend().encode(),
            prepare=lambda conn: holder.append(Side(conn.pd, conn.qp, conn.recv_cq, seed=2)),
        ) as conn:  # fmt: skip
            side = holder[0]
            result = {
                "role": "client",
                "private data": conn.private_data.decode(errors="replace"),
                "device": conn.context.device.name,
            }
            await trio.sleep(first_after)
            side.send(10, side.info())
            await side.completion(10)
            result.update(await side.exchange(await side.receive(0)))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    s.add_argument("--ready", type=Path, help="touch this file once listening")
    c = sub.add_parser("connect")
    c.add_argument("host")
    c.add_argument("port", type=int)
    c.add_argument("--first-after", type=float, default=0.0, help="seconds before speaking")
    args = p.parse_args(argv)
    if args.role == "serve":
        result = trio.run(serve_once, args.port, args.ready)
    else:
        result = trio.run(connect_once, args.host, args.port, args.first_after)
    print(json.dumps(result), flush=True)
    return 0 if result.get("read ok") and result.get("written ok") else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
