"""Hostile clients against the whole server, with a well-behaved client served all along.

test_nfs_export.py checks the export's confinement through ``dispatch`` and
test_nfs_rpcrdma_transport.py the transport's defences on a test program;
here the same kinds of attack go over the wire to :func:`serve_nfs` itself:
names that climb out (``..``, slashes, absolute paths) in every procedure
that takes a name, symlinks to outside used as directories by every
procedure, a symlink swapped in while the client works below it, forged and
stale handles in every procedure (and a handle whose object was moved out of
the export), huge counts and lengths, and over RDMA chunks that point at
nothing and more calls than credits.

In each test the hostile client gets its error, a well-behaved client
(:class:`Bystander`, over RDMA and over TCP) connected at the same time keeps
writing and reading its own file, and a canary directory beside the export,
world-writable so that only the export's confinement protects it, keeps
every name, byte, mode, mtime and ctime it had.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from test_nfs3 import Args
from test_nfs_client import client
from test_nfs_rpcrdma_transport import raw, words
from test_nfs_server import CRED, nfs_server

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client import Proto
from rdmashim.ulps.nfsrdma.mount import MNT3_OK, MOUNTPROC_MNT
from rdmashim.ulps.nfsrdma.rpc import CallHeader, GarbageArgs, OpaqueAuth, pack_call_header
from rdmashim.ulps.nfsrdma.rpcrdma import ErrCode, Header, ReadSegment, Segment
from rdmashim.ulps.nfsrdma.server import Serving
from rdmashim.ulps.nfsrdma.service import Reply
from rdmashim.ulps.nfsrdma.tcp import RpcTcpClient, connect_tcp

HOST = "127.0.0.1"
TIMEOUT = 60
CANARY = b"the canary sings"


# ------------------------------------------------------------------ the scene


def snapshot(top: Path) -> dict[str, tuple[int, int, int, int, bytes]]:
    """Every name under ``top`` (and ``top``): mode, size, mtime, ctime, and content."""
    seen = {}
    for path in [top, *sorted(top.rglob("*"))]:
        st = path.lstat()
        if path.is_symlink():
            content = os.readlink(path).encode()
        elif path.is_file():
            content = path.read_bytes()
        else:
            content = b""
        seen[str(path)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, content)
    return seen


@dataclass
class Scene:
    """The server, its export, the canary beside it, and a hostile NFS caller over TCP."""

    serving: Serving
    export: Path
    canary: Path
    rpc: RpcTcpClient
    root: bytes

    async def call(self, proc: int, args: Args | bytes) -> int:
        """``proc`` with ``args`` on the hostile connection: the NFS status it gets."""
        return (await self.results(proc, args)).uint()

    async def results(self, proc: int, args: Args | bytes) -> t.Unpacker:
        reply = Reply()
        reply.packer.data += args if isinstance(args, bytes) else args.bytes()
        return await self.rpc.call(t.NFS_PROGRAM, 3, proc, reply)

    async def lookup(self, fh: bytes, name: str) -> bytes:
        u = await self.results(t.LOOKUP, Args().dirop(fh, name))
        assert u.uint() == t.NFS3_OK
        return t.unpack_fh(u)

    async def made(self, proc: int, args: Args) -> bytes:
        u = await self.results(proc, args)
        assert u.uint() == t.NFS3_OK
        fh = t.unpack_post_op_fh3(u)
        assert fh is not None
        return fh


class Bystander:
    """A well-behaved client writing and reading back its own file until told to stop."""

    def __init__(self, serving: Serving, export: Path, proto: Proto) -> None:
        self.serving, self.export, self.proto = serving, export, proto
        self.rounds = 0
        self.ready = trio.Event()  # a first round done: connected before the hostile one
        self.stop = trio.Event()

    async def run(self) -> None:
        name = f"bystander-{self.proto}"
        async with client(self.serving, self.proto) as nfs:
            while True:
                last = self.stop.is_set()  # a whole round after the hostile client is done
                data = os.urandom(1000 + self.rounds * 517 % 70_000)
                assert await nfs.write_file(f"/{name}", io.BytesIO(data), len(data)) == len(data)
                sink = io.BytesIO()
                assert await nfs.read_file(f"/{name}", sink) == len(data)
                assert sink.getvalue() == data
                assert (self.export / name).read_bytes() == data
                self.rounds += 1
                self.ready.set()
                if last:
                    return
                await trio.sleep(0.01)


@asynccontextmanager
async def scene(tmp_path: Path) -> AsyncIterator[Scene]:
    """The server with a canary beside its export and bystanders over both transports.

    On leaving, every bystander must have been served throughout and the
    canary must be as it was.
    """
    canary = tmp_path / "canary"
    (canary / "nest").mkdir(parents=True, mode=0o777)
    (canary / "song").write_bytes(CANARY)
    (canary / "nest" / "egg").write_bytes(CANARY)
    for path in (canary, canary / "nest", canary / "song", canary / "nest" / "egg"):
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    before = snapshot(canary)
    with trio.fail_after(TIMEOUT):
        async with nfs_server(tmp_path) as (serving, export), trio.open_nursery() as nursery:
            bystanders = [Bystander(serving, export, proto) for proto in ("rdma", "tcp")]
            for bystander in bystanders:
                nursery.start_soon(bystander.run)
                await bystander.ready.wait()
            assert serving.tcp_port is not None
            async with connect_tcp(HOST, serving.tcp_port, cred=CRED) as rpc:
                u = await rpc.call(t.MOUNT_PROGRAM, 3, MOUNTPROC_MNT, export_arg(serving))
                assert u.uint() == MNT3_OK
                yield Scene(serving, export, canary, rpc, t.unpack_fh(u))
            for bystander in bystanders:
                bystander.stop.set()
    assert all(b.rounds > 1 for b in bystanders)
    assert snapshot(canary) == before


def export_arg(serving: Serving) -> Reply:
    reply = Reply()
    reply.packer.string(serving.export)
    return reply


# ------------------------------------------------------------------ names and symlinks

ERRORS = {
    t.NFS3ERR_PERM,
    t.NFS3ERR_ACCES,
    t.NFS3ERR_EXIST,
    t.NFS3ERR_INVAL,
    t.NFS3ERR_NOENT,
    t.NFS3ERR_NOTDIR,
}


async def test_names_that_climb_out_are_refused_everywhere(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        root = s.root
        fh = await s.made(t.CREATE, Args().dirop(root, "mine").u32(t.GUARDED).sattr())
        climbers = [
            "..", "../canary", "../canary/song", "../canary/nest", f"{s.canary}/song",
            str(s.canary), "a/../../canary", "/", "nest/../..", "ok\0/../canary",
        ]  # fmt: skip
        for name in climbers:
            calls = {
                t.CREATE: Args().dirop(root, name).u32(t.UNCHECKED).sattr(t.Sattr3(size=0)),
                t.MKDIR: Args().dirop(root, name).sattr(),
                t.SYMLINK: Args().dirop(root, name).sattr().opaque("mine"),
                t.MKNOD: Args().dirop(root, name).u32(t.NF3FIFO).sattr(),
                t.REMOVE: Args().dirop(root, name),
                t.RMDIR: Args().dirop(root, name),
                t.RENAME: Args().dirop(root, "mine").dirop(root, name),
                t.LINK: Args().fh(fh).dirop(root, name),
            }
            for proc, args in calls.items():
                assert await s.call(proc, args) in ERRORS, (proc, name)
            back = Args().dirop(root, name).dirop(root, "back")
            assert await s.call(t.RENAME, back) in ERRORS, name
            if name != "..":  # ".." at the root is the root (test_nfs_export)
                assert await s.call(t.LOOKUP, Args().dirop(root, name)) in ERRORS, name
        assert sorted(os.listdir(s.export)) == ["bystander-rdma", "bystander-tcp", "mine"]


async def test_symlinks_out_are_no_directory_to_any_procedure(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        root = s.root
        fh = await s.made(t.CREATE, Args().dirop(root, "mine").u32(t.GUARDED).sattr())
        os.symlink(s.canary / "nest", s.export / "planted")  # one made behind the server
        links = [await s.lookup(root, "planted")]
        for name, target in (("abs", str(s.canary)), ("rel", "../canary/nest")):
            links.append(await s.made(t.SYMLINK, Args().dirop(root, name).sattr().opaque(target)))
        for link in links:
            calls = directory_calls(link, root, fh)
            calls[t.COMMIT] = Args().fh(link).u64(0).u32(0)
            for proc, args in calls.items():
                assert await s.call(proc, args) in ERRORS, proc
            moved_in = Args().dirop(root, "mine").dirop(link, "song")
            assert await s.call(t.RENAME, moved_in) in ERRORS
            # SETATTR of a link changes the link (mode: nothing), never what it names
            touch = Args().fh(link).sattr(t.Sattr3(mode=0o600, mtime=(1, 2))).u32(0)
            assert await s.call(t.SETATTR, touch) in {t.NFS3_OK, *ERRORS}


async def test_a_symlink_swapped_in_mid_operation(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        sub = await s.made(t.MKDIR, Args().dirop(s.root, "d").sattr(t.Sattr3(mode=0o777)))
        fh = await s.made(t.CREATE, Args().dirop(sub, "f").u32(t.GUARDED).sattr())
        stop = threading.Event()

        def swap() -> None:  # d flips between the real directory and a link to the canary
            while not stop.is_set():
                os.rename(s.export / "d", s.export / "real")
                os.symlink(s.canary / "nest", s.export / "d")
                os.unlink(s.export / "d")
                os.rename(s.export / "real", s.export / "d")

        thread = threading.Thread(target=swap)
        thread.start()
        allowed = {t.NFS3_OK, t.NFS3ERR_STALE, t.NFS3ERR_NOENT, *ERRORS}
        try:
            for i in range(60):
                calls = [
                    (t.LOOKUP, Args().dirop(s.root, "d")),
                    (t.READDIRPLUS, Args().fh(sub).u64(0).raw(bytes(8)).u32(4096, 65536)),
                    (t.MKDIR, Args().dirop(sub, f"m{i}").sattr()),
                    (t.CREATE, Args().dirop(sub, "egg").u32(t.UNCHECKED).sattr(t.Sattr3(size=0))),
                    (t.SETATTR, Args().fh(fh).sattr(t.Sattr3(size=3)).u32(0)),
                    (t.REMOVE, Args().dirop(sub, "egg")),
                    (t.RENAME, Args().dirop(sub, "f").dirop(sub, "g")),
                    (t.RENAME, Args().dirop(sub, "g").dirop(sub, "f")),
                    (t.RMDIR, Args().dirop(sub, f"m{i}")),
                    (t.LINK, Args().fh(fh).dirop(sub, "song")),
                    (t.REMOVE, Args().dirop(sub, "song")),
                ]
                for proc, args in calls:
                    assert await s.call(proc, args) in allowed, proc
        finally:
            stop.set()
            thread.join()


# ------------------------------------------------------------------ handles


def directory_calls(dir_fh: bytes, other_dir: bytes, file_fh: bytes) -> dict[int, Args]:
    """A call of every procedure that takes a directory, ``dir_fh`` in its place.

    The names are the canary's: were ``dir_fh`` to lead there, they would act on it.
    """
    return {
        t.LOOKUP: Args().dirop(dir_fh, "egg"),
        t.CREATE: Args().dirop(dir_fh, "egg").u32(t.UNCHECKED).sattr(t.Sattr3(size=0)),
        t.MKDIR: Args().dirop(dir_fh, "new").sattr(),
        t.SYMLINK: Args().dirop(dir_fh, "new").sattr().opaque("x"),
        t.MKNOD: Args().dirop(dir_fh, "new").u32(t.NF3FIFO).sattr(),
        t.REMOVE: Args().dirop(dir_fh, "song"),
        t.RMDIR: Args().dirop(dir_fh, "nest"),
        t.RENAME: Args().dirop(dir_fh, "egg").dirop(other_dir, "stolen"),
        t.LINK: Args().fh(file_fh).dirop(dir_fh, "new"),
        t.READDIR: Args().fh(dir_fh).u64(0).raw(bytes(8)).u32(4096),
        t.READDIRPLUS: Args().fh(dir_fh).u64(0).raw(bytes(8)).u32(4096, 65536),
    }


def handle_calls(fh: bytes, dir_fh: bytes, file_fh: bytes) -> list[tuple[int, Args]]:
    """A call of every procedure that takes a handle, ``fh`` in the handle's place."""
    return [
        *directory_calls(fh, dir_fh, file_fh).items(),
        (t.GETATTR, Args().fh(fh)),
        (t.SETATTR, Args().fh(fh).sattr(t.Sattr3(size=0)).u32(0)),
        (t.ACCESS, Args().fh(fh).u32(0x3F)),
        (t.READLINK, Args().fh(fh)),
        (t.READ, Args().fh(fh).u64(0).u32(100)),
        (t.WRITE, Args().fh(fh).u64(0).u32(5, t.FILE_SYNC).opaque(b"pwned")),
        (t.RENAME, Args().dirop(dir_fh, "f").dirop(fh, "stolen")),
        (t.LINK, Args().fh(fh).dirop(dir_fh, "stolen")),
        (t.FSSTAT, Args().fh(fh)),
        (t.FSINFO, Args().fh(fh)),
        (t.PATHCONF, Args().fh(fh)),
        (t.COMMIT, Args().fh(fh).u64(0).u32(0)),
    ]


