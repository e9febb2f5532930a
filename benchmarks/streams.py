"""What the benchmark scripts share: the raw TCP side's reads (those of ``rdmashim perf
--vs-tcp``), stopping the server process."""

from __future__ import annotations

import subprocess

from rdmashim.perftools.rawtcp import count_to_eof, read_exact

__all__ = ["count_to_eof", "read_exact", "stop_process"]


def stop_process(server: subprocess.Popen[bytes]) -> None:
    """Close the server's stdin (its signal to end), wait for it, kill it if it hangs."""
    if server.stdin is not None:
        server.stdin.close()
    try:
        server.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
