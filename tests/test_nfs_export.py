"""Export safety: handles (restart, forgery, staleness), traversal, read-only, root squash."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_nfs3 import GID, ROOT, UID, Args, Client, make_program

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.handles import ObjectId, RelPath
from rdmashim.ulps.nfsrdma.nfs3 import Nfs3Program

needs_root = pytest.mark.skipif(not ROOT, reason="ownership checks need the server to run as root")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the export a client must never reach."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret").write_bytes(b"secret")
    return d


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    d = tmp_path / "export"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    return d


@pytest.fixture
def program(tmp_path: Path, export_dir: Path) -> Iterator[Nfs3Program]:
    prog = make_program(export_dir, tmp_path / "state")
    yield prog
    prog.exports[0].close()


def root_handle(program: Nfs3Program) -> bytes:
    export = program.exports[0]
    node = export.root()
    try:
        return export.handle(node)
    finally:
        os.close(node.fd)


async def test_handles_survive_a_restart(tmp_path: Path, export_dir: Path) -> None:
    first = make_program(export_dir, tmp_path / "state")
    fh = await Client(first).create(root_handle(first), "f")
    first.exports[0].close()
    second = make_program(export_dir, tmp_path / "state")
    try:
        assert (await Client(second).getattr(fh)).size == 0
    finally:
        second.exports[0].close()
    other = make_program(export_dir, tmp_path / "other-state")
    try:
        assert await Client(other).status(t.GETATTR, Args().fh(fh)) == t.NFS3ERR_BADHANDLE
    finally:
        other.exports[0].close()


async def test_forged_and_altered_handles(program: Nfs3Program) -> None:
    client = Client(program)
    fh = await client.create(root_handle(program), "f")
    for i in range(len(fh)):
        altered = bytearray(fh)
        altered[i] ^= 1
        assert await client.status(t.GETATTR, Args().fh(bytes(altered))) == t.NFS3ERR_BADHANDLE
    for forged in (b"", b"x" * 41, fh[:-1], fh + b"\0", os.urandom(64)):
        assert await client.status(t.GETATTR, Args().fh(forged)) == t.NFS3ERR_BADHANDLE


async def test_deleted_and_reused_inodes_are_stale(program: Nfs3Program, export_dir: Path) -> None:
    client = Client(program)
    fh = await client.create(root_handle(program), "f")
    ino = os.stat(export_dir / "f").st_ino
    os.unlink(export_dir / "f")
    assert await client.status(t.GETATTR, Args().fh(fh)) == t.NFS3ERR_STALE
    for i in range(20):  # on ext4, a new file soon takes the freed inode: a new generation
        (export_dir / f"n{i}").touch()
        if os.stat(export_dir / f"n{i}").st_ino == ino:
            break
    assert await client.status(t.GETATTR, Args().fh(fh)) == t.NFS3ERR_STALE


async def test_a_moved_object_is_found_by_search(program: Nfs3Program, export_dir: Path) -> None:
    client = Client(program)
    sub = await client.mkdir(root_handle(program), "a")
    fh = await client.create(sub, "f")
    (export_dir / "b" / "c").mkdir(parents=True)
    os.rename(export_dir / "a", export_dir / "b" / "c" / "a")  # behind the server's back
    assert await client.write(fh, 0, b"moved") == t.NFS3_OK
    assert (export_dir / "b" / "c" / "a" / "f").read_bytes() == b"moved"


async def test_looking_runs_on_the_event_loop_and_a_search_in_a_worker_thread(
    program: Nfs3Program, export_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GETATTR and the other procedures that only look run where the call came (a
    thread hop costs several times their work); one whose handle's object moved, so
    the export must be searched, starts again in a worker thread and still answers."""
    resolver = program.exports[0].resolver
    finds: list[tuple[str, bool]] = []  # (the search flag, on the event loop thread)
    real_find = resolver.find

    def find(oid: ObjectId, *, search: bool = True) -> tuple[int, os.stat_result, RelPath]:
        finds.append((str(oid.ino), threading.current_thread() is threading.main_thread()))
        return real_find(oid, search=search)

    monkeypatch.setattr(resolver, "find", find)
    client = Client(program)
    sub = await client.mkdir(root_handle(program), "a")
    fh = await client.create(sub, "f")
    ino = str(os.stat(export_dir / "a" / "f").st_ino)
    await client.write(fh, 0, b"12345")
    finds.clear()
    assert (await client.getattr(fh)).size == 5
    assert finds == [(ino, True)]
    (export_dir / "b").mkdir()
    os.rename(export_dir / "a", export_dir / "b" / "a")  # behind the server's back
    finds.clear()
    assert (await client.getattr(fh)).size == 5  # the same call, started again
    assert finds == [(ino, True), (ino, False)]
    finds.clear()
    assert await client.write(fh, 0, b"x") == t.NFS3_OK
    assert finds == [(ino, False)]  # data moves in a worker thread


