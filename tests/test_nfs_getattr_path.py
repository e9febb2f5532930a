"""The short ways a GETATTR takes through the server, each against what the long way gives.

The encoded ``fattr3`` an export keeps by the stat it was made of (changed
files on disk are encoded again), the root's attributes taken without a
descriptor of its own, the credential found by its bytes in the call (a call
cut short, or with a bad credential, is decoded and refused as before), and
the XDR reads without their helpers.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_nfs3 import Args, Client, make_program
from test_nfs_rpc_server import ME, PEER, XID, call_bytes, opaque, words

from rdmashim.ulps.nfsrdma import export as export_module
from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.handles import ObjectId
from rdmashim.ulps.nfsrdma.nfs3 import Nfs3Program
from rdmashim.ulps.nfsrdma.rpc import NULL_AUTH, AuthStat, OpaqueAuth, RpcServer, auth_error
from rdmashim.ulps.nfsrdma.service import AuthSys, CallContext, Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker, XdrError


@pytest.fixture
def export(tmp_path: Path) -> Iterator[Export]:
    (tmp_path / "export").mkdir()
    ex = Export(tmp_path / "export", state_dir=tmp_path / "state")
    yield ex
    ex.close()


@dataclass
class Served:
    """An NFS program over a fresh export directory, a client of it as this process's
    user, and the root's handle."""

    program: Nfs3Program
    client: Client
    root_fh: bytes
    export_dir: Path

    @property
    def export(self) -> Export:
        return self.program.exports[0]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    program = make_program(export_dir, tmp_path / "state", root_squash=False)
    export = program.exports[0]
    root = export.root()
    try:
        root_fh = export.handle(root)
    finally:
        os.close(root.fd)
    yield Served(program, Client(program, uid=os.getuid(), gid=os.getgid()), root_fh, export_dir)
    export.close()


def encoded_now(export: Export, path: Path) -> tuple[bytes, bytes]:
    """What the export gives for the file's stat now, and a fresh encoding of it."""
    st = os.stat(path, follow_symlinks=False)
    return export.fattr3_bytes(st), t.fattr3_bytes(st, export.export_id)


def test_kept_attributes_follow_every_change_of_a_file(export: Export) -> None:
    path = export.path / "f"
    path.write_bytes(b"x")
    first, fresh = encoded_now(export, path)
    assert first == fresh
    assert encoded_now(export, path)[0] is first  # unchanged: kept, not encoded again
    changes = [
        lambda: path.write_bytes(b"longer"),  # size, mtime
        lambda: os.chmod(path, 0o600),  # mode, ctime
        lambda: os.chmod(path, 0o640),  # within the same clock tick, maybe
        lambda: os.utime(path, ns=(1_000_000_001, 2_000_000_002)),
        lambda: os.utime(path, ns=(1_000_000_001, 2_000_000_003)),  # one nanosecond
        lambda: os.link(path, export.path / "g"),  # nlink
        lambda: os.truncate(path, 1 << 20),  # size, not blocks
    ]
    seen = {first}
    for change in changes:
        change()
        kept, fresh = encoded_now(export, path)
        assert kept == fresh
        assert kept not in seen
        seen.add(kept)


def test_kept_attributes_are_per_object_and_bounded(
    export: Export, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export_module, "ENCODED_ATTRS", 4)
    paths = [export.path / f"f{i}" for i in range(10)]
    for i, path in enumerate(paths):
        path.write_bytes(bytes(i))
        os.utime(path, ns=(5, 7))  # the same times: only the inode and size tell them apart
    for path in paths:
        kept, fresh = encoded_now(export, path)
        assert kept == fresh
        assert len(export._encoded) <= 4


async def test_getattr_sees_a_file_changed_between_calls(served: Served) -> None:
    client, root_fh, export_dir = served.client, served.root_fh, served.export_dir
    fh = await client.create(root_fh, "f", 0o644)
    for mode in (0o600, 0o640, 0o604):  # quicker than a clock tick, one after another
        os.chmod(export_dir / "f", mode)
        assert (await client.getattr(fh)).mode == mode
    (export_dir / "f").write_bytes(b"12345")
    attrs = await client.getattr(fh)
    assert attrs.size == 5
    assert attrs.mtime == divmod(os.stat(export_dir / "f").st_mtime_ns, 1_000_000_000)
    os.utime(export_dir, ns=(time.time_ns(), 123))
    assert (await client.getattr(root_fh)).mtime == (0, 123)


async def test_getattr_holds_no_descriptor_and_knows_a_stale_root(served: Served) -> None:
    client, root_fh, export = served.client, served.root_fh, served.export
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        await client.getattr(root_fh)
    assert len(os.listdir("/proc/self/fd")) == before
    oid = export.codec.decode(root_fh)
    assert export.stat(root_fh).st_ino == os.stat(served.export_dir).st_ino
    if export.resolver.root_gen:  # a file system that tells generations
        other = ObjectId(oid.dev, oid.ino, (export.resolver.root_gen + 1) & 0xFFFFFFFF)
        with pytest.raises(t.NfsError) as info:
            export.resolver.stat(other)
        assert info.value.status == t.NFS3ERR_STALE


