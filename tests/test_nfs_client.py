"""The NFS client library against our server, in-process, over TCP and RPC-over-RDMA.

One :func:`serve_nfs` on free ports over a real directory; the client finds
the ports through the server's rpcbind, mounts, and puts then gets an 8 MiB
file (many rtmax/wtmax pieces, several in flight), lists, stats, makes,
renames and removes; every byte and attribute is checked against the directory
on disk.
"""

from __future__ import annotations

import io
import os
import re
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
from test_nfs_server import CRED, nfs_server

from rdmashim.ulps.nfsrdma import client as client_module
from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client import (
    NfsClient,
    NfsError,
    Proto,
    list_exports,
    split_remote,
)
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.mount import MountProgram
from rdmashim.ulps.nfsrdma.nfs3 import Nfs3Program
from rdmashim.ulps.nfsrdma.rpc import RpcServer
from rdmashim.ulps.nfsrdma.server import Serving
from rdmashim.ulps.nfsrdma.tcp import serve_tcp

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

SIZE = 8 << 20
TRANSPORTS = ["tcp", "rdma"]


def client(serving: Serving, proto: Proto) -> AbstractAsyncContextManager[NfsClient]:
    assert serving.rpcbind_port is not None
    return NfsClient.connect(
        "127.0.0.1", serving.export, proto=proto, rpcbind_port=serving.rpcbind_port, cred=CRED
    )


@pytest.mark.parametrize("proto", TRANSPORTS)
async def test_put_then_get_a_file_byte_exact(tmp_path: Path, proto: Proto) -> None:
    data = os.urandom(SIZE)
    with trio.fail_after(120):
        async with nfs_server(tmp_path) as (serving, export), client(serving, proto) as nfs:
            seen: list[tuple[int, int]] = []
            put = await nfs.write_file(
                "/big", io.BytesIO(data), SIZE, progress=lambda d, n: seen.append((d, n))
            )
            assert put == SIZE
            assert seen[0] == (0, SIZE) and seen[-1] == (SIZE, SIZE)
            assert len(seen) > SIZE // nfs.wtmax  # a call per piece
            assert (export / "big").read_bytes() == data
            got: list[tuple[int, int]] = []
            sink = io.BytesIO()
            assert (
                await nfs.read_file("/big", sink, progress=lambda d, n: got.append((d, n))) == SIZE
            )
            assert sink.getvalue() == data
            assert got[-1] == (SIZE, SIZE) and all(n == SIZE for _, n in got)


