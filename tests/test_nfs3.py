"""The NFSv3 program through ``dispatch``: each procedure's results and errors on real files.

Also the test-side client (:class:`Client`, :class:`Args`) the other NFS test
modules use: arguments encoded with ``xdr.Packer``, replies decoded with
``nfs3_types``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nfs3 import Nfs3Program
from rdmashim.ulps.nfsrdma.service import AuthSys, CallContext, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker

ROOT = os.geteuid() == 0
UID = 1000 if ROOT else os.getuid()
GID = 1000 if ROOT else os.getgid()


class Args:
    """A call's arguments, built field by field."""

    def __init__(self) -> None:
        self.p = Packer()

    def fh(self, fh: bytes) -> Args:
        t.pack_fh(self.p, fh)
        return self

    def dirop(self, fh: bytes, name: str) -> Args:
        t.pack_diropargs(self.p, fh, name)
        return self

    def u32(self, *values: int) -> Args:
        for v in values:
            self.p.uint(v)
        return self

    def u64(self, *values: int) -> Args:
        for v in values:
            self.p.uhyper(v)
        return self

    def sattr(self, s: t.Sattr3 | None = None) -> Args:
        t.pack_sattr3(self.p, s or t.Sattr3())
        return self

    def raw(self, data: bytes) -> Args:
        self.p.fopaque(data, len(data))
        return self

    def opaque(self, data: bytes | str) -> Args:
        self.p.string(data)
        return self

    def bytes(self) -> bytes:
        return self.p.getvalue()


@dataclass
class Client:
    """Calls a program's ``dispatch`` as one AUTH_SYS user from one address."""

    program: Nfs3Program
    uid: int = UID
    gid: int = GID
    gids: tuple[int, ...] = ()
    peer: str = "127.0.0.1"
    prog: int = t.NFS_PROGRAM
    vers: int = 3

    async def raw(self, proc: int, args: bytes, *, auth: bool = True) -> Reply:
        cred = AuthSys(0, "client", self.uid, self.gid, self.gids) if auth else None
        ctx = CallContext(1, self.prog, self.vers, proc, cred, (self.peer, 900), "tcp")
        reply = Reply()
        await self.program.dispatch(ctx, Unpacker(args), reply)
        return reply

    async def call(self, proc: int, args: Args | bytes) -> tuple[int, Unpacker]:
        """The status and the rest of the reply, inline."""
        reply = await self.raw(proc, args if isinstance(args, bytes) else args.bytes())
        u = Unpacker(b"".join(reply.inline()))
        return u.uint(), u

    async def ok(self, proc: int, args: Args) -> Unpacker:
        status, u = await self.call(proc, args)
        assert status == t.NFS3_OK, status
        return u

    async def status(self, proc: int, args: Args) -> int:
        return (await self.call(proc, args))[0]

    async def getattr(self, fh: bytes) -> t.Fattr3:
        return t.unpack_fattr3(await self.ok(t.GETATTR, Args().fh(fh)))

    async def lookup(self, fh: bytes, name: str) -> bytes:
        return t.unpack_fh(await self.ok(t.LOOKUP, Args().dirop(fh, name)))

    async def made(self, proc: int, args: Args) -> tuple[bytes, t.Fattr3]:
        """The handle and attributes a CREATE, MKDIR, SYMLINK or MKNOD returns."""
        u = await self.ok(proc, args)
        fh, attrs = t.unpack_post_op_fh3(u), t.unpack_post_op_attr(u)
        t.unpack_wcc_data(u)
        assert fh is not None and attrs is not None
        return fh, attrs

    async def create(self, fh: bytes, name: str, mode: int = 0o644) -> bytes:
        args = Args().dirop(fh, name).u32(t.GUARDED).sattr(t.Sattr3(mode=mode))
        return (await self.made(t.CREATE, args))[0]

    async def mkdir(self, fh: bytes, name: str, mode: int = 0o755) -> bytes:
        args = Args().dirop(fh, name).sattr(t.Sattr3(mode=mode))
        return (await self.made(t.MKDIR, args))[0]

    async def write(self, fh: bytes, offset: int, data: bytes, stable: int = t.FILE_SYNC) -> int:
        args = Args().fh(fh).u64(offset).u32(len(data), stable).opaque(data)
        return await self.status(t.WRITE, args)

    async def read(self, fh: bytes, offset: int, count: int) -> tuple[bytes, bool]:
        u = await self.ok(t.READ, Args().fh(fh).u64(offset).u32(count))
        t.unpack_post_op_attr(u)
        n, eof, data = u.uint(), u.boolean(), u.opaque()
        assert n == len(data)
        return data, eof

    async def readdir(
        self, fh: bytes, cookie: int = 0, count: int = 8192, verf: bytes = bytes(8)
    ) -> tuple[list[tuple[str, int]], bool, bytes]:
        """(name, cookie) of each entry, eof, the cookie verifier."""
        u = await self.ok(t.READDIR, Args().fh(fh).u64(cookie).raw(verf).u32(count))
        t.unpack_post_op_attr(u)
        verifier = u.fopaque(8)
        entries = []
        while u.boolean():
            u.uhyper()
            entries.append((u.string(), u.uhyper()))
        return entries, u.boolean(), verifier


