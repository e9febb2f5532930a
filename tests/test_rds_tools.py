"""rdmashim rds ping / stress / info / demo: the commands as a user runs them, and their library."""

from __future__ import annotations

import re

import pytest
import trio

from rdmashim.rdstools import demo
from rdmashim.rdstools.common import drain
from rdmashim.rdstools.defaults import DEMO_MIN_SIZE, MIN_STRESS_BYTES
from rdmashim.rdstools.info import format_info
from rdmashim.rdstools.ping import PingReply, format_ping_reply
from rdmashim.rdstools.stress import (
    STRESS_COLUMNS,
    STRESS_HEADER,
    StressConfig,
    StressSample,
    format_stress_row,
)
from rdmashim.ulps.rds.node import RdsNode

from clirun import STRESS_ROW as ROW
from clirun import background, free_port, rdmashim, subnet
from rdsnodes import transports


# ------------------------------------------------------------------ the commands
@transports
def test_ping_gets_replies_and_info_shows_the_pinger(transport: str) -> None:
    net = subnet()
    server, pinger, asker = net + "1", net + "2", net + "3"
    port = str(free_port(server))
    over = ("--cm-port", port, "--transport", transport)
    with background("rds", "ping", "--serve", "-I", server, *over) as responder:
        out = rdmashim("rds", "ping", "-I", pinger, *over, "-c", "3", "-i", "200ms", server)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert [line.split(":")[0].strip() for line in lines] == ["1", "2", "3"]
        assert all(re.fullmatch(r"\s+\d+: \d+ usec", line) for line in lines), lines

        info = rdmashim("rds", "info", "-I", asker, *over, "-n", "-c", server)
        assert info.returncode == 0, info.stderr
        assert "RDS Connections:" in info.stdout and "Counters:" in info.stdout
        conns = info.stdout.split("RDS Connections:")[1]
        assert pinger in conns and asker in conns  # the query's own connection shows too
        recv = re.search(r"recv_messages\s+(\d+)", info.stdout)
        assert recv is not None and int(recv.group(1)) >= 4  # 3 pings and the query
        assert responder.interrupt()[0] == 130  # Ctrl-C


def test_ping_without_a_responder_fails_and_serve_needs_an_address() -> None:
    net = subnet()
    out = rdmashim("rds", "ping", "--serve")
    assert out.returncode == 2 and "--serve needs -I" in out.stderr
    port = str(free_port(net + "2"))
    out = rdmashim("rds", "info", "-I", net + "2", "--cm-port", port, "--timeout", "1", net + "1")
    assert out.returncode == 1
    assert "no rds-info answer" in out.stderr


def stress_run(*flags: str, transport: str = "rdma") -> tuple[str, str]:
    """``rds stress`` active with ``flags`` against a passive one: both sides' output."""
    net = subnet()
    passive_ip, active_ip = net + "1", net + "2"
    over = ("--cm-port", str(free_port(passive_ip)), "--transport", transport)
    with background("rds", "stress", "-r", passive_ip, *over) as passive:
        out = rdmashim("rds", "stress", "-r", active_ip, "-s", passive_ip, *over, *flags)
        assert out.returncode == 0, out.stderr
        status, passive_out, _ = passive.finish(timeout=15)
        assert status == 0
    return out.stdout, passive_out