async def test_the_search_is_bounded(tmp_path: Path, export_dir: Path) -> None:
    program = make_program(export_dir, tmp_path / "state", search_limit=2)
    try:
        client = Client(program)
        sub = await client.mkdir(root_handle(program), "a")
        fh = await client.create(sub, "f")
        for name in "xyz":
            (export_dir / name).mkdir()
        os.rename(export_dir / "a", export_dir / "z" / "a")
        assert await client.status(t.GETATTR, Args().fh(fh)) == t.NFS3ERR_STALE
    finally:
        program.exports[0].close()


async def test_dotdot_at_the_root_is_the_root(program: Nfs3Program) -> None:
    client = Client(program)
    root = root_handle(program)
    assert await client.lookup(await client.lookup(root, ".."), "..") == root


async def test_symlinks_are_never_followed(program: Nfs3Program, outside: Path) -> None:
    client = Client(program)
    root = root_handle(program)
    links = (("abs", str(outside)), ("rel", "../outside"), ("file", "../outside/secret"))
    for name, target in links:
        args = Args().dirop(root, name).sattr().opaque(target)
        fh, _ = await client.made(t.SYMLINK, args)
        assert await client.lookup(root, name) == fh
        assert (await client.getattr(fh)).ftype == t.NF3LNK
        assert await client.status(t.LOOKUP, Args().dirop(fh, "secret")) == t.NFS3ERR_NOTDIR
        assert await client.status(t.READ, Args().fh(fh).u64(0).u32(10)) == t.NFS3ERR_INVAL
        assert await client.write(fh, 0, b"pwned") == t.NFS3ERR_INVAL
        create = Args().dirop(fh, "new").u32(t.UNCHECKED).sattr()
        assert await client.status(t.CREATE, create) == t.NFS3ERR_NOTDIR
        truncate = Args().fh(fh).sattr(t.Sattr3(size=0)).u32(0)
        assert await client.status(t.SETATTR, truncate) == t.NFS3ERR_INVAL
    # a name that is a symlink is not opened through, even by an UNCHECKED create
    unchecked = Args().dirop(root, "file").u32(t.UNCHECKED).sattr(t.Sattr3(size=0))
    assert await client.status(t.CREATE, unchecked) == t.NFS3ERR_EXIST
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret"


async def test_a_hard_link_to_outside_is_just_a_file(
    program: Nfs3Program, export_dir: Path, outside: Path
) -> None:
    os.chmod(outside / "secret", 0o666)
    os.link(outside / "secret", export_dir / "hard")
    client = Client(program)
    fh = await client.lookup(root_handle(program), "hard")
    assert await client.read(fh, 0, 100) == (b"secret", True)


async def test_a_symlink_swapped_in_cannot_redirect(
    program: Nfs3Program, export_dir: Path, outside: Path
) -> None:
    client = Client(program)
    root = root_handle(program)
    sub = await client.mkdir(root, "d", 0o777)
    fh = await client.create(sub, "f", 0o666)
    stop = threading.Event()

    def swap() -> None:  # d flips between the real directory and a link to outside
        while not stop.is_set():
            os.rename(export_dir / "d", export_dir / "real")
            os.symlink(outside, export_dir / "d")
            os.unlink(export_dir / "d")
            os.rename(export_dir / "real", export_dir / "d")

    thread = threading.Thread(target=swap)
    thread.start()
    try:
        for i in range(200):
            status = await client.write(fh, 0, b"inside")
            assert status in (t.NFS3_OK, t.NFS3ERR_STALE)
            create = Args().dirop(sub, f"n{i}").u32(t.GUARDED).sattr()
            assert await client.status(t.CREATE, create) in (t.NFS3_OK, t.NFS3ERR_STALE)
    finally:
        stop.set()
        thread.join()
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret"
    assert (export_dir / "d" / "f").read_bytes() == b"inside"


