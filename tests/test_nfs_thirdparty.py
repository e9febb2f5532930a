"""A third-party NFS client against our server: pyNfsClient (pure Python) over TCP.

pyNfsClient speaks portmap, MOUNT v3 and NFSv3 over TCP with AUTH_UNIX,
written by others from the RFCs, so it checks our encoding against a reading
of the protocol that is not ours. It is synchronous: it runs in a thread while
the server runs in the trio loop. It asks our rpcbind (on its own port, not
111) for the MOUNT and NFS ports, mounts, then lists, looks up, reads a file
placed on disk, creates and writes one, makes, renames and removes, and asks
FSSTAT, FSINFO and PATHCONF; every result is checked against the directory.

Two things of the library's own shape the test works around: as root it
binds a reserved source port (500..1023) and, not root, it retries that
forever, so a test run without root connects from an ordinary port (our
server takes insecure ports); and its WRITE sends ``str(content).encode()``,
so only text can be written with it (UTF-8 bytes, checked on disk).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

if sys.version_info >= (3, 13):
    pytest.skip("pyNfsClient needs xdrlib, which Python 3.13 removed", allow_module_level=True)

from pyNfsClient import (
    FILE_SYNC,
    GUARDED,
    MNT3_OK,
    MOUNT_PROGRAM,
    MOUNT_V3,
    NF3DIR,
    NF3LNK,
    NF3REG,
    NFS3_OK,
    NFS3ERR_EXIST,
    NFS3ERR_NOENT,
    NFS3ERR_NOTEMPTY,
    NFS_PROGRAM,
    NFS_V3,
    RPC,
    UNSTABLE,
    Mount,
    NFSv3,
    Portmap,
)
from test_nfs_server import UID, nfs_server

from rdmashim.ulps.nfsrdma.server import Serving

HOST = "127.0.0.1"
TIMEOUT = 30  # seconds the library waits on its socket
AUTH = {"flavor": 1, "machine_name": "thirdparty", "uid": UID, "gid": UID, "aux_gid": [UID]}
TEXT = "ünïcode tëxt ✓ over NFSv3\n" * 3000  # about 90 kB: several TCP segments
PLACED = os.urandom(2_500_000)  # over the server's rtmax: read in pieces


def connect(rpc: Any) -> None:
    """Connect the library's socket: its own way as root, from any port otherwise."""
    if os.geteuid() == 0:
        rpc.connect()  # from a reserved port, as the library means to
        assert rpc.client_port is not None and rpc.client_port < 1024
        return
    rpc.client = socket.create_connection((rpc.host, rpc.port), rpc.timeout)
    RPC.connections.append(rpc)


def succeeded(result: dict[str, Any]) -> None:
    """A result that must have succeeded (some of the library's have no ``resok``)."""
    assert result["status"] == NFS3_OK, result


def ok(result: dict[str, Any]) -> dict[str, Any]:
    """The ``resok`` of a result that must have succeeded."""
    succeeded(result)
    return result["resok"]


def getattr_ok(nfs: Any, fh: bytes) -> dict[str, Any]:
    """The attributes of ``fh`` (the library's GETATTR result has no ``resok``)."""
    result = nfs.getattr(fh)
    assert result["status"] == NFS3_OK, result
    return result["attributes"]


