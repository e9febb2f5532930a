"""The command line under attack: bad input, failing peers and Ctrl-C, as a user meets them.

Every case runs the real command in a subprocess (``python -m rdmashim``, or
an example) and checks its exit status, that stderr is exactly one line
naming the problem, that there is no traceback, and that it ends within
:data:`clirun.DEADLINE` seconds (a hang is a TimeoutExpired). Ctrl-C is a
real SIGINT once the command printed that it is under way: it must end with
130 and whatever figure it printed must be sane.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pty
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rdmashim import cliargs

from clirun import (
    DEADLINE,
    RDMASHIM,
    ROOT,
    STRESS_ROW,
    Running,
    assert_one_error_line,
    background,
    free_port,
    run,
    subnet,
)

STRESS = ["rds", "stress", "-r", "127.0.0.1", "-s", "127.0.0.2"]
USAGE, FAILED = 2, 1

BAD_ARGUMENTS = [
    # (arguments, what the line must name); all end with status 2 before anything starts
    ([], "the following arguments are required: command"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["demo", "-s", "-1"], "argument -s/--size: '-1' is out of range"),
    (["demo", "-s", "0"], "argument -s/--size: '0' is out of range"),
    (["demo", "-s", "10000000000"], "argument -s/--size: '10000000000' is out of range"),
    (["demo", "-s", "10G"], "'10G' is out of range (1 .. 1073741824)"),
    (["demo", "-s", "lots"], "'lots' is not a size"),
    (["demo", "-n", "0"], "argument -n/--count: '0' is out of range"),
    (["demo", "-n", "-5"], "argument -n/--count: '-5' is out of range"),
    (["demo", "-n", "1e3"], "'1e3' is not an integer"),
    (["devinfo", "-b", "nope"], "no backend 'nope' (known: ibal, rdmacore, softiwarp)"),
    (["nfs"], "the following arguments are required: nfs_command"),
    (["nfs", "serve"], "the following arguments are required: dir"),
    (["nfs", "serve", "/nonexistent-dir"], "/nonexistent-dir: not a directory"),
    (["nfs", "serve", ".", "--tcp-port", "70000"], "--tcp-port: '70000' is out of range"),
    (["nfs", "serve", ".", "--rdma-port", "-1"], "--rdma-port: '-1' is out of range"),
    (["nfs", "serve", ".", "--host", "nosuch.invalid"], "cannot resolve 'nosuch.invalid'"),
    (["nfs", "ls"], "the following arguments are required: REMOTE"),
    (["nfs", "ls", "server"], "'server' is not SERVER:/export/path"),
    (["nfs", "ls", "server/x"], "'server/x' is not SERVER:/export/path"),
    (["nfs", "stat", "nosuch.invalid:/x"], "cannot resolve 'nosuch.invalid'"),
    (["nfs", "ls", "127.0.0.1:/x", "--proto", "udp"], "--proto: invalid choice: 'udp'"),
    (["nfs", "ls", "127.0.0.1:/x", "--port", "70000"], "--port: '70000' is out of range"),
    (["nfs", "mkdir", "127.0.0.1:/x", "--rpcbind-port", "-1"], "'-1' is out of range"),
    (["nfs", "rm", "127.0.0.1:/x", "-b", "nope"], "no backend 'nope'"),
    (["nfs", "get", "127.0.0.1:/x"], "the following arguments are required: dest"),
    (["nfs", "get", "127.0.0.1:/x", "/nonexistent-dir/f"], "/nonexistent-dir: no such directory"),
    (["nfs", "put", "/nonexistent-file", "127.0.0.1:/x"], "/nonexistent-file: not a file"),
    (["nfs", "put", "/", "127.0.0.1:/x"], "/: not a file"),
    (["ping"], "one of the arguments -s -c is required"),
    (["ping", "-c"], "a client needs the server's address (-a)"),
    (["ping", "-c", "-a", "nosuch.invalid"], "cannot resolve 'nosuch.invalid'"),
    (["ping", "-s", "-p", "70000"], "argument -p: '70000' is out of range (0 .. 65535)"),
    (["ping", "-s", "-p", "-1"], "argument -p: '-1' is out of range"),
    (["ping", "-s", "-S", "10"], "argument -S: '10' is out of range (26 .. 65535)"),
    (["ping", "-s", "-S", "70000"], "argument -S: '70000' is out of range"),
    (["ping", "-c", "-a", "127.0.0.1", "-C", "-1"], "argument -C: '-1' is out of range"),
    (["ping", "-s", "--timeout", "0"], "'0' is out of range (more than 0 s)"),
    (["ping", "-s", "--timeout", "soon"], "'soon' is not a duration"),
    (["ping", "-s", "--mpa-rev", "3"], "argument --mpa-rev: invalid choice: 3"),
    (["rds"], "the following arguments are required: rds_command"),
    (["rds", "ping"], "the address to ping is missing"),
    (["rds", "ping", "--serve"], "--serve needs -I LOCAL_IP"),
    (["rds", "ping", "-c", "-1", "127.0.0.1"], "argument -c: '-1' is out of range"),
    (["rds", "ping", "-i", "0", "127.0.0.1"], "argument -i: '0' is out of range"),
    (["rds", "ping", "-i", "fast", "127.0.0.1"], "'fast' is not a duration"),
    (["rds", "ping", "-i", "1e-300", "127.0.0.1"], "'1e-300' is out of range (at least 0.001 s)"),
    (["rds", "ping", "-i", "500us", "127.0.0.1"], "'500us' is out of range (at least 0.001 s)"),
    (["rds", "ping", "-p", "65536", "127.0.0.1"], "argument -p: '65536' is out of range"),
    (["rds", "ping", "nosuch.invalid"], "cannot resolve 'nosuch.invalid'"),
    (["rds", "ping", "--cm-port", "0", "127.0.0.1"], "argument --cm-port: '0' is out of range"),
    ([*STRESS, "-q", "0"], "argument -q: '0' is out of range (16 .. 1048576)"),
    ([*STRESS, "-q", "-5"], "argument -q: '-5' is out of range"),
    ([*STRESS, "-q", "2M"], "argument -q: '2M' is out of range"),
    ([*STRESS, "-a", "8"], "argument -a: '8' is out of range"),
    ([*STRESS, "-t", "0"], "argument -t: '0' is out of range (1 .. 256)"),
    ([*STRESS, "-d", "0"], "argument -d: '0' is out of range (1 .. 4096)"),
    ([*STRESS, "-D", "-1"], "argument -D: '-1' is out of range"),
    ([*STRESS, "-T", "-1"], "argument -T: '-1' is out of range (0 s or more)"),
    ([*STRESS, "-p", "70000"], "argument -p: '70000' is out of range"),
    ([*STRESS, "-q", "20", "-D", "100"], "req_bytes 20 outside 36..1048576"),
    ([*STRESS, "-t", "256", "-d", "4096", "-D", "1M"], "bytes of RDMA buffers, more than 1024 MiB"),
    (["rds", "stress", "-s", "127.0.0.2"], "the following arguments are required: -r"),
    (["rds", "stress", "-r", "localhost", "-s", "127.0.0.1"], "127.0.0.1 is this node's own"),
    (["rds", "ping", "-I", "127.0.0.1", "localhost"], "127.0.0.1 is this node's own address"),
    (["rds", "info", "-I", "127.0.0.1", "127.0.0.1"], "127.0.0.1 is this node's own address"),
    (["rds", "stress", "-r", "nosuch.invalid"], "cannot resolve 'nosuch.invalid'"),
    (["rds", "info"], "the following arguments are required: dest"),
    (["rds", "info", "--timeout", "0", "127.0.0.1"], "argument --timeout: '0' is out of range"),
    (["rds", "info", "-x", "127.0.0.1"], "unrecognized arguments: -x"),
    (["rds", "demo", "-T", "0"], "argument -T/--seconds: '0' is out of range (more than 0 s)"),
    (["rds", "demo", "-n", "1"], "argument -n/--nodes: '1' is out of range (2 .. 64)"),
    (["rds", "demo", "-n", "-5"], "argument -n/--nodes: '-5' is out of range"),
    (["rds", "demo", "-s", "5"], "argument -s/--size: '5' is out of range (14 .. 1048576)"),
    (["rds", "demo", "--cuts", "-1"], "argument --cuts: '-1' is out of range"),
    (["rds", "demo", "--address", "::1"], "2 nodes from ::1 are no IPv4 addresses"),
    (["rds", "demo", "--address", "10.0.0.1"], "leave 127.0.0.0/8"),
    (["rds", "demo", "--address", "255.255.255.255"], "are no IPv4 addresses"),
]


def _case_id(case: tuple[list[str], str]) -> str:
    return " ".join(case[0]) or "(none)"


@pytest.mark.parametrize("argv, text", BAD_ARGUMENTS, ids=[_case_id(c) for c in BAD_ARGUMENTS])
def test_bad_arguments_get_one_line(argv: list[str], text: str) -> None:
    if argv[:2] == ["rds", "demo"] and "-n" not in argv:
        argv = [*argv, "-n", "2"]  # the address cases: two nodes
    line = assert_one_error_line(run([*RDMASHIM, *argv]), USAGE, text)
    command = " ".join(["rdmashim", *[a for a in argv[:2] if a.isalpha() and a != "bogus"]])
    assert line.startswith(f"{command}: error: "), line


HELP = [[], ["devices"], ["devinfo"], ["demo"], ["ping"], ["rds"]] + [
    ["rds", tool] for tool in ("ping", "stress", "info", "demo")
]


@pytest.mark.parametrize("command", HELP, ids=lambda c: " ".join(c) or "rdmashim")
def test_help_exits_0_with_usage(command: list[str]) -> None:
    out = run([*RDMASHIM, *command, "-h"])
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert out.stdout.startswith("usage: "), out.stdout


@pytest.mark.parametrize("command", [["devinfo"], ["demo"], ["ping", "-s"]])
def test_unknown_backend_in_the_environment_is_refused(command: list[str]) -> None:
    out = run([*RDMASHIM, *command], env={"RDMASHIM_BACKEND": "nope"})
    assert_one_error_line(out, USAGE, "RDMASHIM_BACKEND: no backend 'nope'")


# ------------------------------------------------------------------ failures while running
def test_unknown_device_is_one_line() -> None:
    out = run([*RDMASHIM, "devinfo", "-d", "siw_nosuch"])
    assert_one_error_line(out, FAILED, "no device 'siw_nosuch'")


def test_ping_to_a_closed_port_is_refused() -> None:
    out = run([*RDMASHIM, "ping", "-c", "-a", "localhost", "-p", str(free_port())])
    assert_one_error_line(out, FAILED, "connection refused")


@pytest.mark.parametrize(
    "command, text",
    [
        (["ping", "-s", "-a", "127.0.0.1", "-p"], "cannot listen on 127.0.0.1:{port}"),
        (["rds", "stress", "-r", "127.0.0.1", "--cm-port"], "RDS node on 127.0.0.1, rdma_cm port"),
        (["rds", "demo", "-n", "2", "--cm-port"], "RDS node on 127.0.0.1, rdma_cm port {port}:"),
    ],
    ids=["ping", "rds stress", "rds demo"],
)
def test_a_port_in_use(command: list[str], text: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run([*RDMASHIM, *command, str(port)])
    assert_one_error_line(out, FAILED, text.format(port=port))


@pytest.mark.parametrize("transport, port", [("rdma", 18634), ("tcp", 16385)], ids=["rdma", "tcp"])
def test_rds_nodes_default_to_linux_ports(transport: str, port: int) -> None:
    """Without --cm-port a node takes the port Linux's RDS uses on its transport (IPv4)."""
    host = subnet() + "1"
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind((host, port))
        taken.listen()
        out = run([*RDMASHIM, "rds", "stress", "-r", host, "--transport", transport])
    assert_one_error_line(out, FAILED, f"RDS node on {host}, ")
    assert f" port {port}:" in out.stderr


