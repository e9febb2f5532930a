"""The NFS client's errors say what is wrong and, where they can, what to do.

Each case failed with a bare status or a socket error before: a root caller
refused got "permission denied" alone (nothing about root squash); NOTDIR named
the path asked for, not the object that is no directory; an unreachable
rpcbind, MOUNT or NFS port was "all attempts to connect to HOST:PORT failed"
or "no MOUNT v3 port: rpcbind ... is not there or names none" whatever the
cause; MOUNT's NOENT and ACCES were a bare status.
"""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import pytest
import trio
from test_nfs_server import CRED, nfs_server

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client import MountError, NfsClient, NfsError, ServerUnreachable
from rdmashim.ulps.nfsrdma.client_errors import ROOT_SQUASH_HINT
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.mount import MountProgram
from rdmashim.ulps.nfsrdma.rpc import RpcServer
from rdmashim.ulps.nfsrdma.rpcbind import Registry, Rpcbind
from rdmashim.ulps.nfsrdma.server import Serving
from rdmashim.ulps.nfsrdma.service import AuthSys
from rdmashim.ulps.nfsrdma.tcp import serve_tcp

ROOT = AuthSys(0, "test-client", 0, 0)


def closed_port() -> int:
    """A port nothing listens on (bound and let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connect(serving: Serving, **kwargs: object) -> AbstractAsyncContextManager[NfsClient]:
    assert serving.rpcbind_port is not None
    options: dict[str, object] = {"proto": "tcp", "rpcbind_port": serving.rpcbind_port,
                                  "cred": CRED, **kwargs}  # fmt: skip
    return NfsClient.connect("127.0.0.1", serving.export, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("proto", ["tcp", "rdma"])
async def test_a_refused_root_is_told_about_root_squash(tmp_path: Path, proto: str) -> None:
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, export):
            (export / "locked").mkdir(mode=0o500)  # nobody (squashed root) may not write
            async with connect(serving, proto=proto, cred=ROOT) as nfs:
                with pytest.raises(NfsError) as caught:
                    await nfs.write_bytes("/locked/f", b"x")
                assert caught.value.status == t.NFS3ERR_ACCES
                assert caught.value.hint == ROOT_SQUASH_HINT
                assert str(caught.value) == (
                    f"NFS3ERR_ACCES: permission denied: /locked/f ({ROOT_SQUASH_HINT})"
                )
                assert "--no-root-squash" in ROOT_SQUASH_HINT
            async with connect(serving, proto=proto) as nfs:  # uid 1000: no such hint
                with pytest.raises(
                    NfsError, match=r"^NFS3ERR_ACCES: permission denied: /locked/f$"
                ):
                    await nfs.write_bytes("/locked/f", b"x")


async def test_notdir_names_the_object_that_is_no_directory(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, _), connect(serving) as nfs:
            await nfs.write_bytes("/file", b"x")
            attempts = [
                nfs.lookup("/file/x/y"), nfs.getattr("/file/x"), nfs.mkdir("/file/sub"),
                nfs.write_bytes("/file/new", b"y"), nfs.remove("/file/x"), nfs.listdir("/file/x"),
            ]  # fmt: skip
            for attempt in attempts:
                with pytest.raises(NfsError) as caught:
                    await attempt
                assert caught.value.status == t.NFS3ERR_NOTDIR
                assert (caught.value.path, str(caught.value)) == (
                    "/file", "NFS3ERR_NOTDIR: not a directory: /file"
                )  # fmt: skip


async def test_each_unreachable_program_is_named_with_its_port_and_why(tmp_path: Path) -> None:
    gone = closed_port()
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, _):
            cases = [
                ({"rpcbind_port": gone}, f"rpcbind at 127.0.0.1 port {gone}: connection "
                 "refused: nothing listens there (no rpcbind there? then give the MOUNT and "
                 "NFS ports)"),
                ({"mount_port": gone}, f"MOUNT at 127.0.0.1 port {gone}: connection refused: "
                 "nothing listens there (the MOUNT port given)"),
                ({"port": gone}, f"NFS over TCP at 127.0.0.1 port {gone}: connection refused: "
                 "nothing listens there (the NFS port given)"),
                ({"port": gone, "proto": "rdma"}, f"NFS over RDMA at 127.0.0.1 port {gone}: "
                 f"connect to 127.0.0.1:{gone} refused: nothing listening (the NFS port given)"),
            ]  # fmt: skip
            for change, text in cases:
                with pytest.raises(ServerUnreachable, match=f"^{re.escape(text)}$") as caught:
                    async with connect(serving, **change):
                        pass
                assert isinstance(caught.value, ConnectionError)
                assert caught.value.port == gone


@asynccontextmanager
async def mount_only(
    tmp_path: Path, clients: list[str], registry: Registry | None = None
) -> AsyncIterator[int]:
    """MOUNT (and rpcbind over ``registry``) for an export open to ``clients``: its port."""
    root = tmp_path / "export"
    root.mkdir()
    export = Export(root, state_dir=tmp_path / "state", clients=clients)
    try:
        async with trio.open_nursery() as nursery:
            server = RpcServer([MountProgram(export), Rpcbind(registry or Registry())])
            listeners = await nursery.start(serve_tcp, server, 0, "127.0.0.1")
            yield listeners[0].socket.getsockname()[1]
            nursery.cancel_scope.cancel()
    finally:
        export.close()


async def test_mount_refusals_say_why(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with mount_only(tmp_path, ["192.0.2.0/24"]) as port:
            exported = str((tmp_path / "export").resolve())
            for export, text in (
                ("/elsewhere", f"MOUNT /elsewhere: no such export or directory (it exports "
                               f"{exported})"),
                (exported, f"MOUNT {exported}: permission denied (not exported to this host)"),
            ):  # fmt: skip
                with pytest.raises(MountError, match=f"^{re.escape(text)}$"):
                    async with NfsClient.connect(
                        "127.0.0.1", export, proto="tcp", port=port, mount_port=port, cred=CRED
                    ):
                        pass
            with pytest.raises(MountError, match=(
                rf"^rpcbind at 127\.0\.0\.1 port {port} names no MOUNT v3 over TCP "
                r"\(is an NFS server running there\?\)$"
            )):  # fmt: skip
                async with NfsClient.connect("127.0.0.1", exported, proto="tcp", rpcbind_port=port):
                    pass