class CountingSource(io.BytesIO):
    """A source that notes the buffers write_file reads into."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.buffers: list[object] = []

    def read(self, size: int | None = -1) -> bytes:
        raise AssertionError("write_file read a source that has readinto with read")

    def readinto(self, buffer: WriteableBuffer) -> int:
        self.buffers.append(memoryview(buffer).obj)
        return super().readinto(buffer)


async def test_a_source_whose_readinto_is_no_method_is_read_with_read(tmp_path: Path) -> None:
    class Odd(io.BytesIO):
        readinto = 5  # type: ignore[assignment]

    data = os.urandom(SIZE // 4)
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, export), client(serving, "tcp") as nfs:
            assert await nfs.write_file("/odd", Odd(data), len(data)) == len(data)
            assert (export / "odd").read_bytes() == data


@pytest.mark.parametrize("proto", TRANSPORTS)
async def test_a_source_is_read_into_buffers_reused_from_one_commit_to_the_next(
    tmp_path: Path, proto: Proto, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each COMMIT's batch reads into the buffers of the batch before (none is reused
    while a call or a COMMIT may still send it again: the file is byte exact)."""
    data = os.urandom(SIZE)
    with trio.fail_after(120):
        async with nfs_server(tmp_path) as (serving, export), client(serving, proto) as nfs:
            monkeypatch.setattr(client_module, "COMMIT_EVERY", 2 * nfs.wtmax)
            source = CountingSource(data)
            assert await nfs.write_file("/reused", source, SIZE) == SIZE
            assert (export / "reused").read_bytes() == data
            pieces = -(-SIZE // nfs.wtmax)
            assert len(source.buffers) == pieces
            assert len({id(b) for b in source.buffers}) == 2  # one a piece of a batch


@pytest.mark.parametrize("proto", TRANSPORTS)
async def test_ls_stat_mkdir_rm(tmp_path: Path, proto: Proto) -> None:
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, export), client(serving, proto) as nfs:
            await nfs.mkdir("/sub", 0o750)
            assert (export / "sub").is_dir()
            names = [f"file-{i:03}" for i in range(200)]  # more than one READDIRPLUS reply
            for name in names:
                (export / "sub" / name).write_bytes(name.encode())
            listing = await nfs.listdir("/sub")
            assert sorted(n for n, _ in listing) == names
            assert all(a.size == len(n) and a.ftype == t.NF3REG for n, a in listing)
            attrs = await nfs.getattr("/sub")
            assert attrs.ftype == t.NF3DIR and attrs.mode == 0o750
            assert attrs.fileid == (export / "sub").stat().st_ino
            assert (await nfs.getattr("sub/file-007")).size == 8
            await nfs.remove("/sub/file-007")
            assert not (export / "sub" / "file-007").exists()
            await nfs.rename("/sub/file-008", "/eight")
            assert (export / "eight").read_bytes() == b"file-008"
            assert not (export / "sub" / "file-008").exists()
            with pytest.raises(NfsError) as caught:
                await nfs.rmdir("/sub")
            assert caught.value.status == t.NFS3ERR_NOTEMPTY
            for name in names:
                if name not in ("file-007", "file-008"):
                    await nfs.remove(f"/sub/{name}")
            await nfs.rmdir("/sub")
            assert not (export / "sub").exists()


@pytest.mark.parametrize("proto", TRANSPORTS)
async def test_a_missing_path_is_noent(tmp_path: Path, proto: Proto) -> None:
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, _), client(serving, proto) as nfs:
            for attempt in (nfs.getattr, nfs.listdir, nfs.remove):
                with pytest.raises(NfsError) as caught:
                    await attempt("/no/such")
                assert caught.value.status == t.NFS3ERR_NOENT
                assert str(caught.value) == "NFS3ERR_NOENT: no such file or directory: /no"
            with pytest.raises(NfsError, match=r"^NFS3ERR_NOENT: no such file or directory: /nil$"):
                await nfs.read_file("/nil", io.BytesIO())