def test_ping_server_on_an_address_not_ours() -> None:
    out = run([*RDMASHIM, "ping", "-s", "-a", "10.255.255.1", "-p", "0"])  # bind fails: no traffic
    assert_one_error_line(out, FAILED, "cannot listen on 10.255.255.1:0")


def test_sigterm_ends_a_passive_stress_with_143() -> None:
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "stress", "-r", net + "1", "--cm-port", port) as passive:
        passive.proc.send_signal(signal.SIGTERM)
        status, out, err = passive.finish()
    assert status == 143 and err == "", err
    assert "interrupted: no run started" in out


def test_rds_ping_without_a_responder_says_so() -> None:
    net = subnet()
    out = run([*RDMASHIM, "rds", "ping", "-I", net + "2", "--cm-port", str(free_port(net + "2")),
               "-c", "2", "-i", "10ms", net + "1"])  # fmt: skip
    assert_one_error_line(out, FAILED, f"no reply from {net}1 RDS port 7 to 2 ping(s)")


# ------------------------------------------------------------------ what used to go wrong
def test_ping_server_takes_a_host_name() -> None:
    """`rdmashim ping -s -a localhost`: the name is resolved, a client pings it."""
    port = str(free_port())
    server = Running([*RDMASHIM, "ping", "-s", "-a", "localhost", "-p", port, "-v", "-d"])
    try:
        server.wait_for("listening on 127.0.0.1", "stderr")
        client = run([*RDMASHIM, "ping", "-c", "-a", "localhost", "-p", port, "-C", "3", "-V"])
        assert client.returncode == 0, client.stderr
        status, out, err = server.finish()
        assert status == 0, err
        assert out.count("server ping data: rdma-ping-") == 3
    finally:
        server.stop()