async def test_a_read_only_export_refuses_every_change(tmp_path: Path, export_dir: Path) -> None:
    (export_dir / "f").write_bytes(b"data")
    (export_dir / "d").mkdir()
    program = make_program(export_dir, tmp_path / "state", read_only=True)
    try:
        client = Client(program)
        root = root_handle(program)
        fh = await client.lookup(root, "f")
        changes = {
            t.SETATTR: Args().fh(fh).sattr(t.Sattr3(mode=0o600)).u32(0),
            t.WRITE: Args().fh(fh).u64(0).u32(1, 0).opaque(b"x"),
            t.CREATE: Args().dirop(root, "n").u32(t.UNCHECKED).sattr(),
            t.MKDIR: Args().dirop(root, "n").sattr(),
            t.SYMLINK: Args().dirop(root, "n").sattr().opaque("f"),
            t.MKNOD: Args().dirop(root, "n").u32(t.NF3FIFO).sattr(),
            t.REMOVE: Args().dirop(root, "f"),
            t.RMDIR: Args().dirop(root, "d"),
            t.RENAME: Args().dirop(root, "f").dirop(root, "g"),
            t.LINK: Args().fh(fh).dirop(root, "g"),
        }
        for proc, args in changes.items():
            assert await client.status(proc, args) == t.NFS3ERR_ROFS, proc
        assert await client.read(fh, 0, 10) == (b"data", True)
        u = await client.ok(t.ACCESS, Args().fh(fh).u32(0x3F))
        t.unpack_post_op_attr(u)
        assert u.uint() == t.ACCESS3_READ
        assert sorted(os.listdir(export_dir)) == ["d", "f"]
    finally:
        program.exports[0].close()


@needs_root
async def test_root_is_squashed_to_nobody(program: Nfs3Program, export_dir: Path) -> None:
    root = Client(program, uid=0, gid=0)
    await root.create(root_handle(program), "f")
    st = os.stat(export_dir / "f")
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    os.chmod(export_dir, 0o755)
    status = await root.status(t.MKDIR, Args().dirop(root_handle(program), "d").sattr())
    assert status == t.NFS3ERR_ACCES


@needs_root
async def test_root_without_squash_and_auth_none(tmp_path: Path, export_dir: Path) -> None:
    program = make_program(export_dir, tmp_path / "state", root_squash=False)
    try:
        await Client(program, uid=0, gid=0).create(root_handle(program), "f")
        assert os.stat(export_dir / "f").st_uid == 0
        args = Args().dirop(root_handle(program), "g").u32(t.GUARDED).sattr().bytes()
        await Client(program).raw(t.CREATE, args, auth=False)
        assert os.stat(export_dir / "g").st_uid == 65534
    finally:
        program.exports[0].close()


@needs_root
async def test_sticky_directory(program: Nfs3Program, export_dir: Path) -> None:
    os.chmod(export_dir, 0o1777)
    owner, other = Client(program), Client(program, uid=UID + 1, gid=GID + 1)
    await owner.create(root_handle(program), "mine", 0o666)
    assert await other.status(t.REMOVE, Args().dirop(root_handle(program), "mine")) == (
        t.NFS3ERR_ACCES
    )
    assert await owner.status(t.REMOVE, Args().dirop(root_handle(program), "mine")) == t.NFS3_OK


async def test_clients_outside_the_list_are_refused(tmp_path: Path, export_dir: Path) -> None:
    program = make_program(export_dir, tmp_path / "state", clients=["10.0.0.0/8"])
    try:
        fh = root_handle(program)
        assert await Client(program).status(t.GETATTR, Args().fh(fh)) == t.NFS3ERR_ACCES
        assert (await Client(program, peer="10.1.2.3").getattr(fh)).ftype == t.NF3DIR
    finally:
        program.exports[0].close()
