"""MOUNT v3 through ``dispatch``: MNT, DUMP, UMNT, UMNTALL, EXPORT; v1's MNT refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdmashim.ulps.nfsrdma import mount as m
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nfs3_types import MOUNT_PROGRAM, unpack_fh
from rdmashim.ulps.nfsrdma.service import AuthSys, CallContext, ProcUnavailable, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker


@pytest.fixture
def exports(tmp_path: Path) -> Iterator[list[Export]]:
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "file").touch()
    os.symlink("sub", tmp_path / "a" / "link")
    (tmp_path / "b").mkdir()
    state = tmp_path / "state"
    made = [
        Export(tmp_path / "a", state_dir=state, name="/srv/a"),
        Export(tmp_path / "b", state_dir=state, name="/srv/b", clients=["10.0.0.0/8", "10.1.1.1"]),
    ]
    yield made
    for export in made:
        export.close()


async def call(
    program: m.MountProgram,
    proc: int,
    path: str | None = None,
    *,
    peer: str = "127.0.0.1",
    vers: int = 3,
) -> Unpacker:
    ctx = CallContext(7, MOUNT_PROGRAM, vers, proc, AuthSys(0, "c", 0, 0), (peer, 800), "tcp")
    args = Packer()
    if path is not None:
        args.string(path)
    reply = Reply()
    await program.dispatch(ctx, Unpacker(args.getvalue()), reply)
    return Unpacker(b"".join(reply.inline()))


async def mnt(
    program: m.MountProgram, path: str, *, peer: str = "127.0.0.1", vers: int = 3
) -> tuple[int, bytes | None]:
    u = await call(program, m.MOUNTPROC_MNT, path, peer=peer, vers=vers)
    status = u.uint()
    if status != m.MNT3_OK:
        return status, None
    fh = unpack_fh(u)
    assert u.array(u.uint) == [1, 0]  # AUTH_SYS, AUTH_NONE
    return status, fh


async def test_mnt_gives_the_root_handle(exports: list[Export]) -> None:
    program = m.MountProgram(exports)
    status, fh = await mnt(program, "/srv/a/")
    root = exports[0].root()
    try:
        assert (status, fh) == (m.MNT3_OK, exports[0].handle(root))
    finally:
        os.close(root.fd)


async def test_mnt_of_a_subdirectory_and_its_errors(exports: list[Export]) -> None:
    program = m.MountProgram(exports)
    status, fh = await mnt(program, "/srv/a/sub")
    assert status == m.MNT3_OK and fh is not None
    assert (await mnt(program, "/srv/a/nope"))[0] == m.MNT3ERR_NOENT
    assert (await mnt(program, "/srv/c"))[0] == m.MNT3ERR_NOENT
    assert (await mnt(program, "/srv/a/file"))[0] == m.MNT3ERR_NOTDIR
    assert (await mnt(program, "/srv/a/link"))[0] == m.MNT3ERR_NOTDIR  # links not followed
    assert (await mnt(program, "/srv/a/../b"))[0] == m.MNT3ERR_NOENT  # ".." stays in /srv/a
    assert (await mnt(program, "/srv/b"))[0] == m.MNT3ERR_ACCES  # not in its clients
    assert (await mnt(program, "/srv/b", peer="10.9.8.7"))[0] == m.MNT3_OK
    assert (await mnt(program, "/srv/a", vers=1))[0] == m.MNT3ERR_ACCES


async def test_dump_umnt_umntall(exports: list[Export]) -> None:
    program = m.MountProgram(exports)
    await mnt(program, "/srv/a")
    await mnt(program, "/srv/a/sub")
    await mnt(program, "/srv/b", peer="10.0.0.1")

    async def dump() -> list[tuple[str, str]]:
        u = await call(program, m.MOUNTPROC_DUMP)
        out = []
        while u.boolean():
            out.append((u.string(), u.string()))
        return out

    assert await dump() == [
        ("127.0.0.1", "/srv/a"),
        ("127.0.0.1", "/srv/a/sub"),
        ("10.0.0.1", "/srv/b"),
    ]
    await call(program, m.MOUNTPROC_UMNT, "/srv/a/sub")
    assert len(await dump()) == 2
    await call(program, m.MOUNTPROC_UMNTALL)
    assert await dump() == [("10.0.0.1", "/srv/b")]


async def test_mounting_again_and_again_keeps_one_record(
    exports: list[Export], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that mounts without UMNT adds one DUMP record, and records stay bounded."""
    program = m.MountProgram(exports)
    for _ in range(50):
        await mnt(program, "/srv/a")
    await mnt(program, "/srv/b", peer="10.0.0.1")
    await mnt(program, "/srv/a")  # the newest mount goes last
    assert list(program.mounts) == [("10.0.0.1", "/srv/b"), ("127.0.0.1", "/srv/a")]
    monkeypatch.setattr(m, "MAX_MOUNT_RECORDS", 2)
    await mnt(program, "/srv/a/sub")  # the oldest record is forgotten
    assert list(program.mounts) == [("127.0.0.1", "/srv/a"), ("127.0.0.1", "/srv/a/sub")]


async def test_export_lists_names_and_groups(exports: list[Export]) -> None:
    u = await call(m.MountProgram(exports), m.MOUNTPROC_EXPORT)
    listed = []
    while u.boolean():
        name, groups = u.string(), []
        while u.boolean():
            groups.append(u.string())
        listed.append((name, groups))
    assert listed == [("/srv/a", []), ("/srv/b", ["10.0.0.0/8", "10.1.1.1"])]


async def test_null_and_unknown_procedures(exports: list[Export]) -> None:
    program = m.MountProgram(exports)
    assert (await call(program, m.MOUNTPROC_NULL)).remaining() == 0
    with pytest.raises(ProcUnavailable):
        await call(program, 6)