def make_program(export_dir: Path, state: Path, **options: object) -> Nfs3Program:
    return Nfs3Program(Export(export_dir, state_dir=state, **options))  # type: ignore[arg-type]


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    d = tmp_path / "export"
    d.mkdir()
    if ROOT:
        os.chown(d, UID, GID)
    return d


@pytest.fixture
def program(tmp_path: Path, export_dir: Path) -> Iterator[Nfs3Program]:
    prog = make_program(export_dir, tmp_path / "state")
    yield prog
    for export in prog.exports:
        export.close()


@pytest.fixture
def client(program: Nfs3Program) -> Client:
    return Client(program)


@pytest.fixture
def root_fh(program: Nfs3Program) -> bytes:
    export = program.exports[0]
    node = export.root()
    try:
        return export.handle(node)
    finally:
        os.close(node.fd)


async def test_null_has_no_result(client: Client) -> None:
    assert (await client.raw(t.NULL, b"")).packer.data == b""


async def test_unknown_procedure_is_proc_unavail(client: Client) -> None:
    from rdmashim.ulps.nfsrdma.service import ProcUnavailable

    with pytest.raises(ProcUnavailable):
        await client.raw(22, b"")


async def test_getattr_of_the_root(client: Client, root_fh: bytes, export_dir: Path) -> None:
    attrs = await client.getattr(root_fh)
    st = os.stat(export_dir)
    assert (attrs.ftype, attrs.fileid, attrs.uid) == (t.NF3DIR, st.st_ino, st.st_uid)
    assert attrs.mode == stat.S_IMODE(st.st_mode)


async def test_create_write_read_and_eof(client: Client, root_fh: bytes, export_dir: Path) -> None:
    fh = await client.create(root_fh, "f", 0o640)
    assert await client.write(fh, 0, b"hello world") == t.NFS3_OK
    assert (export_dir / "f").read_bytes() == b"hello world"
    assert (export_dir / "f").stat().st_uid == UID
    assert stat.S_IMODE((export_dir / "f").stat().st_mode) == 0o640
    assert await client.read(fh, 0, 5) == (b"hello", False)
    assert await client.read(fh, 6, 100) == (b"world", True)
    assert await client.read(fh, 100, 10) == (b"", True)
    assert await client.read(fh, 2**64 - 1, 10) == (b"", True)


async def test_read_data_is_ddp_eligible(client: Client, root_fh: bytes) -> None:
    fh = await client.create(root_fh, "f")
    await client.write(fh, 0, b"abcdef")
    reply = await client.raw(t.READ, Args().fh(fh).u64(0).u32(6).bytes())
    assert [bytes(item) for _, item in reply.ddp] == [b"abcdef"]