def test_rds_ping_with_a_short_interval_prints_its_replies() -> None:
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "ping", "--serve", "-I", net + "1", "--cm-port", port):
        out = run([*RDMASHIM, "rds", "ping", "-I", net + "2", "--cm-port", port,
                   "-c", "3", "-i", "10ms", net + "1"])  # fmt: skip
    assert out.returncode == 0, out.stderr
    replies = sorted(line.split(":")[0].strip() for line in out.stdout.splitlines())
    assert replies == ["1", "2", "3"], out.stdout  # 10 ms apart: they may cross


def test_rds_demo_shorter_than_its_cuts_is_not_a_failure() -> None:
    out = run([*RDMASHIM, "rds", "demo", "-T", "0.2", "--cuts", "5", "-q",
               "--address", subnet() + "1"], timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lost 0, duplicated 0, out of order 0, corrupt 0" in out.stdout
    assert "OK: every message arrived exactly once" in out.stdout
    assert "FAILED" not in out.stdout


# ------------------------------------------------------------------ Ctrl-C
def assert_interrupted(status: int, err: str) -> None:
    assert status == 130, err
    assert "Traceback" not in err and "ExceptionGroup" not in err
    assert err == "", err


def test_ctrl_c_on_demo() -> None:
    demo = Running([*RDMASHIM, "demo", "-n", "1000000", "-s", "64K"])
    try:
        demo.wait_for(r"^server: 20-byte Send")
        status, out, err = demo.interrupt()
    finally:
        demo.stop()
    assert_interrupted(status, err)
    # What it measured: the Writes so far, at a rate that fits them.
    found = re.search(r"interrupted: RDMA Write (\d+) of 1000000 x 65536 B done in ([\d.]+) s", out)
    assert found is not None, out
    done, seconds = int(found[1]), float(found[2])
    assert 0 <= done < 1000000 and seconds >= 0
    if seconds >= 0.1:  # printed to the millisecond
        mbytes = float(re.search(r"s, ([\d.]+) MB/s", out)[1])
        assert mbytes == pytest.approx(done * 65536 / 1e6 / seconds, rel=0.05)


def test_nfs_serve_says_how_to_mount_and_ctrl_c_ends_it(tmp_path: Path) -> None:
    server = Running(
        [*RDMASHIM, "nfs", "serve", str(tmp_path), "--ro", "--tcp-port", "0",
         "--rdma-port", "0", "--rpcbind-port", "0", "--state-dir", str(tmp_path / "state")]
    )  # fmt: skip
    try:
        server.wait_for(r"^mount it with: mount -t nfs -o vers=3,proto=rdma,port=\d+ SERVER:")
        status, out, err = server.interrupt()
    finally:
        server.stop()
    assert f"serving {tmp_path} read-only on 0.0.0.0: NFSv3 on RDMA port" in out, out
    assert status == 130 and err == "", err


@contextlib.contextmanager
def nfs_serve(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """``rdmashim nfs serve`` on a fresh export on loopback: the export, and the client flags."""
    export = tmp_path / "export"
    export.mkdir()
    squash = ["--no-root-squash"] if os.geteuid() == 0 else []  # the client is this process
    server = Running(
        [*RDMASHIM, "nfs", "serve", str(export), *squash, "--host", "127.0.0.1",
         "--tcp-port", "0", "--rdma-port", "0", "--rpcbind-port", "0",
         "--state-dir", str(tmp_path / "state")]
    )  # fmt: skip
    try:
        server.wait_for(r"rpcbind port \d+")
        found = re.search(r"rpcbind port (\d+)", server.seen["stdout"].decode())
        assert found is not None
        yield export, ["--proto", "rdma", "--rpcbind-port", found[1]]
    finally:
        server.stop()


def test_nfs_put_get_and_ls_against_nfs_serve(tmp_path: Path) -> None:
    """``rdmashim nfs put`` then ``get`` over RDMA, byte-exact; a missing path is one line."""
    data = random.randbytes(4 << 20)
    (tmp_path / "src").write_bytes(data)
    with nfs_serve(tmp_path) as (export, where):
        remote = f"127.0.0.1:{export}/copy"
        put = run([*RDMASHIM, "nfs", "put", str(tmp_path / "src"), remote, *where], timeout=120)
        assert put.returncode == 0 and put.stderr == "", put.stderr
        assert put.stdout.startswith(f"put {len(data)} bytes: "), put.stdout
        assert (export / "copy").read_bytes() == data
        got = run([*RDMASHIM, "nfs", "get", remote, str(tmp_path / "back"), *where], timeout=120)
        assert got.returncode == 0 and got.stderr == "", got.stderr
        assert got.stdout.startswith(f"got {len(data)} bytes: "), got.stdout
        assert (tmp_path / "back").read_bytes() == data
        missing = run([*RDMASHIM, "nfs", "ls", f"127.0.0.1:{export}/missing", *where])
        line = assert_one_error_line(missing, FAILED, "NFS3ERR_NOENT")
        assert line.endswith(f"no such file or directory: 127.0.0.1:{export}/missing"), line


def test_nfs_get_to_stdout_mkdir_p_and_rm_r(tmp_path: Path) -> None:
    """``get REMOTE -`` writes only the file to stdout; ``mkdir -p`` and ``rm -r`` work on trees."""
    with nfs_serve(tmp_path) as (export, where):
        data = random.randbytes(300_000)
        (export / "f").write_bytes(data)
        got = subprocess.run(
            [*RDMASHIM, "nfs", "get", f"127.0.0.1:{export}/f", "-", *where],
            capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert got.returncode == 0 and got.stdout == data, got.stderr
        assert got.stderr.decode().startswith(f"got {len(data)} bytes: "), got.stderr
        nested = f"127.0.0.1:{export}/a/b/c"
        no_parent = run([*RDMASHIM, "nfs", "mkdir", nested, *where])
        assert_one_error_line(no_parent, FAILED, "NFS3ERR_NOENT")
        for _ in range(2):  # the second time, everything exists already
            made = run([*RDMASHIM, "nfs", "mkdir", "-p", nested, *where])
            assert made.returncode == 0 and made.stderr == "", made.stderr
        assert (export / "a/b/c").is_dir()
        (export / "a/b/file").write_bytes(b"x")
        (export / "a/top").write_bytes(b"y")
        not_dir = run([*RDMASHIM, "nfs", "mkdir", "-p", f"127.0.0.1:{export}/a/top/d", *where])
        assert_one_error_line(not_dir, FAILED, "NFS3ERR_NOTDIR")
        not_empty = run([*RDMASHIM, "nfs", "rm", f"127.0.0.1:{export}/a", *where])
        assert_one_error_line(not_empty, FAILED, "NFS3ERR_NOTEMPTY")
        assert (export / "a/b/file").exists()
        gone = run([*RDMASHIM, "nfs", "rm", "-r", f"127.0.0.1:{export}/a", *where])
        assert gone.returncode == 0 and gone.stderr == "", gone.stderr
        assert list(export.iterdir()) == [export / "f"]


def test_nfs_get_and_put_draw_a_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    """On a terminal (here a pty that reports no size, as ``script`` makes) stderr gets
    tqdm's bar with the size, percentage and rate; the summary stays on stdout."""
    data = random.randbytes(3 << 20)
    (tmp_path / "src").write_bytes(data)
    with nfs_serve(tmp_path) as (export, where):
        for argv in (
            ["put", str(tmp_path / "src"), f"127.0.0.1:{export}/f"],
            ["get", f"127.0.0.1:{export}/f", str(tmp_path / "back")],
        ):
            leader, follower = pty.openpty()
            try:
                done = subprocess.run(
                    [*RDMASHIM, "nfs", *argv, *where], stdout=subprocess.PIPE,
                    stderr=follower, timeout=120, check=False,
                )  # fmt: skip
                os.close(follower)
                drawn = b""
                with contextlib.suppress(OSError):  # EIO once the pty has no writer
                    while chunk := os.read(leader, 65536):
                        drawn += chunk
            finally:
                os.close(leader)
            bar = drawn.decode(errors="replace")
            assert done.returncode == 0, bar
            assert f"{argv[0]} " in bar and "100%|" in bar and "3.00M/3.00M" in bar, bar
            assert done.stdout.decode().startswith(("put 3145728 bytes", "got 3145728 bytes"))
    assert (tmp_path / "back").read_bytes() == data


def test_ctrl_c_on_a_waiting_ping_server() -> None:
    server = Running([*RDMASHIM, "ping", "-s", "-a", "localhost", "-p", "0", "-d"])
    try:
        server.wait_for("listening on 127.0.0.1", "stderr")
        status, _, err = server.interrupt()
    finally:
        server.stop()
    assert status == 130 and "Traceback" not in err, err


def test_ctrl_c_on_an_idle_passive_stress_reports_no_figures() -> None:
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "stress", "-r", net + "1", "--cm-port", port) as passive:
        status, out, err = passive.interrupt()
    assert_interrupted(status, err)
    assert "interrupted: no run started" in out
    assert "req/s" not in out


def _passive_figures(out: str) -> tuple[int, float, float]:
    found = re.search(r"(\d+) requests in, .*; (\d+) req/s, .* over ([\d.]+) s", out)
    assert found is not None, out
    return int(found[1]), float(found[2]), float(found[3])


def test_ctrl_c_mid_run_stress_both_sides_report_sane_figures() -> None:
    """Ctrl-C the passive side mid-run, then the active side (twice: its peer is gone)."""
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "stress", "-r", net + "1", "--cm-port", port) as passive:
        active = Running([*RDMASHIM, "rds", "stress", "-r", net + "2", "-s", net + "1",
                          "--cm-port", port])  # fmt: skip
        try:
            active.wait_for(STRESS_ROW.pattern)
            status, out, err = passive.interrupt()
            assert_interrupted(status, err)
            requests, per_s, seconds = _passive_figures(out)
            assert requests > 0 and seconds > 0.5
            assert per_s == pytest.approx(requests / seconds, rel=0.02), out
            active.proc.send_signal(signal.SIGINT)  # stop the run: its acks never come
            time.sleep(1)  # two signals at once may arrive as one
            status, out, err = active.interrupt()  # end at once
        finally:
            active.stop()
    assert_interrupted(status, err)


def test_ctrl_c_ends_an_active_stress_with_its_summary() -> None:
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "stress", "-r", net + "1", "--cm-port", port) as passive:
        active = Running([*RDMASHIM, "rds", "stress", "-r", net + "2", "-s", net + "1",
                          "--cm-port", port, "-d", "4"])  # fmt: skip
        try:
            active.wait_for(STRESS_ROW.pattern)
            status, out, err = active.interrupt()
        finally:
            active.stop()
        assert_interrupted(status, err)
        average = [line for line in out.splitlines() if line.endswith("(average)")]
        assert len(average) == 1, out
        row = STRESS_ROW.match(average[0].removesuffix("  (average)"))
        assert row is not None and int(row[1]) == 1 and int(row[2]) > 0
        assert 0 < float(row[6]) < 10_000_000  # rtt us
        status, out, _ = passive.finish()
        assert status == 0 and "run over:" in out  # the active side ended the run
        requests, per_s, seconds = _passive_figures(out)
        assert requests > 0 and per_s == pytest.approx(requests / seconds, rel=0.02)