@transports
def test_stress_prints_rds_stress_columns(transport: str) -> None:
    stdout, passive_out = stress_run(
        "-T", "3", "-q", "1024", "-a", "256", "-t", "2", "-d", "4", transport=transport
    )  # fmt: skip
    lines = stdout.splitlines()
    head = lines.index(STRESS_COLUMNS)
    assert re.fullmatch(r"tsks +tx/s +tx\+rx K/s +rw\+rr K/s +tx us/c +rtt us +cpu %", lines[head])
    rows = [ROW.match(line) for line in lines[head + 1 :] if ROW.match(line)]
    assert len(rows) >= 2  # seconds of the run (the third one may end after the run)
    assert all(int(r.group(1)) == 2 and int(r.group(2)) > 0 for r in rows)
    average = [line for line in lines if line.endswith("(average)")]
    assert len(average) == 1
    tsks, tx, kps, rdma, _us_c, rtt, cpu = average[0].split()[:7]
    assert int(tsks) == 2 and int(tx) > 0 and float(kps) > 0 and float(rdma) == 0
    assert float(rtt) > 0 and 0 < float(cpu) <= 100
    # The passive side saw every request of the run (and the start-up ones).
    requests = int(re.search(r"run over: (\d+) requests in, (\d+) acks out", passive_out)[1])
    assert requests >= int(tx)


@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_stress_with_rdma_bytes(read: bool) -> None:
    """-D: every ack carries an RDMA Write into (or Read of) its request's buffer."""
    stdout, passive_out = stress_run(
        "-T", "2", "-q", "64", "-a", "16", "-d", "4", "-D", "65536", "-z",
        *(["--rdma-read"] if read else []),
    )  # fmt: skip
    assert "65536 B RDMA " + ("Read" if read else "Write") + " per ack" in stdout
    average = next(line for line in stdout.splitlines() if line.endswith("(average)"))
    _, tx, _, rdma = average.split()[:4]
    # Every acknowledged request moved its 64 KiB (the last few may be in flight).
    assert float(rdma) > 0 and abs(float(rdma) - 64 * int(tx)) <= 64 * 8, average
    assert re.search(r"\d+\.\d+ RDMA K/s \(0 failed\)", passive_out), passive_out


def test_stress_with_busy_polling() -> None:
    """--busy-poll: the active side's waits for acks poll 50 us before they block."""
    stdout, _ = stress_run("-T", "1", "-d", "2", "-z", "--busy-poll", "50us")
    average = next(line for line in stdout.splitlines() if line.endswith("(average)"))
    assert int(average.split()[1]) > 0, average
    out = rdmashim("rds", "stress", "-r", "127.0.0.1", "--busy-poll", "-1")
    assert out.returncode == 2 and "--busy-poll" in out.stderr


def test_stress_rdma_bytes_need_the_rdma_transport() -> None:
    out = rdmashim("rds", "stress", "-r", "127.0.0.1", "-s", "127.0.0.2", "--transport", "tcp",
                   "-D", "4096")  # fmt: skip
    assert out.returncode == 2 and "-D (RDMA bytes) needs --transport rdma" in out.stderr


async def test_stress_config_checks_rdma_room() -> None:
    with pytest.raises(ValueError, match="req_bytes"):
        StressConfig("10.0.0.1", req_bytes=MIN_STRESS_BYTES, rdma_bytes=4096)
    with pytest.raises(ValueError, match="rdma_bytes"):
        StressConfig("10.0.0.1", rdma_bytes=-1)


@transports
def test_demo_loses_nothing_through_cuts(transport: str) -> None:
    out = rdmashim("rds", "demo", "-T", "3", "--cuts", "2", "--address", subnet() + "1", "-q",
                   "--transport", transport)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "lost 0, duplicated 0, out of order 0, corrupt 0" in out.stdout
    assert out.stdout.count("cut the connection") == 2
    assert out.stdout.count("reconnected after") == 2
    sent = int(re.search(r"sent (\d+) messages, delivered (\d+)", out.stdout)[1])
    assert sent > 1000
    assert re.search(r"throughput: \d+ messages/s, [\d.]+ MB/s", out.stdout)
    assert "OK: every message arrived exactly once, in order and intact" in out.stdout


