"""NFSv3 READDIR and READDIRPLUS: directory listings with cookies that stay valid.

An entry's cookie is a 63-bit hash of its name (``.`` is 1, ``..`` is 2),
and a listing is sent in cookie order: continuing after a cookie means
"entries whose cookie is greater", whatever was added or removed meanwhile
(an entry removed is simply not there; one added before the cookie is not
seen, which RFC 1813 allows). So the cookie verifier never changes, not
even across a restart, and a cookie is never NFS3ERR_BAD_COOKIE.

The count (READDIR) and maxcount (READDIRPLUS) bound the XDR size of the
whole ``READDIR3resok``/``READDIRPLUS3resok``, dircount READDIRPLUS's
entry names, cookies and file ids; all are cut to the FSINFO dtpref. A
first entry that does not fit is NFS3ERR_TOOSMALL.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Final

from rdmashim.ulps.nfsrdma.export import MAY_EXEC, MAY_READ, Node
from rdmashim.ulps.nfsrdma.nfs3_call import DTPREF, Body, Call, PostOp, procedure
from rdmashim.ulps.nfsrdma.nfs3_types import (
    FATTR3_SIZE,
    NFS3ERR_BAD_COOKIE,
    NFS3ERR_NOTDIR,
    NFS3ERR_TOOSMALL,
    READDIR,
    READDIRPLUS,
    Fattr3,
    NfsError,
    pack_post_op_attr,
    pack_post_op_fh3,
    unpack_fh,
)
from rdmashim.ulps.nfsrdma.service import Reply
from rdmashim.ulps.nfsrdma.xdr import Unpacker, pad

COOKIE_VERIFIER: Final = b"rdmashim"
"""The cookie verifier of every directory: cookies never become invalid."""
_RESOK_FIXED: Final = 4 + FATTR3_SIZE + 8 + 4 + 4
"""dir_attributes, cookieverf, the list's final FALSE and eof."""


def cookie_of(name: str) -> int:
    """The cookie of an entry named ``name``: 3 .. 2**63 - 1."""
    digest = hashlib.blake2b(name.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return 3 + int.from_bytes(digest) % ((1 << 63) - 3)


@dataclass(slots=True)
class _Entry:
    cookie: int
    name: str
    fileid: int
    attrs: Fattr3 | None = None
    handle: bytes | None = None

    def size(self) -> int:
        """The XDR size of its ``entry3`` (with the pointer before it)."""
        n = len(self.name.encode("utf-8", "surrogateescape"))
        return 4 + 8 + 4 + n + pad(n) + 8

    def plus_size(self) -> int:
        """The XDR size of what ``entryplus3`` adds: attributes and handle."""
        attrs = 4 + (FATTR3_SIZE if self.attrs is not None else 0)
        fh = self.handle
        return attrs + 4 + (0 if fh is None else 4 + len(fh) + pad(len(fh)))


def _listing(call: Call, node: Node, after: int) -> list[_Entry]:
    """The entries of a directory with cookies greater than ``after``, in cookie order."""
    fd = call.fd(node.listing())
    with os.scandir(fd) as it:
        entries = [_Entry(cookie_of(e.name), e.name, e.inode()) for e in it]
    parent = node.st if not node.path else os.stat("..", dir_fd=node.fd, follow_symlinks=False)
    entries += [_Entry(1, ".", node.st.st_ino), _Entry(2, "..", parent.st_ino)]
    entries.sort(key=lambda e: e.cookie)
    return [e for e in entries if e.cookie > after]


def _add_plus(call: Call, parent: Node, entry: _Entry) -> None:
    """The attributes and handle of an entry (none if it vanished meanwhile)."""
    try:
        child = call.ex.child(parent, entry.name)
    except (OSError, NfsError):
        return
    try:
        entry.attrs = call.ex.fattr(child.st)
        entry.fileid = child.st.st_ino
        entry.handle = call.ex.handle(child)
    finally:
        os.close(child.fd)


def _readdir(call: Call, args: Unpacker, plus: bool) -> Body:
    fh, after, verifier = unpack_fh(args), args.uhyper(), args.fopaque(8)
    dircount = args.uint()
    maxcount = args.uint() if plus else dircount
    node = call.node(fh)
    post = call.fail[0] = PostOp(node)
    if not node.is_dir:
        raise NfsError(NFS3ERR_NOTDIR)
    call.caller.require(node.st, MAY_READ)
    if after and verifier != COOKIE_VERIFIER:
        raise NfsError(NFS3ERR_BAD_COOKIE)
    with_attrs = plus and call.caller.may(node.st, MAY_EXEC)
    maxcount, dircount = min(maxcount, DTPREF), min(dircount, DTPREF)
    size, names_size, chosen = _RESOK_FIXED, 0, []
    eof = True
    for entry in _listing(call, node, after):
        if with_attrs:
            _add_plus(call, node, entry)
        entry_size = entry.size() + (entry.plus_size() if plus else 0)
        if size + entry_size > maxcount or names_size + entry.size() > dircount:
            eof = False
            break
        chosen.append(entry)
        size += entry_size
        names_size += entry.size()
    if not chosen and not eof:
        raise NfsError(NFS3ERR_TOOSMALL)

    def body(reply: Reply) -> None:
        p = reply.packer
        post.pack(p, call.export)
        p.fopaque(COOKIE_VERIFIER, 8)
        for entry in chosen:
            p.boolean(True)
            p.uhyper(entry.fileid)
            p.string(entry.name)
            p.uhyper(entry.cookie)
            if plus:
                pack_post_op_attr(p, entry.attrs)
                pack_post_op_fh3(p, entry.handle)
        p.boolean(False)
        p.boolean(eof)

    return body


@procedure(READDIR, "a")
def readdir(call: Call, args: Unpacker) -> Body:
    """READDIR: names, file ids and cookies."""
    return _readdir(call, args, plus=False)


@procedure(READDIRPLUS, "a")
def readdirplus(call: Call, args: Unpacker) -> Body:
    """READDIRPLUS: READDIR with each entry's attributes and handle."""
    return _readdir(call, args, plus=True)