def test_ctrl_c_on_rds_ping_and_its_responder() -> None:
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "ping", "--serve", "-I", net + "1", "--cm-port", port) as responder:
        with background("rds", "ping", "-I", net + "2", "--cm-port", port, "-i", "100ms",
                        net + "1", first=r"^\s+1: \d+ usec") as pinger:  # fmt: skip
            status, out, err = pinger.interrupt()
        assert_interrupted(status, err)
        assert all(re.fullmatch(r"\s+\d+: \d+ usec", line) for line in out.splitlines()), out
        status, _, err = responder.interrupt()
    assert_interrupted(status, err)


# ------------------------------------------------------------------ the examples
MIXED = [sys.executable, str(ROOT / "examples" / "mixed_backends.py")]


@pytest.mark.parametrize(
    "argv, text",
    [
        ([], "the following arguments are required: host"),
        (["nosuch.invalid"], "cannot resolve 'nosuch.invalid'"),
        (["127.0.0.1", "nope", "softiwarp"], "no backend 'nope'"),
        (["127.0.0.1", "softiwarp"], "give both backends of a pairing, or neither"),
    ],
    ids=["no arguments", "bad host", "bad backend", "one backend"],
)
def test_mixed_backends_bad_arguments(argv: list[str], text: str) -> None:
    line = assert_one_error_line(run([*MIXED, *argv]), USAGE, text)
    assert line.startswith("mixed_backends.py: error: ")


