"""What the benchmark scripts share: the raw TCP side's reads, stopping the server process."""

from __future__ import annotations

import subprocess
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


def stop_process(server: subprocess.Popen[bytes]) -> None:
    """Close the server's stdin (its signal to end), wait for it, kill it if it hangs."""
    if server.stdin is not None:
        server.stdin.close()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