async def test_getattr_of_a_removed_file_is_stale_and_of_a_bad_handle_badhandle(
    served: Served,
) -> None:
    client, root_fh = served.client, served.root_fh
    fh = await client.create(root_fh, "gone", 0o644)
    os.unlink(served.export_dir / "gone")
    assert await client.status(t.GETATTR, Args().fh(fh)) == t.NFS3ERR_STALE
    forged = fh[:-1] + bytes([fh[-1] ^ 1])  # its MAC no longer matches
    assert await client.status(t.GETATTR, Args().fh(forged)) == t.NFS3ERR_BADHANDLE


# -- the credential found by its bytes ---------------------------------------------------------


def getattr_call(fh: bytes, cred: OpaqueAuth, verf: OpaqueAuth = NULL_AUTH) -> bytes:
    return call_bytes(t.GETATTR, opaque(fh), prog=t.NFS_PROGRAM, vers=3, cred=cred, verf=verf)


def reply_bytes(answer: object) -> bytes:
    assert isinstance(answer, Reply)
    return b"".join(answer.inline())


def test_a_kept_credential_never_answers_a_call_cut_short(served: Served) -> None:
    server, root_fh = RpcServer([served.program]), served.root_fh
    whole = getattr_call(root_fh, OpaqueAuth.sys(ME))
    good = reply_bytes(server.call_now(memoryview(whole), PEER, "rdma"))
    assert struct.unpack_from(">I", good, 24)[0] == t.NFS3_OK
    assert reply_bytes(server.call_now(memoryview(whole), PEER, "rdma")) == good  # kept
    cred_len = len(OpaqueAuth.sys(ME).body)
    for end in range(24, 24 + 8 + cred_len + 8):  # cut in the credential or the verifier
        answer = reply_bytes(server.call_now(memoryview(whole[:end]), PEER, "rdma"))
        stat = AuthStat.AUTH_BADCRED if end < 24 + 8 + cred_len else AuthStat.AUTH_BADVERF
        assert answer == reply_bytes(auth_error(XID, stat)), end


def test_credentials_kept_apart_and_bad_ones_refused_every_time(served: Served) -> None:
    program, root_fh = served.program, served.root_fh
    server = RpcServer([program])
    bad = [
        (OpaqueAuth(3, b"dh"), AuthStat.AUTH_BADCRED),  # AUTH_DH: not spoken here
        (OpaqueAuth(1, b"\0\0\0\1"), AuthStat.AUTH_BADCRED),  # an AUTH_SYS body cut short
    ]
    for cred, stat in bad * 2:
        answer = server.call_now(memoryview(getattr_call(root_fh, cred)), PEER, "tcp")
        assert reply_bytes(answer) == reply_bytes(auth_error(XID, stat))
    answer = server.call_now(
        memoryview(getattr_call(root_fh, OpaqueAuth.sys(ME), OpaqueAuth(1, b"v"))), PEER, "tcp"
    )
    assert reply_bytes(answer) == reply_bytes(auth_error(XID, AuthStat.AUTH_BADVERF))
    seen: list[AuthSys | None] = []

    def whoami(ctx: CallContext, args: Unpacker, reply: Reply) -> bool:
        seen.append(ctx.cred)
        return True

    program.dispatch_now = whoami  # type: ignore[method-assign]
    server = RpcServer([program])
    other = AuthSys(stamp=5, machinename="client", uid=1001, gid=100, gids=(100, 27))
    for cred in (ME, other, ME, other):
        server.call_now(memoryview(getattr_call(root_fh, OpaqueAuth.sys(cred))), PEER, "tcp")
    server.call_now(memoryview(getattr_call(root_fh, OpaqueAuth())), PEER, "tcp")
    assert seen == [ME, other, ME, other, None]


# -- XDR reads -----------------------------------------------------------------------------------


def test_xdr_uint_and_opaque_at_every_length_and_cut() -> None:
    for n in range(9):
        data = bytes(range(1, n + 1))
        message = opaque(data) + words(7)
        u = Unpacker(message)
        assert bytes(u.opaque_view(8)) == data
        assert u.uint() == 7
        assert u.remaining() == 0
        for cut in range(len(message) - 4):
            u = Unpacker(message[:cut])
            with pytest.raises(XdrError):
                u.opaque_view(8)
        if n & 3:
            dirty = bytearray(message)
            dirty[4 + n] = 1  # the first byte of padding
            with pytest.raises(XdrError, match="padding"):
                Unpacker(dirty).opaque_view(8)
    with pytest.raises(XdrError):
        Unpacker(opaque(b"123456789")).opaque_view(8)
    u = Unpacker(words(1, 2), 4)
    assert u.uint() == 2
    with pytest.raises(XdrError):
        u.uint()
    with pytest.raises(XdrError):
        Unpacker(b"abc").fopaque_view(-1)
