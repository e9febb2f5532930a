"""Two network namespaces joined by one veth pair: the benchmarks' MSS path.

``bench.py --path veth`` runs its server in one namespace and its client in the
other, so every byte crosses a veth pair with a 1500-byte MTU and TCP segments
of an Ethernet MSS (1448 bytes with timestamps), as between two hosts, where
loopback's 64 KiB MTU hides the per-segment cost. Nothing is routed out: the
namespaces hold only their ``lo`` and their end of the pair.

Needs root and iproute2; :func:`unavailable` says why not in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MTU = 1500
SERVER_ADDR = "10.213.0.1"
CLIENT_ADDR = "10.213.0.2"
PREFIX = "rdmashim-b"
"""Namespace names are ``{PREFIX}{pid}-srv`` and ``-cli``."""
SERVER_IF = "bsrv0"
CLIENT_IF = "bcli0"


def _ip(*args: str, check: bool = True) -> str:
    """``ip ARGS``'s output; a failure raises with ip's own words, unless ``check`` is off."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if done.returncode and check:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why the veth path cannot be built here (None if it can)."""
    if shutil.which("ip") is None:
        return "needs iproute2 (no 'ip' command on PATH)"
    if os.geteuid() != 0:
        return "needs root (it creates network namespaces)"
    return None


def netns_exec(netns: str) -> list[str]:
    """The argv prefix that runs a command inside ``netns``."""
    return ["ip", "netns", "exec", netns]


def sweep_stale() -> None:
    """Delete namespaces an earlier, killed run left (their pid is gone)."""
    listed = _ip("netns", "list", check=False)
    for netns, pid in re.findall(rf"^({re.escape(PREFIX)}(\d+)-\w+)", listed, re.MULTILINE):
        if not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", netns, check=False)


@dataclass
class VethPath:
    """The two namespaces (:func:`veth_path` makes and deletes them)."""

    server_ns: str
    client_ns: str

    def build(self) -> None:
        for netns in (self.server_ns, self.client_ns):
            _ip("netns", "add", netns)
            _ip("-n", netns, "link", "set", "lo", "up")
        # Both ends are made inside their namespaces: no name appears in ours.
        _ip("link", "add", SERVER_IF, "netns", self.server_ns, "mtu", str(MTU), "type", "veth",
            "peer", "name", CLIENT_IF, "netns", self.client_ns, "mtu", str(MTU))  # fmt: skip
        for netns, ifname, addr in (
            (self.server_ns, SERVER_IF, SERVER_ADDR),
            (self.client_ns, CLIENT_IF, CLIENT_ADDR),
        ):
            _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", ifname)
            _ip("-n", netns, "link", "set", ifname, "up")

    def destroy(self) -> None:
        """Delete both namespaces (the veth pair goes with them); quiet if they are gone."""
        for netns in (self.client_ns, self.server_ns):
            _ip("netns", "del", netns, check=False)


@contextlib.contextmanager
def veth_path() -> Iterator[VethPath]:
    """The two namespaces of this process, deleted on leaving (also after a failed build)."""
    sweep_stale()
    tag = f"{PREFIX}{os.getpid()}"
    path = VethPath(f"{tag}-srv", f"{tag}-cli")
    try:
        path.build()
        yield path
    finally:
        path.destroy()