async def test_bad_arguments_are_refused_by_name_before_the_server_sees_them(
    tmp_path: Path,
) -> None:
    """Each raised a raw error before (struct.error, AttributeError, an ExceptionGroup),
    or, for a negative size, truncated the file and returned 0."""
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, export), client(serving, "tcp") as nfs:
            (export / "keep").write_bytes(b"kept")
            data = io.BytesIO(b"abc")
            refused = [
                (nfs.listdir, (5,), TypeError, "an NFS path is a str, not int"),
                (nfs.getattr, (b"/keep",), TypeError, "an NFS path is a str, not bytes"),
                (nfs.remove, ("/ke\0ep",), ValueError, "NFS path '/ke\\x00ep' holds a NUL"),
                (nfs.rename, ("/keep", None), TypeError, "not NoneType"),
                (nfs.mkdir, ("/d", -1), ValueError, "mode -0o1 outside 0o0..0o7777"),
                (nfs.mkdir, ("/d", 0o40755), ValueError, "mode 0o40755 outside"),
                (nfs.mkdir, ("/d", "755"), TypeError, "mode must be an integer, not str"),
                (nfs.write_file, ("/keep", data, -1), ValueError, "size -1 outside 0.."),
                (nfs.write_file, ("/keep", data, 1.5), TypeError, "size must be an integer"),
                (nfs.write_file, ("/keep", data, True), TypeError, "not bool"),
                (nfs.write_file, ("/keep", 5, 3), TypeError, "the source must have a read"),
                (nfs.write_file, ("/keep", data, 3, 5), TypeError, "progress must be callable"),
                (nfs.read_file, ("/keep", "sink"), TypeError, "the sink must have a write"),
            ]
            for call, args, kind, text in refused:
                with pytest.raises(kind, match=re.escape(text)):
                    await call(*args)
            assert (export / "keep").read_bytes() == b"kept"
            assert not (export / "d").exists()
            # A source that misbehaves mid-transfer: the error itself, not a group.
            with pytest.raises(TypeError, match=r"source\.read gave str, not bytes"):
                await nfs.write_file("/s", io.StringIO("abc"), 3)  # type: ignore[arg-type]
            with pytest.raises(EOFError, match="the source ended at 3 of 10 bytes"):
                await nfs.write_file("/s", io.BytesIO(b"abc"), 10)
            for said, error, text in [
                (None, TypeError, "source.readinto gave NoneType, not a count"),
                (4, ValueError, "source.readinto of 3 bytes said it read 4"),
            ]:
                lying = io.BytesIO(b"abc")
                lying.readinto = lambda _, said=said: said  # type: ignore[method-assign]
                with pytest.raises(error, match=re.escape(text)):
                    await nfs.write_file("/s", lying, 3)
            with pytest.raises(NfsError, match="NFS3ERR_ISDIR"):  # a piece's error, unwrapped
                await nfs.read_file("/", io.BytesIO())
            assert sorted(n for n, _ in await nfs.listdir("/")) == ["keep", "s"]
        bad_connects = [
            ({"export": 5}, TypeError, "the export is a str, not int"),
            ({"proto": "udp"}, ValueError, "proto 'udp' is neither 'rdma' nor 'tcp'"),
            ({"port": 70000}, ValueError, "port 70000 outside 1..65535"),
            ({"mount_port": 0}, ValueError, "mount_port 0 outside 1..65535"),
            ({"rpcbind_port": "111"}, TypeError, "rpcbind_port must be an integer, not str"),
        ]
        for change, kind, text in bad_connects:
            kwargs: dict[str, object] = {"export": str(export), "proto": "tcp", **change}
            with pytest.raises(kind, match=re.escape(text)):
                async with NfsClient.connect("127.0.0.1", **kwargs):  # type: ignore[arg-type]
                    pass


async def test_the_longest_export_that_prefixes_a_path_holds_it(tmp_path: Path) -> None:
    async with nfs_server(tmp_path) as (serving, export):
        assert serving.rpcbind_port is not None
        exports = await list_exports("127.0.0.1", rpcbind_port=serving.rpcbind_port)
        assert exports == [str(export)]
    assert split_remote(["/a", "/a/b", "/c"], "/a/b/c/d") == ("/a/b", "/c/d")
    assert split_remote(["/a", "/a/b"], "/a/bc") == ("/a", "/bc")
    assert split_remote(["/a"], "/a") == ("/a", "/")
    with pytest.raises(OSError, match="in no export"):
        split_remote(["/a"], "/b/c")


async def test_a_changed_write_verifier_means_writing_again(tmp_path: Path) -> None:
    """The server "restarts" (new verifier, unstable data lost) before COMMIT: all is rewritten."""
    root = tmp_path / "export"
    root.mkdir()
    if os.geteuid() == 0:
        os.chown(root, 1000, 1000)
    export = Export(root, state_dir=tmp_path / "state")
    program = Nfs3Program(export)
    server = RpcServer([program, MountProgram(export)])
    data = os.urandom(3 << 20)

    def lose_everything(done: int, total: int) -> None:
        if done == total:  # every WRITE answered, COMMIT next
            program.state.write_verifier = bytes(8)
            os.truncate(root / "f", 0)

    try:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve_tcp, server, 0, "127.0.0.1")
            port = listeners[0].socket.getsockname()[1]
            async with NfsClient.connect(
                "127.0.0.1", export.name, proto="tcp", port=port, mount_port=port, cred=CRED
            ) as nfs:
                await nfs.write_file("/f", io.BytesIO(data), len(data), lose_everything)
            assert (root / "f").read_bytes() == data
            nursery.cancel_scope.cancel()
    finally:
        export.close()


