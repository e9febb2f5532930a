"""Malformed NFSv3 arguments: every truncation is an XdrError, every corruption an XdrError or a
result (never another exception), and the program keeps working afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_nfs3
from test_nfs3 import Args, Client

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.xdr import XdrError

client, export_dir, program, root_fh = (
    test_nfs3.client,
    test_nfs3.export_dir,
    test_nfs3.program,
    test_nfs3.root_fh,
)


async def calls(client: Client, root: bytes) -> dict[int, bytes]:
    """A valid call of every procedure but NULL."""
    fh = await client.create(root, "f")
    await client.mkdir(root, "d")
    s = t.Sattr3(mode=0o644, size=0, atime=t.SERVER_TIME, mtime=(1, 2))
    built = {
        t.GETATTR: Args().fh(fh),
        t.SETATTR: Args().fh(fh).sattr(s).u32(1, 0, 0),
        t.LOOKUP: Args().dirop(root, "f"),
        t.ACCESS: Args().fh(fh).u32(0x3F),
        t.READLINK: Args().fh(fh),
        t.READ: Args().fh(fh).u64(0).u32(10),
        t.WRITE: Args().fh(fh).u64(0).u32(3, t.FILE_SYNC).opaque(b"abc"),
        t.CREATE: Args().dirop(root, "g").u32(t.UNCHECKED).sattr(s),
        t.MKDIR: Args().dirop(root, "e").sattr(s),
        t.SYMLINK: Args().dirop(root, "l").sattr(s).opaque("target"),
        t.MKNOD: Args().dirop(root, "c").u32(t.NF3CHR).sattr(s).u32(1, 3),
        t.REMOVE: Args().dirop(root, "g"),
        t.RMDIR: Args().dirop(root, "e"),
        t.RENAME: Args().dirop(root, "f").dirop(root, "f2"),
        t.LINK: Args().fh(fh).dirop(root, "h"),
        t.READDIR: Args().fh(root).u64(0).raw(bytes(8)).u32(4096),
        t.READDIRPLUS: Args().fh(root).u64(0).raw(bytes(8)).u32(1024, 4096),
        t.FSSTAT: Args().fh(root),
        t.FSINFO: Args().fh(root),
        t.PATHCONF: Args().fh(root),
        t.COMMIT: Args().fh(fh).u64(0).u32(0),
    }
    return {proc: args.bytes() for proc, args in built.items()}


async def test_every_truncation_is_garbage(client: Client, root_fh: bytes) -> None:
    for proc, args in (await calls(client, root_fh)).items():
        for end in range(len(args)):
            with pytest.raises(XdrError):
                await client.raw(proc, args[:end])
    assert (await client.getattr(root_fh)).ftype == t.NF3DIR


async def test_every_corruption_is_garbage_or_a_result(
    client: Client, root_fh: bytes, export_dir: Path
) -> None:
    for proc, args in (await calls(client, root_fh)).items():
        for i in range(len(args)):
            for value in (0xFF, 0x01):
                bad = bytearray(args)
                bad[i] ^= value
                try:
                    reply = await client.raw(proc, bytes(bad))
                except XdrError:
                    continue
                assert len(reply.packer.data) >= 4
    assert (await client.getattr(root_fh)).ftype == t.NF3DIR
    assert (export_dir / "outside").exists() is False