def entries(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of a READDIR(PLUS) reply, which the library nests one in the next."""
    found = []
    chain = reply["entries"]
    while chain:
        found.append(chain[0])
        chain = chain[0]["nextentry"]
    return found


def list_all(nfs: Any, root: bytes, plus: bool) -> list[dict[str, Any]]:
    """Every entry of ``root``, a small page at a time, the cookie verifier given back."""
    found: list[dict[str, Any]] = []
    cookie, verifier = 0, "\0" * 8
    while True:
        if plus:
            page = ok(nfs.readdirplus(root, cookie, verifier, dircount=512, maxcount=2048))
        else:
            page = ok(nfs.readdir(root, cookie, verifier, count=512))
        more = entries(page["reply"])
        found += more
        if page["reply"]["eof"]:
            return found
        assert more
        cookie = more[-1]["cookie"]
        verifier = page["cookieverf"].decode("latin-1")  # the library takes a str


def session(serving: Serving, export: Path) -> None:
    """What a person would do with the library, checked against ``export`` on disk."""
    assert serving.rpcbind_port is not None
    portmap = Portmap(HOST, timeout=TIMEOUT)
    portmap.port = serving.rpcbind_port
    connect(portmap)
    try:
        mount_port = portmap.getport(MOUNT_PROGRAM, MOUNT_V3)
        nfs_port = portmap.getport(NFS_PROGRAM, NFS_V3)
        listed = {(m["program"], m["version"], m["protocol"], m["port"]) for m in portmap.dump()}
    finally:
        portmap.disconnect()
    assert mount_port == nfs_port == serving.tcp_port
    assert (NFS_PROGRAM, NFS_V3, "tcp", nfs_port) in listed
    assert (MOUNT_PROGRAM, MOUNT_V3, "tcp", mount_port) in listed

    mount = Mount(HOST, mount_port, TIMEOUT, AUTH)
    connect(mount)
    nfs = NFSv3(HOST, nfs_port, TIMEOUT, AUTH)
    connect(nfs)
    try:
        assert [e.ex_dir for e in mount.export()] == [serving.export.encode()]
        assert mount.mnt("/etc")["status"] != MNT3_OK  # not exported
        mounted = mount.mnt(serving.export)
        assert mounted["status"] == MNT3_OK, mounted
        root = mounted["mountinfo"]["fhandle"]
        files(nfs, root, export)
        directories(nfs, root, export)
        filesystem(nfs, root, export)
        assert mount.umnt()["status"] == MNT3_OK
    finally:
        nfs.disconnect()
        mount.disconnect()


def files(nfs: Any, root: bytes, export: Path) -> None:
    """GETATTR, LOOKUP, READ of a placed file; CREATE, WRITE, COMMIT, SETATTR, LINK."""
    attrs = getattr_ok(nfs, root)
    assert attrs["type"] == NF3DIR and attrs["fileid"] == export.stat().st_ino

    found = ok(nfs.lookup(root, "placed.bin"))
    fh = found["object"]["data"]
    assert found["obj_attributes"]["attributes"]["size"] == len(PLACED)
    assert nfs.lookup(root, "missing")["status"] == NFS3ERR_NOENT
    got = b""
    while True:
        piece = ok(nfs.read(fh, len(got), 1 << 20))
        assert piece["count"] == len(piece["data"])
        got += piece["data"]
        if piece["eof"]:
            break
    assert got == PLACED
    tail = ok(nfs.read(fh, len(PLACED) - 10, 100))
    assert tail["data"] == PLACED[-10:] and tail["eof"]

    created = ok(nfs.create(root, "written.txt", GUARDED, mode=0o640))
    new = created["obj"]["handle"]["data"]
    assert created["obj_attributes"]["attributes"]["type"] == NF3REG
    assert nfs.create(root, "written.txt", GUARDED, mode=0o640)["status"] == NFS3ERR_EXIST
    data = TEXT.encode()
    half = len(TEXT) // 2
    first = ok(nfs.write(new, 0, len(TEXT[:half].encode()), TEXT[:half], UNSTABLE))
    second = ok(nfs.write(new, first["count"], len(TEXT[half:].encode()), TEXT[half:], FILE_SYNC))
    assert first["count"] + second["count"] == len(data)
    assert first["verf"] == ok(nfs.commit(new))["verf"]
    assert (export / "written.txt").read_bytes() == data
    assert (export / "written.txt").stat().st_mode & 0o777 == 0o640
    assert ok(nfs.read(new, 0, len(data)))["data"] == data

    succeeded(nfs.setattr(new, mode=0o600, size=100))
    on_disk = (export / "written.txt").stat()
    assert on_disk.st_mode & 0o777 == 0o600 and on_disk.st_size == 100
    assert getattr_ok(nfs, new)["size"] == 100

    succeeded(nfs.link(new, root, "hard.txt"))
    assert (export / "hard.txt").stat().st_ino == on_disk.st_ino


def directories(nfs: Any, root: bytes, export: Path) -> None:
    """READDIR, READDIRPLUS by pages; MKDIR, RENAME, REMOVE, RMDIR; SYMLINK, READLINK."""
    for plus in (False, True):
        listed = list_all(nfs, root, plus)
        names = [e["name"].decode() for e in listed]
        assert sorted(names) == sorted([".", "..", *os.listdir(export)])
        assert len({e["cookie"] for e in listed}) == len(listed)
        for entry in listed:
            if entry["name"] in (b".", b".."):
                continue
            assert entry["fileid"] == (export / entry["name"].decode()).lstat().st_ino
            if plus:  # the handle it gives is one the server takes back
                handle = entry["name_handle"]["handle"]["data"]
                assert getattr_ok(nfs, handle)["fileid"] == entry["fileid"]

    made = ok(nfs.mkdir(root, "sub", mode=0o750))
    sub = made["obj"]["handle"]["data"]
    assert (export / "sub").is_dir() and (export / "sub").stat().st_mode & 0o777 == 0o750
    succeeded(nfs.rename(root, "written.txt", sub, "moved.txt"))
    assert not (export / "written.txt").exists() and (export / "sub/moved.txt").is_file()
    assert nfs.rmdir(root, "sub")["status"] == NFS3ERR_NOTEMPTY
    succeeded(nfs.remove(sub, "moved.txt"))
    assert not (export / "sub/moved.txt").exists()
    succeeded(nfs.rmdir(root, "sub"))
    assert not (export / "sub").exists()

    link = ok(nfs.symlink(root, "link", "placed.bin"))
    assert link["obj_attributes"]["attributes"]["type"] == NF3LNK
    assert os.readlink(export / "link") == "placed.bin"
    assert ok(nfs.readlink(link["obj"]["handle"]["data"]))["data"] == b"placed.bin"
    succeeded(nfs.remove(root, "link"))
    assert not os.path.lexists(export / "link")


def filesystem(nfs: Any, root: bytes, export: Path) -> None:
    """FSSTAT, FSINFO and PATHCONF against the file system the export is on."""
    stat = ok(nfs.fsstat(root))
    vfs = os.statvfs(export)
    assert stat["tbytes"] == vfs.f_blocks * vfs.f_frsize
    assert 0 < stat["abytes"] <= stat["fbytes"] <= stat["tbytes"]
    info = ok(nfs.fsinfo(root))
    assert info["rtmax"] >= info["rtpref"] > 0 and info["wtmax"] >= info["wtpref"] > 0
    conf = ok(nfs.pathconf(root))
    assert conf["name_max"] == 255 and conf["no_trunc"]


async def in_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run the synchronous library in a thread; the trio loop goes on serving."""
    with trio.fail_after(120):
        await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)


async def test_pynfsclient_mounts_reads_writes_and_lists(tmp_path: Path) -> None:
    async with nfs_server(tmp_path) as (serving, export):
        (export / "placed.bin").write_bytes(PLACED)
        if os.geteuid() == 0:
            os.chown(export / "placed.bin", UID, UID)
        for i in range(40):  # more names than one small READDIR page holds
            (export / f"name-{i:02d}").touch()
        await in_thread(session, serving, export)
