"""The whole NFS server end to end: rpcbind, MOUNT, and NFSv3 over TCP and RPC-over-RDMA.

One :func:`serve_nfs` on free ports over a real directory; the clients find
the ports through our rpcbind, mount with MOUNT v3, and create, write and read
a file over each transport (the RDMA WRITE data in a Read chunk, the READ
data in a Write chunk), every byte checked against the file on disk.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.mount import MNT3_OK, MOUNTPROC_MNT
from rdmashim.ulps.nfsrdma.rdma_client import RpcRdmaClient
from rdmashim.ulps.nfsrdma.rpcbind import PMAPPROC_GETPORT, RPCBIND_PROG
from rdmashim.ulps.nfsrdma.server import ServerConfig, Serving, mount_command, serve_nfs
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.tcp import connect_tcp
from rdmashim.ulps.nfsrdma.xdr import Unpacker

UID = GID = 1000
CRED = AuthSys(0, "test-client", UID, GID)
IPPROTO_TCP = 6
SIZE = 300_000  # several inline thresholds: chunks over RDMA, many fragments over TCP


@asynccontextmanager
async def nfs_server(tmp_path: Path) -> AsyncIterator[tuple[Serving, Path]]:
    export = tmp_path / "export"
    export.mkdir()
    if os.geteuid() == 0:
        os.chown(export, UID, GID)  # root squash: act as an ordinary owner
    config = ServerConfig(
        export, host="127.0.0.1", tcp_port=0, rdma_port=0, rpcbind_port=0,
        state_dir=tmp_path / "state",
    )  # fmt: skip
    async with trio.open_nursery() as nursery:
        serving = await nursery.start(serve_nfs, config)
        yield serving, export
        nursery.cancel_scope.cancel()


def args(*items: Callable[[Reply], None]) -> Reply:
    reply = Reply()
    for item in items:
        item(reply)
    return reply


async def getport(serving: Serving, prog: int, vers: int) -> int:
    assert serving.rpcbind_port is not None
    async with connect_tcp("127.0.0.1", serving.rpcbind_port) as rpcbind:

        def query(r: Reply) -> None:
            for value in (prog, vers, IPPROTO_TCP, 0):
                r.packer.uint(value)

        return (await rpcbind.call(RPCBIND_PROG, 2, PMAPPROC_GETPORT, args(query))).uint()


async def mount(port: int, export: str) -> bytes:
    async with connect_tcp("127.0.0.1", port, cred=CRED) as client:
        u = await client.call(
            t.MOUNT_PROGRAM, 3, MOUNTPROC_MNT, args(lambda r: r.packer.string(export))
        )
        assert u.uint() == MNT3_OK
        return t.unpack_fh(u)


async def exercise(call: Callable[..., Any], root: bytes, name: str, export: Path) -> None:
    """CREATE, WRITE (FILE_SYNC), READ back and GETATTR one file through ``call``."""
    status = await call(
        t.CREATE,
        args(
            lambda r: t.pack_diropargs(r.packer, root, name),
            lambda r: r.packer.uint(t.GUARDED),
            lambda r: t.pack_sattr3(r.packer, t.Sattr3(mode=0o644)),
        ),
    )
    assert status.uint() == t.NFS3_OK
    fh = t.unpack_post_op_fh3(status)
    assert fh is not None
    data = os.urandom(SIZE)

    def write_args(r: Reply) -> None:
        t.pack_fh(r.packer, fh)
        r.packer.uhyper(0)
        r.packer.uint(SIZE)
        r.packer.uint(t.FILE_SYNC)
        r.opaque_ddp(data)  # DDP-eligible: a Read chunk over RDMA

    u = await call(t.WRITE, args(write_args))
    assert u.uint() == t.NFS3_OK
    t.unpack_wcc_data(u)
    assert u.uint() == SIZE and u.uint() == t.FILE_SYNC
    assert (export / name).read_bytes() == data  # stable: on disk before the reply

    def read_args(r: Reply) -> None:
        t.pack_fh(r.packer, fh)
        r.packer.uhyper(0)
        r.packer.uint(SIZE)

    u = await call(t.READ, args(read_args), ddp_reply_size=SIZE)
    assert u.uint() == t.NFS3_OK
    t.unpack_post_op_attr(u)
    assert u.uint() == SIZE and u.boolean()  # count, eof
    assert u.opaque() == data

    u = await call(t.GETATTR, args(lambda r: t.pack_fh(r.packer, fh)))
    assert u.uint() == t.NFS3_OK and t.unpack_fattr3(u).size == SIZE


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
async def test_mount_then_write_and_read_a_file(tmp_path: Path, transport: str) -> None:
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, export):
            assert serving.tcp_port and serving.rdma_port and serving.rpcbind_port
            mount_port = await getport(serving, t.MOUNT_PROGRAM, 3)
            assert mount_port == serving.tcp_port
            assert await getport(serving, t.NFS_PROGRAM, 3) == serving.tcp_port
            root = await mount(mount_port, serving.export)
            connect: AbstractAsyncContextManager[Any] = (
                connect_tcp("127.0.0.1", serving.tcp_port, cred=CRED)
                if transport == "tcp"
                else RpcRdmaClient.connect("127.0.0.1", serving.rdma_port)
            )
            async with connect as client:

                async def call(proc: int, a: Reply, *, ddp_reply_size: int = 0) -> Unpacker:
                    if transport == "tcp":
                        return await client.call(t.NFS_PROGRAM, 3, proc, a)
                    return await client.call(
                        t.NFS_PROGRAM, 3, proc, a, CRED, ddp_reply_size=ddp_reply_size
                    )

                await exercise(call, root, f"file-{transport}", export)


async def test_the_mount_command_names_the_rdma_port(tmp_path: Path) -> None:
    async with nfs_server(tmp_path) as (serving, _):
        command = mount_command("server", serving)
        assert command == (
            f"mount -t nfs -o vers=3,proto=rdma,port={serving.rdma_port} "
            f"server:{serving.export} /mnt"
        )


async def test_a_taken_rpcbind_port_means_registering_with_the_rpcbind_there(
    tmp_path: Path,
) -> None:
    """The first server owns rpcbind; a second one (its port taken) registers there."""
    first = tmp_path / "first"
    first.mkdir()
    async with nfs_server(first) as (owner, _):
        second = tmp_path / "second"
        (second / "export").mkdir(parents=True)
        config = ServerConfig(
            second / "export", host="127.0.0.1", tcp_port=0, rdma_port=None,
            rpcbind_port=owner.rpcbind_port, state_dir=second / "state",
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            serving = await nursery.start(partial(serve_nfs, config))
            assert serving.rpcbind_port is None  # it did not serve one
            # the rpcbind there now sends NFS and MOUNT clients to the second server (a
            # server registering replaces what was registered before, as a restart must)
            assert await getport(owner, t.NFS_PROGRAM, 3) == serving.tcp_port != owner.tcp_port
            assert await getport(owner, t.MOUNT_PROGRAM, 3) == serving.tcp_port
            nursery.cancel_scope.cancel()
