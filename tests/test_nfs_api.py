"""What ``rdmashim.ulps.nfsrdma`` offers by name, and the enums its values come as."""

from __future__ import annotations

import importlib

import pytest

import rdmashim.ulps.nfsrdma as nfsrdma
from rdmashim.ulps.nfsrdma import nfs3_types as t
from rdmashim.ulps.nfsrdma.client import NfsError, status_name
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker, XdrError


def test_the_package_exports_its_public_classes_by_their_module_names() -> None:
    homes = {
        "NfsClient": "client", "NfsError": "client", "MountError": "client",
        "list_exports": "client", "split_remote": "client", "ServerUnreachable": "client",
        "Export": "export",
        "ServerConfig": "server", "Serving": "server", "serve_nfs": "server",
        "mount_command": "server", "NFS_TCP_PORT": "server", "NFS_RDMA_PORT": "server",
        "Fattr3": "nfs3_types", "FType3": "nfs3_types", "Nfsstat3": "nfs3_types",
    }  # fmt: skip
    assert sorted(nfsrdma.__all__) == sorted(homes)
    for name, module in homes.items():
        home = importlib.import_module(f"rdmashim.ulps.nfsrdma.{module}")
        assert getattr(nfsrdma, name) is getattr(home, name), name
    namespace: dict[str, object] = {}
    exec("from rdmashim.ulps.nfsrdma import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(homes)


def attributes(ftype: int) -> bytes:
    a = t.Fattr3(t.FType3.DIR, 0o755, 2, 0, 0, 4096, 4096, (0, 0), 7, 9, (1, 2), (3, 4), (5, 6))
    p = Packer()
    t.pack_fattr3(p, a)
    return ftype.to_bytes(4, "big") + bytes(p.data[4:])


def test_ftype_is_an_enum_with_the_wire_values_unchanged() -> None:
    assert [int(f) for f in t.FType3] == list(range(1, 8))
    assert (t.NF3REG, t.NF3DIR, t.NF3LNK, t.NF3FIFO) == (1, 2, 5, 7)
    encoded = attributes(2)
    assert encoded[:8] == bytes.fromhex("00000002000001ed")  # ftype 2, then mode 0755
    decoded = t.unpack_fattr3(Unpacker(encoded))
    assert decoded.ftype is t.FType3.DIR and repr(decoded.ftype) == "<FType3.DIR: 2>"
    p = Packer()
    t.pack_fattr3(p, decoded)
    assert bytes(p.data) == encoded
    for bad in (0, 8, 0xFFFFFFFF):
        with pytest.raises(XdrError, match=f"ftype3 {bad}"):
            t.unpack_fattr3(Unpacker(attributes(bad)))


def test_nfs_statuses_are_an_enum_and_an_error_carries_its_member() -> None:
    assert t.NFS3ERR_NOENT is t.Nfsstat3.NFS3ERR_NOENT and t.NFS3ERR_NOENT == 2
    error = NfsError(2, "/x")
    assert error.status is t.Nfsstat3.NFS3ERR_NOENT
    assert str(error) == "NFS3ERR_NOENT: no such file or directory: /x"
    odd = NfsError(12345)
    assert type(odd.status) is int and odd.status == 12345
    assert str(odd) == "nfsstat3 12345: error"
    assert status_name(10008) == "NFS3ERR_JUKEBOX" and status_name(3) == "nfsstat3 3"
    assert str(t.NfsError(70, "gone")) == "nfsstat3 70: gone"  # the server's own, unchanged