async def test_write_wcc_and_verifier(client: Client, root_fh: bytes) -> None:
    fh = await client.create(root_fh, "f")
    before = await client.getattr(fh)
    args = Args().fh(fh).u64(0).u32(3, t.UNSTABLE).opaque(b"xyz")
    u = await client.ok(t.WRITE, args)
    pre, post = t.unpack_wcc_data(u)
    assert pre == before.wcc()
    assert post is not None and post.size == 3
    assert (u.uint(), u.uint()) == (3, t.UNSTABLE)
    verifier = u.fopaque(8)
    u = await client.ok(t.COMMIT, Args().fh(fh).u64(0).u32(0))
    t.unpack_wcc_data(u)
    assert u.fopaque(8) == verifier


async def test_write_errors(client: Client, root_fh: bytes) -> None:
    fh = await client.create(root_fh, "f")
    more = Args().fh(fh).u64(0).u32(10, t.FILE_SYNC).opaque(b"abc")
    assert await client.status(t.WRITE, more) == t.NFS3ERR_INVAL
    assert await client.write(root_fh, 0, b"x") == t.NFS3ERR_ISDIR
    assert await client.write(fh, 2**63 - 2, b"xyz") == t.NFS3ERR_FBIG


async def test_lookup_and_its_errors(client: Client, root_fh: bytes) -> None:
    sub = await client.mkdir(root_fh, "d")
    fh = await client.create(sub, "f")
    assert await client.lookup(sub, "f") == fh
    assert await client.lookup(sub, "..") == root_fh
    assert await client.lookup(root_fh, "..") == root_fh
    assert await client.lookup(root_fh, ".") == root_fh
    lookup = t.LOOKUP
    assert await client.status(lookup, Args().dirop(root_fh, "nope")) == t.NFS3ERR_NOENT
    assert await client.status(lookup, Args().dirop(fh, "x")) == t.NFS3ERR_NOTDIR
    assert await client.status(lookup, Args().dirop(root_fh, "a/b")) == t.NFS3ERR_ACCES
    long = Args().dirop(root_fh, "n" * 256)
    assert await client.status(lookup, long) == t.NFS3ERR_NAMETOOLONG
    _, u = await client.call(lookup, Args().dirop(root_fh, "nope"))
    assert t.unpack_post_op_attr(u) is not None  # the directory's attributes on failure


async def test_setattr_and_its_guard(client: Client, root_fh: bytes, export_dir: Path) -> None:
    fh = await client.create(root_fh, "f")
    await client.write(fh, 0, b"0123456789")
    ctime = (await client.getattr(fh)).ctime
    stale = Args().fh(fh).sattr(t.Sattr3(size=2)).u32(1, ctime[0] - 1, ctime[1])
    assert await client.status(t.SETATTR, stale) == t.NFS3ERR_NOT_SYNC
    new = t.Sattr3(mode=0o600, size=4, mtime=(1000, 5), atime=t.SERVER_TIME)
    u = await client.ok(t.SETATTR, Args().fh(fh).sattr(new).u32(1, *ctime))
    pre, post = t.unpack_wcc_data(u)
    assert pre is not None and pre.size == 10
    assert post is not None and (post.size, post.mode, post.mtime) == (4, 0o600, (1000, 5))
    assert (export_dir / "f").read_bytes() == b"0123"
    dir_size = Args().fh(root_fh).sattr(t.Sattr3(size=0)).u32(0)
    assert await client.status(t.SETATTR, dir_size) == t.NFS3ERR_ISDIR
    chown = Args().fh(fh).sattr(t.Sattr3(uid=UID + 1)).u32(0)
    assert await client.status(t.SETATTR, chown) == t.NFS3ERR_PERM


async def test_access_by_mode_bits(client: Client, root_fh: bytes, export_dir: Path) -> None:
    fh = await client.create(root_fh, "f", 0o640)
    every = 0x3F
    u = await client.ok(t.ACCESS, Args().fh(fh).u32(every))
    t.unpack_post_op_attr(u)
    assert u.uint() == t.ACCESS3_READ | t.ACCESS3_MODIFY | t.ACCESS3_EXTEND
    other = Client(client.program, uid=UID + 1, gid=GID + 1)
    u = await other.ok(t.ACCESS, Args().fh(fh).u32(every))
    t.unpack_post_op_attr(u)
    assert u.uint() == 0
    group = Client(client.program, uid=UID + 1, gid=GID + 1, gids=(GID,))
    u = await group.ok(t.ACCESS, Args().fh(fh).u32(every))
    t.unpack_post_op_attr(u)
    assert u.uint() == t.ACCESS3_READ
    assert await other.status(t.READ, Args().fh(fh).u64(0).u32(1)) == t.NFS3ERR_ACCES
    assert await other.write(fh, 0, b"x") == t.NFS3ERR_ACCES


