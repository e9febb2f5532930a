"""Soak: mounts made and dropped against one NFS server leave memory flat.

Each cycle mounts the export with our client (rpcbind, MOUNT, then NFS over
RPC-over-RDMA or TCP, alternating), makes a GETATTR and a small READ, and
unmounts. Server and clients run in this process, as in ``tests/test_soak.py``,
so the figure covers both ends: the resident size after a garbage collection
and ``malloc_trim`` is read once after a warm-up and once at the end, and no
engine of a closed connection may still be alive.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import trio
from test_nfs_client import client
from test_nfs_server import nfs_server
from test_soak import MAX_GROWTH_PER_CONNECTION, live_engines

from rdmashim.ulps.nfsrdma.client import Proto
from rdmashim.ulps.nfsrdma.server import Serving

from residency import resident_bytes

WARM_UP = 200
TOTAL = 1200


async def one_mount(serving: Serving, proto: Proto) -> None:
    """Mount, GETATTR and READ a 4 KiB file, unmount."""
    async with client(serving, proto) as nfs:
        assert (await nfs.getattr("/f")).size == 4096
        sink = io.BytesIO()
        assert await nfs.read_file("/f", sink) == 4096


async def _settle() -> None:
    """Let the last connections' server sides finish (handlers, socket linger)."""
    for _ in range(100):
        if live_engines() == 0:
            return
        await trio.sleep(0.05)


@pytest.mark.slow
async def test_a_thousand_mounts_leave_memory_flat(tmp_path: Path) -> None:
    figures: dict[str, float] = {}
    with trio.fail_after(600):
        async with nfs_server(tmp_path) as (serving, export):
            (export / "f").write_bytes(b"soak" * 1024)
            start = time.monotonic()
            for i in range(TOTAL):
                await one_mount(serving, "rdma" if i % 2 else "tcp")
                if i + 1 == WARM_UP:
                    await _settle()
                    figures["warm"] = resident_bytes()
            seconds = time.monotonic() - start
            await _settle()
            figures["end"] = resident_bytes()
            figures["engines"] = live_engines()
    per = (figures["end"] - figures["warm"]) / (TOTAL - WARM_UP)
    print(
        f"\n{TOTAL} mounts in {seconds:.1f} s: resident {figures['warm'] / 1024:.0f} KiB after "
        f"{WARM_UP}, {figures['end'] / 1024:.0f} KiB at the end, {per:.0f} bytes per mount; "
        f"live engines {figures['engines']:.0f}"
    )
    assert per < MAX_GROWTH_PER_CONNECTION
    assert figures["engines"] == 0, "engines of closed NFS connections are still referenced"
