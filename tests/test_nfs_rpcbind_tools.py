"""``rdmashim nfs serve`` as administrators see it: Debian's rpcinfo and showmount.

The real tools talk to port 111 only, so the server runs on its default
ports inside host b of the :class:`netns.Network` (conftest's ``net``), in a mount and pid
namespace of its own as well (a tmpfs on ``/run`` holds the rpcbind socket
and lock of that host alone; every process there dies with it). The tools
run on host b against 127.0.0.1 and on host a against b's LAN address
(10.201.0.2): rpcbind must answer a wildcard binding with the address it
was asked on, or a remote ``rpcinfo -T tcp`` would try 0.0.0.0 on its own
host. Two cases: our own rpcbind on 111 (TCP and UDP), and Debian's
``/sbin/rpcbind -f`` running first, which our programs register with over
its local socket and leave again when the server stops (SIGTERM).

This file is also the agent that runs inside host b (``--tools-agent``).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import netns

SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"
RPCINFO = shutil.which("rpcinfo", path=SBIN)
SHOWMOUNT = shutil.which("showmount", path=SBIN)
RPCBIND = shutil.which("rpcbind", path=SBIN)
UNSHARE = shutil.which("unshare", path=SBIN)
SERVER_B = "10.201.0.2"
PORTMAPPER = [(100000, v, proto, 111) for proto in ("tcp", "udp") for v in (2, 3, 4)]
OURS = [
    (100003, 3, "tcp", 2049),
    *((100005, v, "tcp", 2049) for v in (1, 2, 3)),
    *((100021, v, "tcp", 2049) for v in (1, 3, 4)),
]
SERVICES = {100000: "portmapper", 100003: "nfs", 100005: "mountd", 100021: "nlockmgr"}


def _missing() -> str | None:
    """Which tool is missing (root and namespaces: conftest's ``net`` skips without them)."""
    for tool, package in ((RPCINFO, "rpcbind"), (SHOWMOUNT, "nfs-common"), (RPCBIND, "rpcbind")):
        if tool is None:
            return f"needs Debian's {package} (apt-get install rpcbind nfs-common)"
    if UNSHARE is None:
        return "needs unshare (util-linux)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def local_commands() -> list[list[str]]:
    """What the agent runs on host b, against 127.0.0.1."""
    assert RPCINFO is not None and SHOWMOUNT is not None
    return [
        [RPCINFO, "-p", "127.0.0.1"],
        [RPCINFO, "-s", "127.0.0.1"],
        *([RPCINFO, "-T", proto, "127.0.0.1", "100000", str(v)]
          for proto in ("tcp", "udp") for v in (2, 3, 4)),
        [RPCINFO, "-T", "tcp", "127.0.0.1", "100003", "3"],
        [SHOWMOUNT, "-e", "127.0.0.1"],
    ]  # fmt: skip


def remote_commands() -> list[list[str]]:
    """What the test runs on host a, against host b."""
    assert RPCINFO is not None and SHOWMOUNT is not None
    return [
        [RPCINFO, "-p", SERVER_B],
        [RPCINFO, "-T", "tcp", SERVER_B, "100003", "3"],
        [RPCINFO, "-T", "tcp", SERVER_B, "100000", "4"],
        [RPCINFO, "-T", "udp", SERVER_B, "100000", "2"],
        [SHOWMOUNT, "-e", SERVER_B],
    ]


def key(argv: list[str]) -> str:
    """A command as the results name it: without the tool's directory."""
    return " ".join([Path(argv[0]).name, *argv[1:]])


def ran(argv: list[str]) -> list[Any]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    return [done.returncode, done.stdout, done.stderr]


def _tools_agent(spec: dict[str, Any]) -> None:
    """Inside host b (network, mount and pid namespaces of its own): a private /run,
    the system rpcbind if asked, ``rdmashim nfs serve``, the tools; JSON lines out."""

    def say(**message: Any) -> None:
        print(json.dumps(message), flush=True)

    assert RPCINFO is not None and RPCBIND is not None
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run"], check=True)
    system = subprocess.Popen([RPCBIND, "-f"]) if spec["system"] else None
    for _ in range(100):
        if system is None or ran([RPCINFO, "-p", "127.0.0.1"])[0] == 0:
            break
        time.sleep(0.1)
    server = subprocess.Popen(
        [sys.executable, "-m", "rdmashim", "nfs", "serve", spec["export"],
         "--state-dir", spec["state"]],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert server.stdout is not None
    say(ready=server.stdout.readline())
    say(local={key(argv): ran(argv) for argv in local_commands()})
    sys.stdin.read()  # the test asks from host a meanwhile
    server.send_signal(signal.SIGTERM)
    status = server.wait(timeout=30)
    after = ran([RPCINFO, "-s", "127.0.0.1"])
    if system is not None:
        system.terminate()
        system.wait(timeout=10)
    say(result={"status": status, "after": after})


async def serve_and_ask(
    net: netns.Network, tmp_path: Path, *, system: bool
) -> tuple[str, dict[str, list[Any]], dict[str, list[Any]], dict[str, Any], Path]:
    """The ready line, the answers on host b and on host a, and the agent's end."""
    export = tmp_path / "export"
    export.mkdir()
    spec = {"system": system, "export": str(export), "state": str(tmp_path / "state")}
    assert UNSHARE is not None
    argv = ["ip", "netns", "exec", net.b.netns, UNSHARE, "--mount", "--pid", "--fork",
            "--kill-child", "--mount-proc", sys.executable, __file__, "--tools-agent",
            json.dumps(spec)]  # fmt: skip
    async with await netns.Agent.start("tools@b", argv) as agent:
        ready = (await agent.message(90))["ready"]
        local = (await agent.message(90))["local"]
        remote = {}
        for command in remote_commands():
            done = await trio.run_process(
                ["ip", "netns", "exec", net.a.netns, *command],
                capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
            remote[key(command)] = [done.returncode, done.stdout.decode(), done.stderr.decode()]
        await agent.release()
        end = await agent.result(60)
    return ready, local, remote, end, export


def ok(answer: list[Any]) -> str:
    """The output of a command that must have succeeded."""
    code, out, err = answer
    assert code == 0, (out, err)
    return str(out)


def mappings(answer: list[Any]) -> list[tuple[int, int, str, int]]:
    """``rpcinfo -p``'s rows, checking each names its service."""
    lines = ok(answer).splitlines()
    assert lines[0].split() == ["program", "vers", "proto", "port", "service"]
    rows = []
    for line in lines[1:]:
        prog, vers, proto, port, service = line.split()
        assert SERVICES[int(prog)] == service, line
        rows.append((int(prog), int(vers), proto, int(port)))
    return rows


def summary(answer: list[Any]) -> dict[int, tuple[set[str], set[str], str]]:
    """``rpcinfo -s``: program -> (versions, netids, owner)."""
    lines = ok(answer).splitlines()
    assert lines[0].split()[:3] == ["program", "version(s)", "netid(s)"]
    out = {}
    for line in lines[1:]:
        prog, versions, netids, service, owner = line.split()
        assert SERVICES[int(prog)] == service, line
        out[int(prog)] = (set(versions.split(",")), set(netids.split(",")), owner)
    return out


def exports(answer: list[Any], host: str) -> list[str]:
    lines = ok(answer).splitlines()
    assert lines[0] == f"Export list for {host}:"
    return lines[1:]


def check_pings(local: dict[str, list[Any]], remote: dict[str, list[Any]]) -> None:
    """Every ``rpcinfo -T`` ping found its program through rpcbind and was answered."""
    for answers in (local, remote):
        for command, answer in answers.items():
            if " -T " in command:
                prog, vers = command.split()[-2:]
                assert ok(answer) == f"program {prog} version {vers} ready and waiting\n", command


async def test_rpcinfo_and_showmount_against_our_own_rpcbind(
    net: netns.Network, tmp_path: Path
) -> None:
    """Before: ``rpcinfo -p`` and ``rpcinfo -T tcp|udp SERVER 100000 N`` failed with
    "RPC: Program not registered" (rpcbind knew no binding of its own) or got no
    answer over UDP, and a remote ``-T tcp`` was told 0.0.0.0."""
    ready, local, remote, end, export = await serve_and_ask(net, tmp_path, system=False)
    assert ready.startswith(f"serving {export} on 0.0.0.0: NFSv3 on RDMA port 20049, "), ready
    assert ready.rstrip().endswith("rpcbind port 111"), ready
    expected = sorted([*PORTMAPPER, *OURS])
    assert sorted(mappings(local["rpcinfo -p 127.0.0.1"])) == expected
    assert sorted(mappings(remote[f"rpcinfo -p {SERVER_B}"])) == expected
    assert summary(local["rpcinfo -s 127.0.0.1"]) == {
        100000: ({"2", "3", "4"}, {"tcp", "udp"}, "superuser"),
        100003: ({"3"}, {"tcp", "rdma"}, "superuser"),
        100005: ({"1", "2", "3"}, {"tcp"}, "superuser"),
        100021: ({"1", "3", "4"}, {"tcp"}, "superuser"),
    }
    check_pings(local, remote)
    assert exports(local["showmount -e 127.0.0.1"], "127.0.0.1") == [f"{export} (everyone)"]
    assert exports(remote[f"showmount -e {SERVER_B}"], SERVER_B) == [f"{export} (everyone)"]
    assert end["status"] == 128 + signal.SIGTERM


async def test_rpcinfo_and_showmount_through_the_system_rpcbind(
    net: netns.Network, tmp_path: Path
) -> None:
    """Debian's rpcbind holds port 111: our programs are registered there (over its
    local socket: owner superuser, the rdma netid kept) and withdrawn at the end."""
    ready, local, remote, end, export = await serve_and_ask(net, tmp_path, system=True)
    assert ready.rstrip().endswith("registered with the system's rpcbind on port 111"), ready
    rows = mappings(local["rpcinfo -p 127.0.0.1"])
    assert set(PORTMAPPER) | set(OURS) == set(rows), rows  # its own, and ours
    assert sorted(mappings(remote[f"rpcinfo -p {SERVER_B}"])) == sorted(rows)
    programs = summary(local["rpcinfo -s 127.0.0.1"])
    assert programs[100000][2] == "superuser" and {"tcp", "udp"} <= programs[100000][1]
    assert programs[100003] == ({"3"}, {"tcp", "rdma"}, "superuser")
    assert programs[100005] == ({"1", "2", "3"}, {"tcp"}, "superuser")
    assert programs[100021] == ({"1", "3", "4"}, {"tcp"}, "superuser")
    check_pings(local, remote)
    assert exports(local["showmount -e 127.0.0.1"], "127.0.0.1") == [f"{export} (everyone)"]
    assert exports(remote[f"showmount -e {SERVER_B}"], SERVER_B) == [f"{export} (everyone)"]
    assert end["status"] == 128 + signal.SIGTERM
    assert set(summary(end["after"])) == {100000}  # ours withdrawn, rpcbind's own left


if __name__ == "__main__" and "--tools-agent" in sys.argv:
    _tools_agent(json.loads(sys.argv[-1]))