async def test_forged_handles_in_every_procedure(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        fh = await s.made(t.CREATE, Args().dirop(s.root, "f").u32(t.GUARDED).sattr())
        altered = bytearray(s.root)
        altered[-1] ^= 0x80  # the MAC
        inode = bytearray(fh)
        inode[13] ^= 1  # the inode number, the MAC left as it was
        for forged in (b"", bytes(41), os.urandom(41), bytes(altered), bytes(inode), fh[:-1]):
            for proc, args in handle_calls(forged, s.root, fh):
                assert await s.call(proc, args) == t.NFS3ERR_BADHANDLE, (proc, forged)
        too_long = Args().u32(65).raw(bytes(68))  # over NFS3_FHSIZE: not even a handle
        with pytest.raises(GarbageArgs):
            await s.call(t.GETATTR, too_long)
        assert sorted(os.listdir(s.export)) == ["bystander-rdma", "bystander-tcp", "f"]


async def test_a_handle_moved_out_of_the_export_is_stale(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    async with scene(tmp_path) as s:
        d = await s.made(t.MKDIR, Args().dirop(s.root, "d").sattr(t.Sattr3(mode=0o777)))
        f = await s.made(t.CREATE, Args().dirop(d, "f").u32(t.GUARDED).sattr(t.Sattr3(mode=0o666)))
        assert await s.call(t.WRITE, Args().fh(f).u64(0).u32(2, t.FILE_SYNC).opaque(b"in")) == 0
        gone = await s.made(t.CREATE, Args().dirop(s.root, "g").u32(t.GUARDED).sattr())
        os.rename(s.export / "d", elsewhere / "d")  # behind the server's back
        os.unlink(s.export / "g")
        os.chmod(elsewhere / "d", 0o777)
        out = snapshot(elsewhere)
        for stale in (d, f, gone):
            for proc, args in handle_calls(stale, s.root, stale):
                assert await s.call(proc, args) == t.NFS3ERR_STALE, (proc, stale)
        assert snapshot(elsewhere) == out
        assert (elsewhere / "d" / "f").read_bytes() == b"in"


# ------------------------------------------------------------------ counts and lengths


async def test_huge_counts_and_lengths(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        fh = await s.made(t.CREATE, Args().dirop(s.root, "f").u32(t.GUARDED).sattr())
        top = 0xFFFF_FFFF
        write = Args().fh(fh).u64(0).u32(5, t.FILE_SYNC).opaque(b"hello")
        assert await s.call(t.WRITE, write) == t.NFS3_OK

        u = await s.results(t.READ, Args().fh(fh).u64(0).u32(top))
        assert u.uint() == t.NFS3_OK
        t.unpack_post_op_attr(u)
        assert (u.uint(), u.boolean(), u.opaque()) == (5, True, b"hello")
        u = await s.results(t.READ, Args().fh(fh).u64(2**64 - 1).u32(top))
        assert u.uint() == t.NFS3_OK
        t.unpack_post_op_attr(u)
        assert (u.uint(), u.boolean(), u.opaque()) == (0, True, b"")

        far = Args().fh(fh).u64(2**64 - 3).u32(5, t.FILE_SYNC).opaque(b"hello")
        assert await s.call(t.WRITE, far) in (t.NFS3ERR_FBIG, t.NFS3ERR_INVAL)
        huge_size = Args().fh(fh).sattr(t.Sattr3(size=2**64 - 1)).u32(0)
        assert await s.call(t.SETATTR, huge_size) in (t.NFS3ERR_FBIG, t.NFS3ERR_INVAL)
        listing = Args().fh(s.root).u64(0).raw(bytes(8))
        for proc, counts, status in (
            (t.READDIR, (top,), t.NFS3_OK),
            (t.READDIRPLUS, (top, top), t.NFS3_OK),
            (t.READDIR, (0,), t.NFS3ERR_TOOSMALL),
            (t.READDIRPLUS, (0, 0), t.NFS3ERR_TOOSMALL),
        ):
            assert await s.call(proc, listing.bytes() + Args().u32(*counts).bytes()) == status
        bad_cookie = Args().fh(s.root).u64(2**64 - 1).raw(b"rdmashim").u32(4096)
        assert await s.call(t.READDIR, bad_cookie) in (t.NFS3_OK, t.NFS3ERR_BAD_COOKIE)

        # lengths that promise more than the call holds are garbage, not allocations
        count_over_data = Args().fh(fh).u64(0).u32(top, t.FILE_SYNC).opaque(b"hello")
        assert await s.call(t.WRITE, count_over_data) == t.NFS3ERR_INVAL
        for proc, lying in (
            (t.WRITE, Args().fh(fh).u64(0).u32(5, t.FILE_SYNC).u32(top).raw(b"hello\0\0\0")),
            (t.LOOKUP, Args().fh(s.root).u32(top).raw(b"name")),  # a name's length
            (t.LOOKUP, Args().u32(top).raw(bytes(8))),  # a handle's length
            (t.SYMLINK, Args().dirop(s.root, "l").sattr().opaque("x" * (t.PATH_LIMIT + 1))),
        ):
            with pytest.raises(GarbageArgs):
                await s.call(proc, lying)
        over_path_max = Args().dirop(s.root, "l").sattr().opaque("x" * (t.PATH_MAX + 1))
        assert await s.call(t.SYMLINK, over_path_max) == t.NFS3ERR_NAMETOOLONG
        assert (s.export / "f").read_bytes() == b"hello"


# ------------------------------------------------------------------ RPC-over-RDMA


def nfs_call(xid: int, proc: int, args: Args) -> bytes:
    """An NFSv3 call message with the test's AUTH_SYS credential."""
    r = Reply()
    pack_call_header(r.packer, CallHeader(xid, t.NFS_PROGRAM, 3, proc, OpaqueAuth.sys(CRED)))
    return bytes(r.packer.data) + args.bytes()


async def test_chunks_pointing_at_nothing(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        assert s.serving.rdma_port is not None
        fh = await s.made(t.CREATE, Args().dirop(s.root, "f").u32(t.GUARDED).sattr())
        assert await s.call(t.WRITE, Args().fh(fh).u64(0).u32(4, t.FILE_SYNC).opaque(b"safe")) == 0
        nowhere = Segment(0xDEAD_BEEF, 4096, 0x1000)  # an R_Key nobody registered
        # a WRITE whose data is to be pulled from a region that is not there
        head = nfs_call(1, t.WRITE, Args().fh(fh).u64(0).u32(4096, t.FILE_SYNC).u32(4096))
        write = Header(1, 8, read_list=(ReadSegment(len(head), nowhere),)).encode() + head
        # a READ whose data is to be pushed into a region that is not there
        read = Header(2, 8, write_list=((nowhere,),)).encode()
        read += nfs_call(2, t.READ, Args().fh(fh).u64(0).u32(4096))
        # a READDIRPLUS whose long reply is to go into a Reply chunk that is not there
        for i in range(100):
            (s.export / f"{i:03d}-a-name-long-enough-to-fill-the-listing").touch()
        plus = Args().fh(s.root).u64(0).raw(bytes(8)).u32(65536, 65536)
        listing = Header(3, 8, reply_chunk=(Segment(0xDEAD_BEEF, 65536, 0),)).encode()
        listing += nfs_call(3, t.READDIRPLUS, plus)
        # a Write chunk too small for the READ's data
        small = Header(4, 8, write_list=((Segment(0xDEAD_BEEF, 2, 0),),)).encode()
        small += nfs_call(4, t.READ, Args().fh(fh).u64(0).u32(4))
        # an RDMA Read or Write that fails ends the connection (the peer gets a Terminate)
        for message in (write, read, listing):
            async with raw(s.serving.rdma_port) as r:
                r.send(message)
                assert await r.receive() is None
        async with raw(s.serving.rdma_port) as r:
            r.send(small)
            assert await r.receive() == words(4, 1, 32, 4, ErrCode.ERR_CHUNK)
        assert (s.export / "f").read_bytes() == b"safe"


async def test_more_nfs_calls_than_credits(tmp_path: Path) -> None:
    async with scene(tmp_path) as s:
        assert s.serving.rdma_port is not None
        async with raw(s.serving.rdma_port) as r:
            for xid in range(200, 248):  # 48 on 32 credits, all at once
                args = Args().dirop(s.root, f"n{xid}").u32(t.GUARDED).sattr()
                r.send(Header(xid, 48).encode() + nfs_call(xid, t.CREATE, args))
            answered = 0
            while (reply := await r.receive()) is not None:
                assert reply[4:12] == words(1, 32)
                answered += 1
            assert answered <= 32  # the connection ended instead of answering more
        made = [name for name in os.listdir(s.export) if name.startswith("n")]
        assert len(made) <= 48
