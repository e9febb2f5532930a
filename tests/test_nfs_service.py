"""The program/transport seam: DDP-eligible items spliced inline for TCP."""

from __future__ import annotations

from rdmashim.ulps.nfsrdma.service import Reply


def test_inline_splices_ddp_items_with_their_padding() -> None:
    reply = Reply()
    reply.packer.uint(1)
    reply.opaque_ddp(b"hello")
    reply.packer.uint(2)
    assert reply.ddp[0][0] == 8  # after the status word and the length word
    assert b"".join(reply.inline()) == (b"\0\0\0\x01" + b"\0\0\0\x05hello\0\0\0" + b"\0\0\0\x02")


def test_inline_without_ddp_items_is_the_stream() -> None:
    reply = Reply()
    reply.packer.opaque(b"abcd")
    assert b"".join(reply.inline()) == b"\0\0\0\x04abcd"
    assert Reply().inline() == []
