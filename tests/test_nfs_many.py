"""Many clients at once against one server: half over RPC-over-RDMA, half over TCP.

Each :class:`~rdmashim.ulps.nfsrdma.client.NfsClient` mounts through the
server's rpcbind, writes a file of its own (its own size, 64 KiB to 1 MiB,
and its own random bytes), lists the export, stats its file and reads it
back, all of them at the same time on one server and one softiwarp engine:
no client begins before every one has mounted, so all the connections are
open at once. Every byte is checked, read back and on disk, and no client
may fail.
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path

import trio
from test_nfs_client import client
from test_nfs_server import nfs_server

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client import Proto
from rdmashim.ulps.nfsrdma.server import Serving

PER_TRANSPORT = 100  # about 10 s for the 200 on two cores
SMALLEST, LARGEST = 64 << 10, 1 << 20


class Gate:
    """Opens when ``count`` clients have arrived at it."""

    def __init__(self, count: int) -> None:
        self.missing = count
        self.open = trio.Event()

    async def arrive(self) -> None:
        self.missing -= 1
        if self.missing == 0:
            self.open.set()
        await self.open.wait()


async def one_client(
    serving: Serving, export: Path, gate: Gate, proto: Proto, name: str, size: int
) -> None:
    """Mount, wait for the others, write ``name``, list, stat, read it back; check all."""
    data = random.randbytes(size)
    async with client(serving, proto) as nfs:
        await gate.arrive()
        assert await nfs.write_file(f"/{name}", io.BytesIO(data), size) == size
        assert (export / name).read_bytes() == data
        listed = dict(await nfs.listdir("/"))
        assert listed[name].size == size and listed[name].ftype == t.NF3REG
        attrs = await nfs.getattr(f"/{name}")
        assert attrs.size == size and attrs.fileid == (export / name).stat().st_ino
        sink = io.BytesIO()
        assert await nfs.read_file(f"/{name}", sink) == size
        assert sink.getvalue() == data


async def test_two_hundred_clients_at_once(tmp_path: Path) -> None:
    rng = random.Random(os.urandom(8))
    jobs = [
        (proto, f"{proto}-{i:03d}", rng.randrange(SMALLEST, LARGEST + 1))
        for proto in ("rdma", "tcp")
        for i in range(PER_TRANSPORT)
    ]
    gate = Gate(len(jobs))
    with trio.fail_after(300):
        async with nfs_server(tmp_path) as (serving, export), trio.open_nursery() as nursery:
            for proto, name, size in jobs:
                nursery.start_soon(one_client, serving, export, gate, proto, name, size)
    assert sorted(os.listdir(export)) == sorted(name for _, name, _ in jobs)
    for _, name, size in jobs:
        assert (export / name).stat().st_size == size