async def test_a_file_that_shrinks_while_read_ends_the_copy_short(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with nfs_server(tmp_path) as (serving, export), client(serving, "tcp") as nfs:
            (export / "f").write_bytes(bytes(2 * SIZE))  # 16 pieces
            copy = bytearray()

            class Shrinking:
                def write(self, data: bytes) -> None:
                    if not copy:
                        os.truncate(export / "f", 0)  # later pieces find nothing
                    copy.extend(data)

            count = await nfs.read_file("/f", Shrinking())
            assert count == len(copy) < 2 * SIZE


@pytest.mark.parametrize("proto", TRANSPORTS)
async def test_an_nfs_error_leaves_the_client_block_as_itself(tmp_path: Path, proto: Proto) -> None:
    """``except NfsError:`` around the whole ``async with NfsClient.connect(...)`` block
    catches a failing LOOKUP, GETATTR, READ and WRITE, the last two of a transfer in
    many pieces whose later pieces fail (the file is deleted under it: NFS3ERR_STALE).
    Over RDMA each came out as an ExceptionGroup holding the NfsError before."""
    with trio.fail_after(120):
        async with nfs_server(tmp_path) as (serving, export):
            victim = export / "f"

            class DeletingSink:
                def write(self, data: memoryview) -> None:
                    victim.unlink(missing_ok=True)

            class DeletingSource(io.BytesIO):  # (write_file reads it with readinto)
                def readinto(self, buffer: WriteableBuffer) -> int:
                    if self.tell():
                        victim.unlink(missing_ok=True)
                    return super().readinto(buffer)

            failing = [
                (lambda nfs: nfs.lookup("/no/such"), t.NFS3ERR_NOENT),
                (lambda nfs: nfs.getattr("/missing"), t.NFS3ERR_NOENT),
                (lambda nfs: nfs.read_file("/f", DeletingSink()), t.NFS3ERR_STALE),
                (lambda nfs: nfs.write_file("/f", DeletingSource(bytes(SIZE)), SIZE),
                 t.NFS3ERR_STALE),
            ]  # fmt: skip
            for attempt, status in failing:
                victim.write_bytes(bytes(SIZE))
                if os.geteuid() == 0:
                    os.chown(victim, 1000, 1000)
                try:
                    async with client(serving, proto) as nfs:
                        await attempt(nfs)
                except NfsError as exc:
                    assert exc.status == status, exc
                else:
                    raise AssertionError(f"{attempt} did not fail")


@pytest.mark.parametrize("proto", TRANSPORTS)
async def test_read_bytes_and_write_bytes_move_whole_files(tmp_path: Path, proto: Proto) -> None:
    data = os.urandom(3 << 20)  # several pieces each way
    with trio.fail_after(120):
        async with nfs_server(tmp_path) as (serving, export), client(serving, proto) as nfs:
            seen: list[tuple[int, int]] = []
            written = await nfs.write_bytes("/w", data, lambda d, n: seen.append((d, n)))
            assert written == len(data) and seen[-1] == (len(data), len(data))
            assert (export / "w").read_bytes() == data
            assert (export / "w").stat().st_mode & 0o777 == 0o644
            assert await nfs.write_bytes("/v", memoryview(data).cast("I"), mode=0o600) == len(data)
            assert (export / "v").stat().st_mode & 0o777 == 0o600
            assert await nfs.read_bytes("/v") == data
            assert await nfs.write_bytes("/empty", b"") == 0
            assert await nfs.read_bytes("/empty") == b""
            with pytest.raises(TypeError, match="data must be bytes-like, not str"):
                await nfs.write_bytes("/s", "text")  # type: ignore[arg-type]
            with pytest.raises(NfsError, match="NFS3ERR_NOENT"):
                await nfs.read_bytes("/missing")
            assert not (export / "s").exists()