async def test_owner_may_write_a_file_it_made_read_only(client: Client, root_fh: bytes) -> None:
    fh = await client.create(root_fh, "f", 0o444)
    assert await client.write(fh, 0, b"x") == t.NFS3_OK


async def test_symlink_readlink(client: Client, root_fh: bytes, export_dir: Path) -> None:
    args = Args().dirop(root_fh, "l").sattr().opaque("/etc/passwd")
    fh, attrs = await client.made(t.SYMLINK, args)
    assert attrs.ftype == t.NF3LNK
    assert os.readlink(export_dir / "l") == "/etc/passwd"
    reply = await client.raw(t.READLINK, Args().fh(fh).bytes())
    assert [bytes(item) for _, item in reply.ddp] == [b"/etc/passwd"]
    assert await client.status(t.READLINK, Args().fh(root_fh)) == t.NFS3ERR_INVAL
    too_long = Args().dirop(root_fh, "m").sattr().opaque("x" * 4096)
    assert await client.status(t.SYMLINK, too_long) == t.NFS3ERR_NAMETOOLONG


async def test_mknod_fifo_yes_device_no(client: Client, root_fh: bytes, export_dir: Path) -> None:
    _, attrs = await client.made(t.MKNOD, Args().dirop(root_fh, "p").u32(t.NF3FIFO).sattr())
    assert attrs.ftype == t.NF3FIFO and stat.S_ISFIFO((export_dir / "p").lstat().st_mode)
    chr_args = Args().dirop(root_fh, "c").u32(t.NF3CHR).sattr().u32(1, 3)
    assert await client.status(t.MKNOD, chr_args) == t.NFS3ERR_NOTSUPP
    reg = Args().dirop(root_fh, "r").u32(t.NF3REG)
    assert await client.status(t.MKNOD, reg) == t.NFS3ERR_BADTYPE
    assert not (export_dir / "c").exists()


async def test_create_modes(client: Client, root_fh: bytes, export_dir: Path) -> None:
    await client.create(root_fh, "f")
    guarded = Args().dirop(root_fh, "f").u32(t.GUARDED).sattr()
    assert await client.status(t.CREATE, guarded) == t.NFS3ERR_EXIST
    (export_dir / "f").write_bytes(b"data")
    unchecked = Args().dirop(root_fh, "f").u32(t.UNCHECKED).sattr(t.Sattr3(size=0))
    await client.made(t.CREATE, unchecked)
    assert (export_dir / "f").read_bytes() == b""
    dots = Args().dirop(root_fh, "..").u32(t.GUARDED).sattr()
    assert await client.status(t.CREATE, dots) == t.NFS3ERR_EXIST


async def test_exclusive_create_retransmission(client: Client, root_fh: bytes) -> None:
    args = Args().dirop(root_fh, "x").u32(t.EXCLUSIVE).raw(b"verifier")
    first, _ = await client.made(t.CREATE, args)
    again, _ = await client.made(t.CREATE, args)
    assert first == again
    other = Args().dirop(root_fh, "x").u32(t.EXCLUSIVE).raw(b"another!")
    assert await client.status(t.CREATE, other) == t.NFS3ERR_EXIST


