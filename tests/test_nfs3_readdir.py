"""READDIR and READDIRPLUS: cookies that survive concurrent changes, count limits as XDR size."""

from __future__ import annotations

import os
from pathlib import Path

import test_nfs3
from test_nfs3 import Args, Client

from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.xdr import Unpacker

client, export_dir, program, root_fh = (
    test_nfs3.client,
    test_nfs3.export_dir,
    test_nfs3.program,
    test_nfs3.root_fh,
)


async def _names(client: Client, fh: bytes, count: int = 8192) -> list[str]:
    """Every name, page by page."""
    names, cookie, eof, verf = [], 0, False, bytes(8)
    while not eof:
        entries, eof, verf = await client.readdir(fh, cookie, count, verf)
        names += [name for name, _ in entries]
        cookie = entries[-1][1] if entries else cookie
    return names


async def test_lists_every_entry_with_dots(
    client: Client, root_fh: bytes, export_dir: Path
) -> None:
    for i in range(50):
        (export_dir / f"file{i}").touch()
    names = await _names(client, root_fh, count=512)
    assert sorted(names) == sorted([".", "..", *(f"file{i}" for i in range(50))])


async def test_cookies_stay_valid_while_entries_change(
    client: Client, root_fh: bytes, export_dir: Path
) -> None:
    for i in range(40):
        (export_dir / f"old{i}").touch()
    first, eof, verf = await client.readdir(root_fh, 0, 400)
    assert not eof
    seen = {name for name, _ in first}
    for i in range(40):  # remove some not yet seen and some seen, add new ones
        if i % 3 == 0:
            os.unlink(export_dir / f"old{i}")
        (export_dir / f"new{i}").touch()
    rest, cookie, eof = [], first[-1][1], False
    while not eof:
        entries, eof, _ = await client.readdir(root_fh, cookie, 400, verf)
        rest += [name for name, _ in entries]
        cookie = entries[-1][1] if entries else cookie
    assert not seen & set(rest)  # nothing twice
    survivors = {f"old{i}" for i in range(40) if i % 3} | {".", ".."}
    assert survivors <= seen | set(rest)  # nothing that stayed is lost
    assert not {f"old{i}" for i in range(0, 40, 3)} & set(rest)


async def test_a_wrong_cookie_verifier_is_bad_cookie(client: Client, root_fh: bytes) -> None:
    args = Args().fh(root_fh).u64(5).raw(b"badverf!").u32(4096)
    assert await client.status(t.READDIR, args) == t.NFS3ERR_BAD_COOKIE


async def test_count_bounds_the_xdr_size(client: Client, root_fh: bytes, export_dir: Path) -> None:
    for i in range(30):
        (export_dir / ("n" * (i % 7 + 1) + str(i))).touch()
    for count in (140, 200, 333, 1000, 4096):
        reply = await client.raw(
            t.READDIR, Args().fh(root_fh).u64(0).raw(bytes(8)).u32(count).bytes()
        )
        assert len(b"".join(reply.inline())) - 4 <= count
    small = Args().fh(root_fh).u64(0).raw(bytes(8)).u32(100)
    assert await client.status(t.READDIR, small) == t.NFS3ERR_TOOSMALL


async def test_readdirplus_attributes_handles_and_limits(
    client: Client, root_fh: bytes, export_dir: Path
) -> None:
    fh = await client.create(root_fh, "f")
    await client.write(fh, 0, b"12345")
    for i in range(20):
        (export_dir / f"x{i}").mkdir()
    for maxcount in (400, 1000, 8192):
        names, cookie, eof = [], 0, False
        while not eof:
            args = Args().fh(root_fh).u64(cookie).raw(b"rdmashim" if cookie else bytes(8))
            reply = await client.raw(t.READDIRPLUS, args.u32(maxcount, maxcount).bytes())
            data = b"".join(reply.inline())
            assert len(data) - 4 <= maxcount
            u = Unpacker(data)
            assert u.uint() == t.NFS3_OK
            t.unpack_post_op_attr(u)
            u.fopaque(8)
            while u.boolean():
                fileid, name, cookie = u.uhyper(), u.string(), u.uhyper()
                attrs, handle = t.unpack_post_op_attr(u), t.unpack_post_op_fh3(u)
                assert attrs is not None and attrs.fileid == fileid
                if name == "f":
                    assert (handle, attrs.size) == (fh, 5)
                names.append(name)
            eof = u.boolean()
        assert len(names) == 23
    dircount = Args().fh(root_fh).u64(0).raw(bytes(8)).u32(10, 8192)
    assert await client.status(t.READDIRPLUS, dircount) == t.NFS3ERR_TOOSMALL


async def test_readdir_of_a_file_is_notdir(client: Client, root_fh: bytes) -> None:
    fh = await client.create(root_fh, "f")
    assert await client.status(t.READDIR, Args().fh(fh).u64(0).raw(bytes(8)).u32(4096)) == (
        t.NFS3ERR_NOTDIR
    )
