"""``rdmashim perf``: every tool ours against ours over loopback (built-in engine),
``-a`` with ``--max-size``, ``-D``, ``--vs-tcp`` (the same sizes over plain TCP),
``--plot`` making a real PNG and SVG, the GID lines, progress bars on a terminal
only, and bad flags refused with one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pty
import subprocess
import sys

import pytest
import trio
from api.busyloop import loop_sleeps

from rdmashim.perftools.options import TOOLS, add_arguments, config_from_args
from rdmashim.perftools.run import run
from rdmashim.perftools.session import PerfError

from clirun import RDMASHIM, assert_one_error_line, free_port, rdmashim


def config(tool: str, *argv: str):  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    add_arguments(p, tool)
    return config_from_args(tool, p.parse_args(list(argv)))


async def pair(tool: str, *argv: str):  # type: ignore[no-untyped-def]
    """Server and client of ``tool`` in this trio loop; their lines and results."""
    out: dict[str, list[str]] = {"server": [], "client": []}
    async with trio.open_nursery() as nursery:
        server_cfg = config(tool, "-p", "0", "--bind", "127.0.0.1", *argv)
        box = {}

        async def serve(task_status=trio.TASK_STATUS_IGNORED):  # type: ignore[no-untyped-def]
            box["server"] = await run(server_cfg, out["server"].append, task_status=task_status)

        port = await nursery.start(serve)
        client = await run(config(tool, "-p", str(port), *argv, "127.0.0.1"), out["client"].append)
    return out, box["server"], client


def rows(lines: list[str], size: int) -> list[list[str]]:
    return [ln.split() for ln in lines if ln.split()[:1] == [str(size)]]


@pytest.mark.parametrize("tool", TOOLS)
async def test_ours_against_ours(tool: str) -> None:
    with trio.fail_after(60):
        out, server, client = await pair(tool, "-n", "50", "-s", "4096")
    client_rows = rows(out["client"], 4096)
    assert len(client_rows) == 1 and client_rows[0][1] == "50", out["client"]
    if tool.endswith("_bw"):
        assert client.bw[0].bw_avg > 0 and client.bw[0].msg_rate > 0
        assert client.peer_version == "6.06"
        if tool != "send_bw":  # the server prints the client's figures it was sent
            assert server.remote is not None
            assert server.remote.bw_avg == pytest.approx(client.bw[0].bw_avg)
        else:
            assert server.bw[0].iters == 50 and server.bw[0].bw_avg > 0
    else:
        lat = client.lat[0]
        assert 0 < lat.t_min <= lat.t_typical <= lat.t_max  # type: ignore[union-attr]
    assert any("remote address: LID 0000 QPN" in ln for ln in out["client"])
    # perftest's GID line under each address line: the device's GID, never zeros
    # (on lo, the six bytes siw_lo's node GUID was made from: "lo" and zeros).
    gids = [ln for ln in out["client"] if ln.startswith(" GID: ")]
    assert gids == [" GID: 108:111" + ":00" * 14] * 2, gids


@pytest.mark.parametrize("events", [False, True], ids=["poll", "events"])
async def test_latency_polls_by_default_and_sleeps_with_events(events: bool) -> None:
    """perftest's -e: the test's waits sleep on CQ events; without it they poll."""
    flags = ["-e"] if events else []
    assert config("send_lat", *flags).events is events
    with trio.fail_after(60), loop_sleeps() as watch:
        _out, _, client = await pair("send_lat", "-n", "200", *flags)
    lat = client.lat[0]
    assert 0 < lat.t_min <= lat.t_typical <= lat.t_max  # type: ignore[union-attr]
    # Sleeping, the loop could sleep at each of the 200 round trips; polling, only in
    # the set-up and result exchanges around them.
    assert (watch.sleeps >= 200) is events, watch.sleeps


async def test_two_qps_and_gbits() -> None:
    with trio.fail_after(60):
        out, _, client = await pair("write_bw", "-n", "40", "-s", "1024", "-q", "2",
                                    "--report_gbits")  # fmt: skip
    assert client.bw[0].iters == 80
    assert any("BW peak[Gb/sec]" in ln for ln in out["client"])
    assert sum("local address" in ln for ln in out["client"]) == 2


async def test_duration() -> None:
    with trio.fail_after(60):
        _out, _, client = await pair("send_bw", "-D", "1", "-s", "256")
    assert client.bw[0].iters > 0 and client.bw[0].bw_peak == 0.0


async def test_all_sizes_up_to_max() -> None:
    with trio.fail_after(90):
        _out, _, client = await pair("write_bw", "-a", "--max-size", "64", "-n", "20")
    assert [r.size for r in client.bw] == [2, 4, 8, 16, 32, 64]


@pytest.mark.parametrize("tool", ["write_bw", "read_bw", "send_bw"])
async def test_vs_tcp_runs_every_size_over_plain_tcp_too(tool: str) -> None:
    with trio.fail_after(90):
        out, _, client = await pair(tool, "-a", "--max-size", "64", "-n", "20", "--vs-tcp")
    sizes = [2, 4, 8, 16, 32, 64]
    assert [r.size for r in client.tcp] == sizes
    assert all(r.iters == 20 and r.bw_avg > 0 and r.msg_rate > 0 for r in client.tcp)
    head = out["client"].index(" The same transfers over plain TCP between the same hosts "
                               "(--vs-tcp):")  # fmt: skip
    table = [ln.split() for ln in out["client"][head + 2 : head + 2 + len(sizes)]]
    assert [int(row[0]) for row in table] == sizes
    for row, ours, tcp in zip(table, client.bw, client.tcp, strict=True):
        assert float(row[3]) == pytest.approx(ours.bw_avg / tcp.bw_avg, rel=0.01, abs=0.001)


async def test_vs_tcp_moves_as_many_messages_as_all_qps() -> None:
    with trio.fail_after(60):
        _out, _, client = await pair("read_bw", "-n", "30", "-s", "1024", "-q", "2", "--vs-tcp")
    assert client.bw[0].iters == client.tcp[0].iters == 60


async def test_vs_tcp_with_duration() -> None:
    with trio.fail_after(60):
        _out, _, client = await pair("write_bw", "-D", "1", "-s", "4096", "--vs-tcp")
    (tcp,) = client.tcp
    assert tcp.size == 4096 and tcp.iters > 0 and tcp.bw_avg > 0


async def test_vs_tcp_refused_by_a_server_without_it() -> None:
    """A server that announces no raw TCP port (as perftest never does) is refused after
    the version exchange, before anything is measured."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def serve(task_status=trio.TASK_STATUS_IGNORED):  # type: ignore[no-untyped-def]
                with contextlib.suppress(PerfError):  # the client goes away mid-exchange
                    cfg = config("write_bw", "-p", "0", "--bind", "127.0.0.1", "-n", "20")
                    await run(cfg, lambda line: None, task_status=task_status)

            port = await nursery.start(serve)
            client = config("write_bw", "-p", str(port), "-n", "20", "--vs-tcp", "127.0.0.1")
            with pytest.raises(PerfError, match="serves no raw TCP; run it as rdmashim perf"):
                await run(client, lambda line: None)


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_plot_file(tmp_path, suffix: str) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    port = free_port()
    common = ["perf", "write_bw", "-a", "--max-size", "32", "-n", "10", "-p", str(port)]
    if suffix == "svg":
        common.append("--vs-tcp")
    server = subprocess.Popen([*RDMASHIM, *common, "--bind", "127.0.0.1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        target = tmp_path / f"sweep.{suffix}"
        out = rdmashim(*common, "--plot", str(target), "127.0.0.1")
        assert out.returncode == 0, out.stderr
        assert server.wait(30) == 0
    finally:
        server.kill()
    data = target.read_bytes()
    if suffix == "png":
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
    else:
        assert b"<svg" in data[:2000]
    assert len(rows(out.stdout.splitlines(), 32)) == (2 if suffix == "svg" else 1)
    if suffix == "svg":  # both series drawn: their legend labels are in the drawing
        assert b"raw TCP" in data and b"rdmashim" in data


def _on_a_pty(argv: list[str], port: int) -> tuple[subprocess.CompletedProcess[bytes], str]:
    """Run a client with stderr on a pseudo-terminal (a server beside it); its exit and
    what the terminal got."""
    server = subprocess.Popen([*RDMASHIM, *argv, "-p", str(port), "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    leader, follower = pty.openpty()
    try:
        done = subprocess.run([*RDMASHIM, *argv, "-p", str(port), "127.0.0.1"],
                              stdout=subprocess.PIPE, stderr=follower, timeout=120,
                              check=False)  # fmt: skip
        os.close(follower)
        drawn = b""
        with contextlib.suppress(OSError):  # EIO once the pty has no writer
            while chunk := os.read(leader, 65536):
                drawn += chunk
        assert server.wait(30) == 0
    finally:
        os.close(leader)
        server.kill()
    return done, drawn.decode(errors="replace")


@pytest.mark.parametrize(
    ("argv", "label"),
    [
        (["perf", "write_bw", "-a", "--max-size", "16", "-n", "400", "--vs-tcp"], "16 B tcp (4/4)"),
        (["perf", "send_bw", "-D", "1", "-s", "64"], "64 B"),
    ],
)
def test_progress_on_a_terminal_only(argv: list[str], label: str) -> None:
    """A long run draws a tqdm bar per size on stderr when it is a terminal (messages of
    the total; with -D, the count and rate), and nothing there when it is not."""
    done, drawn = _on_a_pty(argv, free_port())
    assert done.returncode == 0, drawn
    assert f"{label}:" in drawn and "msg" in drawn, drawn
    assert "msg" not in done.stdout.decode()  # the table on stdout stays clean
    piped = subprocess.Popen([*RDMASHIM, *argv, "-p", str(port := free_port()), "--bind",
                              "127.0.0.1"], stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        quiet = rdmashim(*argv, "-p", str(port), "127.0.0.1", timeout=120)
        assert piped.wait(30) == 0
    finally:
        piped.kill()
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["write_bw", "-s", "0"], "'0' is out of range"),
        (["write_bw", "-n", "2"], "'2' is out of range"),
        (["write_lat", "-q", "2"], "latency tests run one QP"),
        (["read_bw", "-c", "UD"], "connection type UD is not supported"),
        (["write_bw", "-a", "-D", "2"], "-D and -a do not go together"),
        (["write_bw", "--plot", "x.pdf", "-a", "127.0.0.1"], "must end in .png or .svg"),
        (["write_bw", "--plot", "x.png", "127.0.0.1"], "--plot draws an -a sweep"),
        (["write_bw", "-r", "4"], "-r applies to the Send tests only"),
        (["send_lat", "--vs-tcp"], "--vs-tcp runs with the bandwidth tests only"),
        (["send_bw", "-o", "4"], "-o applies to the Read tests only"),
        (["nosuch_bw"], "invalid choice"),
    ],
)
def test_bad_flags_one_line(argv: list[str], text: str) -> None:
    assert_one_error_line(rdmashim("perf", *argv), 2, text)


def test_no_server_one_line() -> None:
    port = free_port()
    out = rdmashim("perf", "write_bw", "-p", str(port), "-n", "5", "127.0.0.1", timeout=60)
    assert_one_error_line(out, 1, "cannot reach a perftest server")


def test_help_lists_tools() -> None:
    out = subprocess.run([*RDMASHIM, "perf", "-h"], capture_output=True, text=True, check=True)
    for tool in TOOLS:
        assert tool in out.stdout
    assert sys.executable
