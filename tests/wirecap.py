"""Capture a soft-iWARP connection with tcpdump and judge it with tshark (``tools/wirejudge.py``).

Helpers for ``tests/test_wire.py``:

* :func:`missing_requirements`: whether this machine can capture and judge
  (root, tcpdump, tshark).
* :func:`tcpdump`: an async context manager that captures ``tcp port PORT`` on ``lo``
  while its body runs, started before any byte of the connection so that the MPA
  Request and Reply are in the capture, and stopped only after its last block is
  written (see :data:`DRAIN_DELAY`).
* :func:`open_listener`: a listener created before the capture starts, so its port
  is known; pass it to ``pairs.make_pair(listener=...)``.
* :func:`judge_capture`: run the project's wire judge and return its exit code and JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

JUDGE = Path(__file__).resolve().parent.parent / "tools" / "wirejudge.py"
"""The wire judge (tshark's dissectors and the RFC rules tshark does not check)."""
STARTUP_TIMEOUT = 10.0
"""Seconds to wait for tcpdump's "listening on"."""
DRAIN_DELAY = 1.5
"""Seconds between the last packet and SIGINT (TPACKET_V3 drops the last block otherwise)."""
STOP_TIMEOUT = 10.0
BUFFER_KIB = 64 * 1024
"""Kernel capture buffer: lo carries 64 KiB segments, and tcpdump's default 2 MiB drops some."""


def missing_requirements() -> str | None:
    """Why a wire test cannot run here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "wire capture needs root (tcpdump on lo)"
    for tool in ("tcpdump", "tshark"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install -y tshark tcpdump)"
    return None


@dataclass
class Capture:
    """A finished (or running) capture."""

    path: Path
    port: int
    stderr: str = ""
    returncode: int | None = None

    @property
    def dropped(self) -> int | None:
        """Packets the kernel dropped, from tcpdump's closing statistics."""
        m = re.search(r"(\d+) packets? dropped by kernel", self.stderr)
        return int(m.group(1)) if m else None


@asynccontextmanager
async def tcpdump(
    path: Path, port: int, interface: str = "lo", netns: str | None = None
) -> AsyncIterator[Capture]:
    """Capture ``tcp port PORT`` on ``interface`` (in network namespace ``netns``) into ``path``.

    ``ip netns exec`` execs tcpdump in place, so the SIGINT that stops it reaches it.
    """
    cap = Capture(path, port)
    cmd = ["ip", "netns", "exec", netns] if netns else []
    cmd += [
        "tcpdump", "-i", interface, "-w", str(path), "--immediate-mode", "-U",
        "-s", "0", "-B", str(BUFFER_KIB), "-Z", "root", f"tcp port {port}",
    ]  # fmt: skip
    proc = await trio.lowlevel.open_process(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    err = bytearray()
    try:
        with trio.move_on_after(STARTUP_TIMEOUT) as scope:
            while b"listening on" not in err:
                chunk = await proc.stderr.receive_some(4096)
                if not chunk:
                    break
                err += chunk
        if b"listening on" not in err:
            why = "timed out" if scope.cancelled_caught else f"exited {proc.poll()}"
            raise RuntimeError(f"tcpdump did not start ({why}): {err.decode(errors='replace')}")
        yield cap
        await trio.sleep(DRAIN_DELAY)
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
            with trio.move_on_after(STOP_TIMEOUT):
                while True:
                    chunk = await proc.stderr.receive_some(4096)
                    if not chunk:
                        break
                    err += chunk
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await proc.stderr.aclose()
        cap.stderr = err.decode(errors="replace")
        cap.returncode = proc.returncode


async def judge_capture(path: Path, port: int, *options: str) -> tuple[int, dict[str, Any], str]:
    """Run ``tools/wirejudge.py --list`` on a capture: (exit code, parsed JSON, raw stdout).

    ``options`` go to the judge, e.g. ``--no-rpcrdma`` for a ULP that is not RPC,
    ``--pad-from ADDR`` for a peer (Linux siw) that sends non-zero PAD.
    """
    done = await trio.run_process(
        [sys.executable, str(JUDGE), str(path), str(port), "--list", *options],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out = done.stdout.decode(errors="replace")
    try:
        result = json.loads(out)
    except json.JSONDecodeError:
        result = {"ok": False, "problems": ["no JSON"], "stderr": done.stderr.decode()}
    return done.returncode, result, out


def summary(result: dict[str, Any]) -> str:
    """The JSON without the per-FPDU list, for failure messages."""
    short = {k: v for k, v in result.items() if k != "fpdu_list"}
    return json.dumps(short, indent=2)


async def open_listener() -> tuple[trio.SocketListener, int]:
    """A loopback listener on a free port, and that port."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    return listeners[0], listeners[0].socket.getsockname()[1]