def test_mixed_backends_runs_on_the_built_in_engine() -> None:
    out = run([*MIXED, "localhost", "softiwarp", "softiwarp"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert "   PASS" in out.stdout and "FAIL" not in out.stdout


def test_mixed_backends_without_rdma_core_is_one_line() -> None:
    probe = run([*RDMASHIM, "devices"])
    if "rdmacore unavailable" not in probe.stdout:
        pytest.skip("rdma-core is usable here: the failure this test needs does not happen")
    out = run([*MIXED, "127.0.0.1", "rdmacore", "softiwarp"], timeout=60)
    assert_one_error_line(out, FAILED, "mixed_backends.py: error: rdmacore")


IBAL_NATIVE = [sys.executable, str(ROOT / "examples" / "ibal_native.py")]


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--size", "0"], "argument --size: '0' is out of range (1 .. 1048576)"),
        (["--count", "101"], "argument --count: '101' is out of range (1 .. 100)"),
        (["--port", "65536"], "argument --port: '65536' is out of range (0 .. 65535)"),
        (["--host", "10.255.255.1"], "'10.255.255.1' is no address of this host"),
    ],
    ids=["size 0", "count 101", "port 65536", "host not ours"],
)
def test_ibal_native_bad_arguments(argv: list[str], text: str) -> None:
    line = assert_one_error_line(run([*IBAL_NATIVE, *argv]), USAGE, text)
    assert line.startswith("ibal_native.py: error: ")


