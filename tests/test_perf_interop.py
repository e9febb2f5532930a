"""``rdmashim perf`` against perftest in the Linux kernel's siw (QEMU guest), both ways.

One guest boots for the module (``tests/siwvm.py``; siw0 on eth0). For each of
write_bw, read_bw and send_bw: our client (``rdmashim perf TOOL -R``, in the
test bed's namespace) against the guest's ``ib_TOOL -R`` server, and the
guest's ``ib_TOOL -R HOST`` client against our server. Both sides must finish
and print a result row for the size and count asked (a write_bw/read_bw server
prints the client's figures, which it received in perftest's report exchange).
A round whose perftest could not time the guest's CPU (:data:`UNCALIBRATED`) is
run again, at most :data:`ATTEMPTS` times.

Needs root, QEMU and the image built by ``tools/guest/build.py`` (which
installs perftest); skipped otherwise, the skip naming what is missing. Other
modules boot guests too: run this under ``flock /tmp/rdmashim-guest.lock``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import siwvm
import trio

pytestmark = [pytest.mark.slow, pytest.mark.interop]

GUEST_IP = "10.77.0.15"
TAP = 5
SIZE = 4096
ITERS = 200
LIMIT = 240.0
TOOLS = ("write_bw", "read_bw", "send_bw")
ATTEMPTS = 3
"""Rounds a test may take when perftest's clock calibration failed in the guest."""
UNCALIBRATED = "Can't produce a report"
"""What perftest prints when it could not time the guest's CPU: it samples the cycle
counter against the clock and needs a fit of r^2 >= 0.9, which a TCG guest on a busy
host sometimes misses (the transfer itself was done; only its report is missing)."""


@pytest.fixture(scope="module")
def guest() -> Iterator[siwvm.Guest]:
    """One booted guest with siw0 for the whole module (skipped where it cannot boot)."""
    with siwvm.booted("rdmashim-perf", GUEST_IP, TAP) as vm:
        yield vm


def result_row(output: str) -> list[float]:
    """The numbers of the table row for :data:`SIZE` (perftest's or ours)."""
    rows = [line.split() for line in output.splitlines() if line.split()[:1] == [str(SIZE)]]
    assert rows, f"no result row for {SIZE} B in:\n{output}"
    return [float(x) for x in rows[-1][:5]]


def check_row(row: list[float], *, peak: bool = True) -> None:
    size, iters, bw_peak, bw_avg, rate = row
    assert size == SIZE and iters == ITERS
    assert bw_avg > 0 and rate > 0
    assert not peak or bw_peak >= bw_avg * 0.5


def ours(tool: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "rdmashim", "perf", tool, "-R", "-s", str(SIZE),
            "-n", str(ITERS), *args]  # fmt: skip


@pytest.mark.parametrize("tool", TOOLS)
async def test_our_client_against_perftest_server(guest: siwvm.Guest, tool: str) -> None:
    for attempt in range(ATTEMPTS):
        port = 18700 + 20 * attempt + TOOLS.index(tool)
        job = guest.start_job(
            f"ib_{tool} -R -d siw0 -p {port} -s {SIZE} -n {ITERS} > $JOB.server 2>&1; "
            "echo rc=$? >> $JOB.server"
        )
        client = await siwvm.run_in_netns(ours(tool, "-p", str(port), GUEST_IP), LIMIT)
        result = await job.wait(LIMIT)
        server = job.path("server").read_text(errors="replace")
        print(
            f"\nours ({tool} client):\n{client.stdout}{client.stderr}\nperftest server:\n{server}"
        )
        if UNCALIBRATED not in server:
            break
    assert client.returncode == 0, client.stderr
    assert result.returncode == 0 and "rc=0" in server
    check_row(result_row(client.stdout))
    check_row(result_row(server), peak=tool != "send_bw")


@pytest.mark.parametrize("tool", TOOLS)
async def test_perftest_client_against_our_server(guest: siwvm.Guest, tool: str) -> None:
    box: dict[str, siwvm.Done] = {}

    async def serve(port: int) -> None:
        box["server"] = await siwvm.run_in_netns(
            ours(tool, "-p", str(port), "--bind", siwvm.HOST_IP), LIMIT
        )

    for attempt in range(ATTEMPTS):
        port = 18710 + 20 * attempt + TOOLS.index(tool)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, port)
            await siwvm.wait_listening(port, 30)
            job = guest.start_job(
                f"ib_{tool} -R -d siw0 -p {port} -s {SIZE} -n {ITERS} {siwvm.HOST_IP} "
                "> $JOB.client 2>&1; echo rc=$? >> $JOB.client"
            )
            result = await job.wait(LIMIT)
        server = box["server"]
        client = job.path("client").read_text(errors="replace")
        print(
            f"\nperftest client:\n{client}\nours ({tool} server):\n{server.stdout}{server.stderr}"
        )
        if UNCALIBRATED not in client:
            break
    assert result.returncode == 0 and "rc=0" in client
    assert server.returncode == 0, server.stderr
    check_row(result_row(client))
    check_row(result_row(server.stdout), peak=tool != "send_bw")
