"""What the benchmark scripts share for their raw TCP side."""

from __future__ import annotations

from typing import Any


async def read_exact(sock: Any, view: memoryview) -> bool:
    """Fill ``view`` from the trio socket ``sock``; False on EOF before the first byte.

    EOF in the middle raises EOFError.
    """
    got = 0
    while got < len(view):
        n = await sock.recv_into(view[got:])
        if not n:
            if got:
                raise EOFError("connection closed mid-message")
            return False
        got += n
    return True