@pytest.mark.parametrize(
    "role, argv",
    [
        ("IBAL client -> portable server", ["--count", "3", "--size", "3000"]),
        ("IBAL server <- portable client", ["--listen", "--count", "2", "--size", "1"]),
    ],
    ids=["ibal client", "ibal server"],
)
def test_ibal_native_runs_both_roles(role: str, argv: list[str]) -> None:
    out = run([*IBAL_NATIVE, "--host", "localhost", "--port", str(free_port()), *argv], timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    count, size = argv[-3], argv[-1]
    assert f"the portable side says 'ok: {count} x {size} B and the Write verified'" in out.stdout
    assert "private data: IBAL sent b'IBAL here', the peer got b'IBAL here'" in out.stdout
    assert f"OK: every byte verified ({role})" in out.stdout


def test_ibal_native_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = run([*IBAL_NATIVE, "--port", port, "--listen"], timeout=60)
    assert_one_error_line(out, FAILED, "Address already in use")


@pytest.mark.parametrize("argv", [[], ["--listen"]], ids=["ibal client", "ibal server"])
def test_ctrl_c_on_ibal_native(argv: list[str]) -> None:
    """Ctrl-C as the run starts (100 MiB to move): 130, nothing on stderr, no summary."""
    example = Running([*IBAL_NATIVE, "--size", "1M", "--count", "100", *argv])
    try:
        example.wait_for(r"^IBAL (client|server) on ")
        status, out, err = example.interrupt()
    finally:
        example.stop()
    assert_interrupted(status, err)
    assert "OK:" not in out


def test_a_closed_stdout_ends_quietly() -> None:
    """``rdmashim rds ping ... | head -1``: the pinger ends with 141 and says nothing."""
    net = subnet()
    port = str(free_port(net + "1"))
    with background("rds", "ping", "--serve", "-I", net + "1", "--cm-port", port):
        pinger = Running([*RDMASHIM, "rds", "ping", "-I", net + "2", "--cm-port", port,
                          "-i", "10ms", net + "1"])  # fmt: skip
        try:
            pinger.wait_for(r"^\s+\d+: \d+ usec")
            assert pinger.proc.stdout is not None
            pinger.proc.stdout.close()  # the reader goes away, as `head` does
            assert pinger.proc.wait(timeout=DEADLINE) == 141
            err = pinger.proc.stderr.read().decode() if pinger.proc.stderr else ""
        finally:
            pinger.stop()
    assert err == "", err


# ------------------------------------------------------------------ the argument types
def test_argument_types() -> None:
    assert cliargs.size()("64K") == 65536 and cliargs.size()("1MiB") == 1 << 20
    assert cliargs.size()("4096") == 4096 and cliargs.size()("2g") == 2 << 30
    assert cliargs.integer(0)("0x10") == 16
    assert cliargs.parse_duration("200ms") == pytest.approx(0.2)
    assert cliargs.parse_duration("500usec") == pytest.approx(0.0005)
    assert cliargs.duration()("1.5") == 1.5 and cliargs.duration(zero=True)("0") == 0
    assert cliargs.duration(least=1e-3)("1ms") == pytest.approx(1e-3)
    assert cliargs.host("localhost") == "127.0.0.1" and cliargs.host("::1") == "::1"
    bad = [
        (cliargs.size(1, 10), "11"), (cliargs.size(), "1.5M"), (cliargs.size(), "-1"),
        (cliargs.integer(1), "0"), (cliargs.integer(), "ten"), (cliargs.port, "65536"),
        (cliargs.duration(), "0"), (cliargs.duration(), "-1"), (cliargs.duration(), "1h"),
        (cliargs.duration(), "nan"), (cliargs.duration(), "inf"), (cliargs.host, "a..b"),
        (cliargs.duration(least=1e-3), "999us"), (cliargs.duration(zero=True), "-1ms"),
        (cliargs.backend, "nope"),
    ]  # fmt: skip
    for parse, text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
            parse(text)
    assert cliargs.rate(10, 0.0) is None and cliargs.rate(10, 0.001) is None
    assert cliargs.rate(10, 2.0) == 5.0


def test_run_command_maps_every_ending(capsys: pytest.CaptureFixture[str]) -> None:
    def raises(exc: BaseException) -> Callable[[], int]:
        def body() -> int:
            raise exc

        return body

    group = BaseExceptionGroup("nursery", [ExceptionGroup("inner", [OSError(98, "in use")])])
    cases = [
        (raises(group), 1, "prog: error: [Errno 98] in use\n"),
        (raises(cliargs.UsageError("bad\nmix")), 2, "prog: error: bad mix\n"),
        (raises(BaseExceptionGroup("g", [KeyboardInterrupt(), ValueError("x")])), 130, ""),
        (raises(KeyError("k")), 1, "prog: error: internal error: KeyError: 'k' (set "),
        (raises(MemoryError()), 1, "prog: error: out of memory\n"),
        (raises(SystemExit(3)), 3, ""),
        (raises(SystemExit(None)), 0, ""),
        (raises(SystemExit("bye")), 1, "bye\n"),
        (lambda: None, 0, ""),
        (lambda: 5, 5, ""),
    ]
    for body, status, err in cases:
        assert cliargs.run_command("prog", body) == status
        assert capsys.readouterr().err.startswith(err)
