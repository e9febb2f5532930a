"""``rdmashim nfs`` as a user meets it: serve's help, its ready line and SIGTERM, and
client errors that say what to do, each one line (the real command, in a subprocess).

Before: the help showed no defaults and did not say which line means ready;
SIGTERM killed the server without withdrawing anything (status -15); a server
whose rpcbind port was taken by something else said "registered with the
system's rpcbind (or none)"; the errors below were a bare status (put as
root: "permission denied") or a socket error ("all attempts to connect to
127.0.0.1:1 failed").
"""

from __future__ import annotations

import os
import re
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from clirun import RDMASHIM, Running, assert_one_error_line, free_port, run

FAILED = 1


@contextmanager
def serving(tmp_path: Path, *flags: str) -> Iterator[tuple[Path, Running, list[str]]]:
    """``rdmashim nfs serve`` on free loopback ports: the export, the process, client flags."""
    export = tmp_path / "export"
    export.mkdir(exist_ok=True)
    server = Running(
        [*RDMASHIM, "nfs", "serve", str(export), "--host", "127.0.0.1", "--tcp-port", "0",
         "--rdma-port", "0", "--state-dir", str(tmp_path / "state"), *flags]
    )  # fmt: skip
    try:
        server.wait_for(r"^serving ")
        found = re.search(r"rpcbind port (\d+)", server.seen["stdout"].decode())
        where = ["--rpcbind-port", found[1]] if found else []
        yield export, server, where
    finally:
        server.stop()


def test_serve_help_shows_the_defaults_and_the_ready_line() -> None:
    done = run([*RDMASHIM, "nfs", "serve", "--help"])
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for option, default in (("--rdma-port", "20049"), ("--tcp-port", "2049"),
                            ("--rpcbind-port", "111"), ("--host", "0.0.0.0")):  # fmt: skip
        assert re.search(rf"{option} \S+ .*?\(default: {re.escape(default)}\b", text), option
    assert "prints one line that starts with 'serving '" in text
    assert "a script waits for that line" in text


def test_sigterm_ends_serve_quietly_with_143(tmp_path: Path) -> None:
    with serving(tmp_path, "--rpcbind-port", "0") as (export, server, _):
        line = server.seen["stdout"].decode().splitlines()[0]
        assert line.startswith(f"serving {export} on 127.0.0.1: NFSv3 on RDMA port "), line
        server.proc.send_signal(signal.SIGTERM)
        status, _, err = server.finish()
    assert (status, err) == (128 + signal.SIGTERM, "")


def test_the_ready_line_says_when_no_rpcbind_answers(tmp_path: Path) -> None:
    """The rpcbind port is taken by a socket that is no rpcbind (bound, not listening)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with serving(tmp_path, "--rpcbind-port", str(port), "--no-rdma") as (_, server, _):
            line = server.seen["stdout"].decode().splitlines()[0]
    assert line.endswith(
        f"(with MOUNT v3), no rpcbind (port {port} is not ours and none answers there): "
        "clients must name the ports (port=, mountport=)"
    ), line


def test_client_errors_name_the_object_and_what_to_do(tmp_path: Path) -> None:
    squash = ["--no-root-squash"] if os.geteuid() == 0 else []
    with serving(tmp_path, "--rpcbind-port", "0", *squash) as (export, _, where):
        (export / "file").write_bytes(b"x")
        (export / "full").mkdir()
        (export / "full" / "x").write_bytes(b"y")
        (tmp_path / "local").write_bytes(b"z")
        at = f"127.0.0.1:{export}"
        cases = [  # (arguments, the one line's end)
            (["mkdir", f"{at}/full"],
             f"NFS3ERR_EXIST: file exists: {at}/full (mkdir -p takes a directory that exists)"),
            (["rm", f"{at}/full"], f"NFS3ERR_NOTEMPTY: directory not empty: {at}/full "
             "(rm -r removes it and everything under it)"),
            (["put", str(tmp_path / "local"), f"{at}/new/local"],
             f"NFS3ERR_NOENT: no such file or directory: {at}/new (put makes no directory: "
             "rdmashim nfs mkdir -p makes it)"),
            (["get", f"{at}/full", str(tmp_path / "out")], f"NFS3ERR_ISDIR: is a directory: "
             f"{at}/full (get copies a file; rdmashim nfs ls lists a directory)"),
            (["ls", f"{at}/file/x/y"], f"NFS3ERR_NOTDIR: not a directory: {at}/file"),
            (["ls", "127.0.0.1:/elsewhere"],
             f"/elsewhere: in no export (the server exports {export})"),
        ]  # fmt: skip
        for argv, end in cases:
            done = run([*RDMASHIM, "nfs", *argv, *where, "--proto", "tcp"], timeout=60)
            line = assert_one_error_line(done, FAILED, f"rdmashim nfs {argv[0]}: error: ")
            assert line.endswith(end), (argv, line)


@pytest.mark.skipif(os.geteuid() != 0, reason="the hint is for a root caller: needs root")
def test_put_as_root_into_a_squashing_server_names_root_squash(tmp_path: Path) -> None:
    with serving(tmp_path, "--rpcbind-port", "0") as (export, _, where):
        (tmp_path / "local").write_bytes(b"z")
        done = run([*RDMASHIM, "nfs", "put", str(tmp_path / "local"), f"127.0.0.1:{export}/",
                    *where], timeout=60)  # fmt: skip
        line = assert_one_error_line(done, FAILED, "NFS3ERR_ACCES: permission denied: ")
        assert line.endswith(
            f"127.0.0.1:{export}/local (you are root, whom NFS servers map to nobody unless "
            "the export allows root: rdmashim nfs serve --no-root-squash, no_root_squash in "
            "knfsd's /etc/exports)"
        ), line
    assert not (export / "local").exists()


def test_an_unreachable_server_is_named_with_the_program_and_port() -> None:
    gone = free_port()
    cases = [
        (["--rpcbind-port", str(gone)], f"rpcbind at 127.0.0.1 port {gone}: connection refused: "
         "nothing listens there (no rpcbind there? then give --mount-port and --port)"),
        (["--mount-port", str(gone)], f"MOUNT at 127.0.0.1 port {gone}: connection refused: "
         "nothing listens there (the MOUNT port given)"),
    ]  # fmt: skip
    for flags, text in cases:
        done = run([*RDMASHIM, "nfs", "ls", "127.0.0.1:/x", *flags], timeout=60)
        line = assert_one_error_line(done, FAILED, "rdmashim nfs ls: error: ")
        assert line == f"rdmashim nfs ls: error: {text}", line