# ------------------------------------------------------------------ the library
def test_formats_follow_rds_tools() -> None:
    assert format_ping_reply(PingReply(1, 23)) == "   1: 23 usec"
    assert format_ping_reply(PingReply(12, 40, "10.0.0.9", dup=True)) == (
        "  12: 40 usec (10.0.0.9) DUP!"
    )
    assert format_ping_reply(PingReply(3, error="No route to host")) == (
        "   3: ERROR: No route to host"
    )
    sample = StressSample(seconds=2.0, tasks=1, requests=1000, tx_bytes=1024_000,
                          rx_bytes=256_000, send_calls=1000, send_usecs=50_000.0, rtts=1000,
                          rtt_usecs=400_000.0, cpu_seconds=1.0)  # fmt: skip
    assert format_stress_row(sample) == "   1    500     625.00       0.00   50.00   400.00 50.00"
    assert len(format_stress_row(sample)) == len(STRESS_COLUMNS)
    with pytest.raises(ValueError):
        StressConfig("127.0.0.1", req_bytes=8)
    # The CLI's bounds (rdstools.defaults, plain values) are the messages' own sizes.
    assert STRESS_HEADER.size == MIN_STRESS_BYTES and demo._STAMP.size == DEMO_MIN_SIZE


async def test_format_info_shows_nodes_of_this_process() -> None:
    net = subnet()
    a = RdsNode(net + "1", 0)
    async with a, RdsNode(net + "2", a.port) as b:
        sa, sb = a.bind(4000), b.bind(4001)
        with trio.fail_after(20):
            await sa.sendto(b"x" * 100, (net + "2", 4001))
            assert await sb.recvfrom() == (b"x" * 100, (net + "1", 4000))
            await drain(a)
        text = format_info([a, b], "knc")
        assert text.index("RDS Sockets:") < text.index("RDS Connections:")
        assert re.search(rf"{re.escape(net)}2\s+4001\s+0\.0\.0\.0\s+0\s+\d+\s+\d+\s+0", text)
        (rds,) = a.connections()
        row = rf"{re.escape(net)}1\s+{re.escape(net)}2\s+0\s+{rds.next_seq}\s+1 --C-"
        assert re.search(row, text), text
        assert re.search(r"send_messages\s+1$", text, re.M)
        assert re.search(r"recv_bytes\s+100$", text, re.M)
        # Unread messages show in the receive queue with the sender's sequence numbers.
        with trio.fail_after(20):
            await sa.sendto(b"y" * 7, (net + "2", 4001))
            await sa.sendto(b"z" * 9, (net + "2", 4001))
            await drain(a)  # acknowledged: in b's socket by now
        text = format_info(b, "r")
        assert text.startswith("Receive Message Queue:"), text
        rows = [line.split() for line in text.splitlines()[2:]]
        first = rds.next_seq - 2  # a's numbers after the first message (maps go unnumbered)
        assert rows == [
            [net + "2", "4001", net + "1", "4000", "0", str(first), "7"],
            [net + "2", "4001", net + "1", "4000", "0", str(first + 1), "9"],
        ]
        with pytest.raises(ValueError, match="no rds-info table"):
            format_info(a, "x")


async def test_format_info_tcp_table_shows_the_stream() -> None:
    net = subnet()
    a = RdsNode(net + "1", 0, transport="tcp")
    async with a, RdsNode(net + "2", a.port, transport="tcp") as b:
        sa, sb = a.bind(4000), b.bind(4001)
        with trio.fail_after(20):
            await sa.sendto(b"x" * 100, (net + "2", 4001))
            assert await sb.recvfrom() == (b"x" * 100, (net + "1", 4000))
            await drain(a)
        text = format_info(a, "T")
        assert text.startswith("TCP Connections:"), text
        # Our end (any port) to the peer's RDS port: no message half read; written
        # bytes (map, probe, message) all acknowledged.
        row = re.search(
            rf"{re.escape(net)}1\s+\d+\s+{re.escape(net)}2\s+{a.port}\s+48\s+0\s+(\d+)\s+(\d+)\s+(\d+)",
            text,
        )
        assert row is not None, text
        sent, expect, seen = map(int, row.groups())
        assert sent == expect == seen > 8192 + 48 * 3 + 100
        assert format_info(a, "n").count(net) == 2  # and the other tables as before
