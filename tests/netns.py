"""Three hosts made of network namespaces, and agents that run CM code inside them.

The network (every namespace name carries the pid, so runs never collide)::

    host a: va0 ─┐                      LAN  10.201.0.0/24, fd00:201::/64
    host b: vb0 ─┼─ br0 (switch netns)
    host c: vc0 ─┘
    host b: vb1 ─── vc1 :host c         link 10.202.0.0/24, fd00:202::/64, fe80::202:x
    host a: va9 ─── vc9 :host c         link 10.209.0.0/24 (the ROUTE_ERROR test takes it down)

Host a is .1, b is .2 and c is .3 on every subnet they are on; b and c are
multi-homed, so the routing table decides which interface (and device) a
connection uses. Nothing else is routed: there is no default route, and no
traffic leaves these namespaces.

Code runs inside a host as an agent (``netns_agent.py``), a child process
started with ``ip netns exec``; :meth:`Host.start` returns an :class:`Agent`
whose JSON lines the test reads with bounded waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

AGENT = Path(__file__).with_name("netns_agent.py")
PREFIX = "rdmashim-t"
"""Namespace names are ``{PREFIX}{pid}-{host}``."""

ADDRESSES: dict[str, dict[str, list[str]]] = {
    "a": {
        "va0": ["10.201.0.1/24", "fd00:201::1/64"],
        "va9": ["10.209.0.1/24"],
    },
    "b": {
        "vb0": ["10.201.0.2/24", "fd00:201::2/64"],
        "vb1": ["10.202.0.2/24", "fd00:202::2/64", "fe80::202:2/64"],
    },
    "c": {
        "vc0": ["10.201.0.3/24", "fd00:201::3/64"],
        "vc1": ["10.202.0.3/24", "fd00:202::3/64", "fe80::202:3/64"],
        "vc9": ["10.209.0.3/24"],
    },
}
LAN_PORTS = {"a": "va0", "b": "vb0", "c": "vc0"}
LINKS = [("b", "vb1", "c", "vc1"), ("a", "va9", "c", "vc9")]


class AgentError(AssertionError):
    """An agent failed, died or did not answer in time."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raise with its stderr when it fails and ``check`` is set."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why namespaces with veth pairs and a bridge cannot be built here (None if they can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"ip netns unavailable: {made.stderr.strip()}"
        for kind in (["veth", "peer", "name", "p1"], ["bridge"]):
            tried = ip("-n", probe, "link", "add", "p0", "type", *kind, check=False)
            if tried.returncode != 0:
                return f"cannot create a {kind[0]} device: {tried.stderr.strip()}"
            ip("-n", probe, "link", "del", "p0", check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns unavailable: {exc}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def sweep_stale() -> None:
    """Delete namespaces left by earlier runs whose process is gone (a killed pytest)."""
    listed = ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({re.escape(PREFIX)}(\d+)-\w+)", listed, re.MULTILINE):
        netns, pid = name
        if int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            ip("netns", "del", netns, check=False)


@dataclass
class Host:
    """One namespace with its interfaces and addresses."""

    name: str
    netns: str
    interfaces: dict[str, list[str]] = field(default_factory=dict)

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ip -n NETNS ARGS``: configure this host."""
        return ip("-n", self.netns, *args, check=check)

    def sysctl(self, key: str, value: str) -> None:
        """Set a sysctl inside this host (net.* sysctls are per namespace)."""
        path = Path("/proc/sys", *key.split("."))
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "sh", "-c", f"echo {value} > {path}"],
            check=True,
            timeout=20,
        )

    async def start(self, scenario: str, **kwargs: Any) -> Agent:
        """Start ``netns_agent.py SCENARIO KWARGS-as-JSON`` inside this host."""
        argv = ["ip", "netns", "exec", self.netns, sys.executable, str(AGENT), scenario]
        return await Agent.start(f"{scenario}@{self.name}", [*argv, json.dumps(kwargs)])

    async def run(self, scenario: str, **kwargs: Any) -> dict[str, Any]:
        """Run a scenario to its end and return its result."""
        async with await self.start(scenario, **kwargs) as agent:
            return await agent.result()


class Network:
    """The three hosts and the switch; :meth:`destroy` removes every namespace."""

    def __init__(self) -> None:
        tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{tag}-sw"
        self.hosts = {name: Host(name, f"{tag}-{name}", ADDRESSES[name]) for name in ADDRESSES}
        self._made: list[str] = []

    @property
    def a(self) -> Host:
        return self.hosts["a"]

    @property
    def b(self) -> Host:
        return self.hosts["b"]

    @property
    def c(self) -> Host:
        return self.hosts["c"]

    @classmethod
    def build(cls) -> Network:
        """Create the namespaces, links and addresses; on any failure remove what was made."""
        net = cls()
        try:
            net._build()
        except BaseException:
            net.destroy()
            raise
        return net

    def _build(self) -> None:
        for netns in (self.switch, *(h.netns for h in self.hosts.values())):
            ip("netns", "add", netns)
            self._made.append(netns)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts.values():
            host.ip("link", "set", "lo", "up")
            # Addresses are usable at once: no duplicate address detection to wait for.
            host.sysctl("net.ipv6.conf.all.accept_dad", "0")
            host.sysctl("net.ipv6.conf.default.accept_dad", "0")
        for name, ifname in LAN_PORTS.items():
            port = f"p{ifname[1:]}"
            self._veth(self.hosts[name].netns, ifname, self.switch, port)
            ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        for left, left_if, right, right_if in LINKS:
            self._veth(self.hosts[left].netns, left_if, self.hosts[right].netns, right_if)
        for host in self.hosts.values():
            for ifname, addresses in host.interfaces.items():
                if any(a.startswith("fe80:") for a in addresses):
                    # The given link-local address is the interface's only one.
                    host.ip("link", "set", ifname, "addrgenmode", "none")
                for address in addresses:
                    extra = ["nodad"] if ":" in address else []
                    host.ip("addr", "add", address, "dev", ifname, *extra)
                host.ip("link", "set", ifname, "up")
        self._wait_up()

    @staticmethod
    def _veth(netns: str, name: str, peer_netns: str, peer: str) -> None:
        # Both ends are created in their namespaces: no name ever appears in ours.
        ip("link", "add", name, "netns", netns, "type", "veth", "peer", "name", peer, "netns",
           peer_netns)  # fmt: skip

    def _wait_up(self, seconds: float = 10) -> None:
        """Wait until every host interface is operationally up (carrier on both ends)."""
        end = time.monotonic() + seconds
        while True:
            down = []
            for host in self.hosts.values():
                links = json.loads(host.ip("-j", "link", "show").stdout)
                states = {link["ifname"]: link.get("operstate") for link in links}
                down += [f"{host.name}:{i}" for i in host.interfaces if states.get(i) != "UP"]
            if not down:
                return
            if time.monotonic() > end:
                raise RuntimeError(f"interfaces still down after {seconds} s: {down}")
            time.sleep(0.05)

    def destroy(self) -> None:
        """Delete every namespace made (their veth pairs and the bridge go with them)."""
        for netns in reversed(self._made):
            ip("netns", "del", netns, check=False)
        self._made.clear()


class Agent:
    """A running ``netns_agent.py``: JSON lines on its stdout, stderr kept in a file."""

    def __init__(self, label: str, process: trio.Process, stderr: Any) -> None:
        self.label = label
        self.process = process
        self._stderr = stderr
        self._buffer = b""

    @classmethod
    async def start(cls, label: str, argv: Sequence[str]) -> Agent:
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - the agent closes it in aclose
        try:
            process = await trio.lowlevel.open_process(
                list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )
        except BaseException:
            stderr.close()
            raise
        return cls(label, process, stderr)

    async def __aenter__(self) -> Agent:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-4000:]

    def _fail(self, why: str) -> AgentError:
        return AgentError(f"agent {self.label}: {why}\n--- its stderr:\n{self.stderr()}")

    async def message(self, seconds: float = 20) -> dict[str, Any]:
        """The agent's next JSON line; raises AgentError on error, death or timeout."""
        assert self.process.stdout is not None
        with trio.move_on_after(seconds) as scope:
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some(65536)
                if not chunk:
                    await self.process.wait()
                    raise self._fail(f"exited ({self.process.returncode}) without an answer")
                self._buffer += chunk
        if scope.cancelled_caught:
            raise self._fail(f"no answer within {seconds} s")
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        if "error" in message:
            raise self._fail(f"raised:\n{message['error']}")
        return message

    async def result(self, seconds: float = 30) -> dict[str, Any]:
        """The agent's final result (skipping progress messages)."""
        with trio.move_on_after(seconds):
            while True:
                message = await self.message(seconds)
                if "result" in message:
                    return message["result"]
        raise self._fail(f"no result within {seconds} s")

    async def release(self) -> None:
        """Close the agent's stdin: an agent told to linger may now finish."""
        if self.process.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.process.stdin.aclose()

    async def aclose(self) -> None:
        """Let the agent go, and kill it if it has not exited within a moment.

        Shielded: a test that failed or timed out still ends its agents.
        """
        with trio.CancelScope(shield=True):
            await self.release()
            with trio.move_on_after(5):
                await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
            self._stderr.close()