async def test_remove_rmdir_rename_link(client: Client, root_fh: bytes, export_dir: Path) -> None:
    sub = await client.mkdir(root_fh, "d")
    fh = await client.create(sub, "f")
    assert await client.status(t.RMDIR, Args().dirop(root_fh, "d")) == t.NFS3ERR_NOTEMPTY
    assert await client.status(t.REMOVE, Args().dirop(root_fh, "d")) == t.NFS3ERR_ISDIR
    assert await client.status(t.RMDIR, Args().dirop(sub, "f")) == t.NFS3ERR_NOTDIR
    assert await client.status(t.RMDIR, Args().dirop(sub, ".")) == t.NFS3ERR_INVAL
    u = await client.ok(t.LINK, Args().fh(fh).dirop(root_fh, "hard"))
    assert t.unpack_post_op_attr(u).nlink == 2  # type: ignore[union-attr]
    u = await client.ok(t.RENAME, Args().dirop(sub, "f").dirop(root_fh, "g"))
    (from_pre, from_post), (_, to_post) = t.unpack_wcc_data(u), t.unpack_wcc_data(u)
    assert from_pre is not None and from_post is not None and to_post is not None
    assert await client.lookup(root_fh, "g") == fh  # the same object, renamed
    assert await client.getattr(fh)
    status = await client.status(t.RENAME, Args().dirop(root_fh, "d").dirop(sub, "in"))
    assert status == t.NFS3ERR_INVAL  # a directory into itself
    assert await client.status(t.REMOVE, Args().dirop(root_fh, "g")) == t.NFS3_OK
    assert await client.status(t.RMDIR, Args().dirop(root_fh, "d")) == t.NFS3_OK
    assert sorted(os.listdir(export_dir)) == ["hard"]
    assert await client.status(t.REMOVE, Args().dirop(root_fh, "g")) == t.NFS3ERR_NOENT


async def test_wcc_of_a_directory_change(client: Client, root_fh: bytes) -> None:
    before = await client.getattr(root_fh)
    u = await client.ok(t.MKDIR, Args().dirop(root_fh, "d").sattr(t.Sattr3(mode=0o700)))
    t.unpack_post_op_fh3(u), t.unpack_post_op_attr(u)
    pre, post = t.unpack_wcc_data(u)
    assert pre == before.wcc()
    assert post is not None and post.nlink == before.nlink + 1
    status, u = await client.call(t.MKDIR, Args().dirop(root_fh, "d").sattr())
    assert status == t.NFS3ERR_EXIST
    pre, post = t.unpack_wcc_data(u)
    assert pre is not None and post is not None


async def test_fsstat_fsinfo_pathconf(client: Client, root_fh: bytes) -> None:
    u = await client.ok(t.FSSTAT, Args().fh(root_fh))
    t.unpack_post_op_attr(u)
    tbytes, fbytes, abytes = u.uhyper(), u.uhyper(), u.uhyper()
    assert tbytes >= fbytes >= abytes
    u = await client.ok(t.FSINFO, Args().fh(root_fh))
    t.unpack_post_op_attr(u)
    rtmax, _, _, wtmax, _, _, dtpref = (u.uint() for _ in range(7))
    assert (rtmax, wtmax) == (1 << 20, 1 << 20) and dtpref > 0
    assert u.uhyper() == 2**63 - 1
    assert t.unpack_time(u) == (0, 1)
    assert u.uint() & t.FSF3_CANSETTIME
    u = await client.ok(t.PATHCONF, Args().fh(root_fh))
    t.unpack_post_op_attr(u)
    assert (u.uint() > 1, u.uint()) == (True, 255)


async def test_read_count_is_capped_at_rtmax(client: Client, root_fh: bytes) -> None:
    fh = await client.create(root_fh, "big")
    for i in range(3):
        await client.write(fh, i << 19, bytes(1 << 19), t.UNSTABLE)
    data, eof = await client.read(fh, 0, 0xFFFFFFFF)
    assert (len(data), eof) == (1 << 20, False)


async def test_write_larger_than_wtmax_is_garbage(client: Client, root_fh: bytes) -> None:
    from rdmashim.ulps.nfsrdma.xdr import XdrError

    fh = await client.create(root_fh, "f")
    big = Args().fh(fh).u64(0).u32((1 << 20) + 4, 0).opaque(bytes((1 << 20) + 4))
    with pytest.raises(XdrError):
        await client.raw(t.WRITE, big.bytes())
