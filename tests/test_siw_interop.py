"""rping between our engine and the Linux kernel's siw (a QEMU guest, ``tests/siwvm.py``).

One guest boots per module (about 12 s under TCG) in the host network namespace
``siwvm``; the host side runs ``rdmashim ping`` inside that namespace. Each test
captures the connection with tcpdump on the namespace's bridge and has
``check_pcap.py`` (Wireshark's dissectors) judge it: our frames must be clean;
the only finding tolerated is siw's non-zero PAD bytes (``mpa.pad``) in frames
the guest sent.

* kernel ``rping -s`` in the guest, our ``ping -c -V -C 10`` on the host, with
  CRC on and off, with and without MPA peer-to-peer, and a multi-segment size;
* our ``ping -s`` on the host, kernel ``rping -c -v -V -C 10`` in the guest
  (the CLI, CRC on and off), and our server as a library coroutine.

**Known siw bug (responder race).** When the initiator's first FPDU follows the
MPA Reply within about a millisecond, the kernel's siw responder sometimes never
serves it: our client, the initiator, waits forever for the go-ahead of ping 0
(see the siwvm README and the report in ``test_initiator_race_rate``). An
attempt that fails with exactly that signature is retried (at most
:data:`RACE_ATTEMPTS` times, and reported); any other failure fails the test.
No delay is added anywhere. ``RDMASHIM_SIW_RACE_RUNS=N`` makes
``test_initiator_race_rate`` measure how often it happens;
``RDMASHIM_SIW_KO=path/to/siw.ko`` runs everything against another siw build
(for example one with the fix proposed for ``siw_accept``).

Needs root, QEMU and the image built by ``shared/tools/siwvm/build.sh``; skipped
otherwise. The capture needs tcpdump and tshark, and is left out without them.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import siwvm
import trio

from rdmashim.ping import PingConfig, c_string, ping_data, run_server

import wirecap

pytestmark = [pytest.mark.slow, pytest.mark.interop]

REQUIRE_ENV = "RDMASHIM_REQUIRE_INTEROP"
"""Set to 1 (CI does, once it built the guest image) to fail instead of skipping."""
PING_CLI = [sys.executable, "-m", "rdmashim.cli", "ping"]
COUNT = 10
STEP_TIMEOUT = 5.0
"""Our ping's --timeout: seconds any one step may wait (a TCG guest answers in milliseconds)."""
RUN_LIMIT = 90.0
RACE_ATTEMPTS = 5
RACE_ENV = "RDMASHIM_SIW_RACE_RUNS"
NO_CAPTURE_ENV = "RDMASHIM_SIW_NO_CAPTURE"
"""Set to 1 to run without tcpdump (the capture changes the timing the siw race depends on)."""
_ports = itertools.count(17200)

RPING_SERVER = r"""
rping -s -a {guest} -p {port} -v -V -S {size} > $JOB.rping 2> $JOB.rping-err & P=$!
for i in $(seq 400); do
    rdma resource show cm_id 2>/dev/null | grep -q "LISTEN.*src-addr {guest}:{port} " && break
    sleep 0.05
done
touch $JOB.listening
while kill -0 $P 2>/dev/null && [ ! -f $JOB.stop ]; do sleep 0.05; done
if [ -f $JOB.stop ] && kill -0 $P 2>/dev/null; then
    sleep 1; kill -9 $P 2>/dev/null && echo "rping: killed (stuck)"
fi
wait $P; RC=$?
cat $JOB.rping $JOB.rping-err
echo "rping exit $RC"
dmesg -c | grep -iE "siw|iw_cm|rdma|iwpm" | grep -vE "taint|verification" | tail -n 20
exit $RC
"""

RPING_CLIENT = r"""
timeout 60 rping -c -a {host} -p {port} -v -V -C {count} -S {size} 2> $JOB.rping-err; RC=$?
cat $JOB.rping-err
echo "rping exit $RC"
dmesg -c | grep -iE "siw|iw_cm|rdma|iwpm" | grep -vE "taint|verification" | tail -n 20
exit $RC
"""


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def guest() -> Iterator[siwvm.Guest]:
    """One booted guest with siw0 for the whole module (skipped where it cannot boot)."""
    why = siwvm.missing_requirements()
    if why and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but the kernel peer is not available: {why}")
    if why:
        pytest.skip(why)
    created = siwvm.netns_up()
    siw_ko = os.environ.get(siwvm.SIW_KO_ENV)
    vm = siwvm.Guest(siw_ko=Path(siw_ko) if siw_ko else None)
    try:
        vm.start()
        print(f"\nguest {vm.name} ready after {vm.boot_seconds:.1f} s")
        yield vm
    finally:
        dmesg = vm.stop()
        print(f"\nguest booted {vm.boots} time(s); crash logs: {[str(p) for p in vm.crashes]}")
        siw_lines = [line for line in dmesg.splitlines() if "siw" in line.lower()]
        print(f"\nguest dmesg (siw): {len(siw_lines)} lines", *siw_lines[-10:], sep="\n")
        if created:
            siwvm.netns_down()


@pytest.fixture
def netns_tcpdump() -> bool:
    """Whether captures can be taken (tcpdump, tshark, check_pcap; not switched off)."""
    return not wirecap.missing_requirements() and os.environ.get(NO_CAPTURE_ENV) != "1"


@asynccontextmanager
async def capture(enabled: bool, pcap: Path, port: int) -> AsyncIterator[Any]:
    if not enabled:
        yield None
        return
    async with wirecap.tcpdump(pcap, port, interface="br0", netns=siwvm.NETNS) as cap:
        yield cap


async def judge(pcap: Path, port: int) -> dict[str, Any]:
    """check_pcap.py's verdict, less two findings that are not ours to fix.

    Set aside (and counted): siw's non-zero PAD bytes (``mpa.pad`` lint) in frames
    the guest sent, and TCP retransmissions, which check_pcap reports as payload
    "not dissected as MPA" (tshark does not frame a retransmitted copy; a slow TCG
    guest's delayed ACKs provoke tail-loss probes). Adds ``our_problems`` (must be
    empty), ``guest_pad`` and ``retransmissions``.
    """
    rc, result, _ = await wirecap.check_pcap(pcap, port)
    sources, retransmissions = await siwvm.frame_facts(pcap)
    lint = result.get("lint", [])
    guest_pad = [
        p for p in lint if p["rule"] == "mpa.pad" and sources.get(p["frame"]) == siwvm.GUEST_IP
    ]
    other_lint = [p for p in lint if p not in guest_pad]
    undissected = [
        u for u in result.get("undissected_payload", []) if u["frame"] not in retransmissions
    ]
    problems = [
        p
        for p in result.get("problems", [])
        if "(lint)" not in p and "not dissected as MPA" not in p
    ]
    if other_lint:
        problems.append(f"lint: {other_lint}")
    if undissected:
        problems.append(f"payload not dissected as MPA: {undissected}")
    result["our_problems"] = problems
    result["guest_pad"] = guest_pad
    result["retransmissions"] = sorted(retransmissions)
    result["check_pcap_rc"] = rc
    return result


def check_wire(
    result: dict[str, Any], *, crc: bool, p2p: bool, req_crc: bool | None = None
) -> None:
    """Clean wire, MPA start frames as asked (``req_crc``: the Request's C bit), every FPDU."""
    text = wirecap.summary(result)
    assert not result["our_problems"], f"check_pcap found problems:\n{text}"
    starts = result["mpa_start_frames"]
    assert (starts["req"], starts["rep"]) == (1, 1), text
    for frame in starts["frames"]:
        asked = crc if req_crc is None or frame["type"] == "rep" else req_crc
        assert frame["flags"]["C"] == asked and not frame["flags"]["M"], text
        assert frame["mpa_v2"]["peer2peer"] == p2p, text
    if crc:
        assert result["crc"] == {"good": result["fpdus"], "bad": 0, "not_checked": 0}, text
    else:
        assert result["crc"]["not_checked"] == result["fpdus"], text
    opcodes = result["rdmap_opcodes"]
    assert opcodes.get("Read Request") == COUNT and opcodes.get("Write", 0) >= COUNT, text
    assert opcodes.get("Send") == 4 * COUNT, text


def expected_lines(prefix: str, size: int) -> list[str]:
    return [prefix + c_string(ping_data(i, size)).decode() for i in range(COUNT)]


def data_lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


def same_lines(got: list[str], want: list[str]) -> str:
    """ "" when equal, else a short description of the first difference."""
    if got == want:
        return ""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            at = next(k for k in range(min(len(g), len(w)) + 1) if g[k : k + 1] != w[k : k + 1])
            return f"line {i} differs at column {at}: {g[max(0, at - 20) : at + 40]!r}"
    return f"{len(got)} lines, expected {len(want)}"


# ---------------------------------------------------------------- kernel server, our client


def _short(text: str, width: int = 160) -> str:
    return "\n".join(
        line if len(line) <= width else line[:width] + "..." for line in text.strip().splitlines()
    )


@dataclass
class Attempt:
    port: int
    client: siwvm.Done
    guest_rc: int
    guest_out: str
    pcap: Path | None
    wire: dict[str, Any] | None = None
    seconds: float = 0.0
    guest_crash: str = ""
    """The guest's oops when it died during the attempt."""

    @property
    def ok(self) -> bool:
        return self.client.returncode == 0

    @property
    def race(self) -> bool:
        """The siw responder race: ping 0 never gets past the kernel's RDMA Read."""
        err = self.client.stderr
        stalled = "waiting for ping 0: the server's go-ahead after its RDMA Read" in err
        refused = "server disconnected after 0 of" in err and "post send error" in self.guest_out
        return stalled or refused

    def describe(self) -> str:
        wire = ""
        if self.wire is not None:
            wire = f"\nwire: {self.wire.get('rdmap_opcodes')} problems {self.wire['our_problems']}"
        crash = f"\nGUEST DIED:\n{self.guest_crash}" if self.guest_crash else ""
        return (
            f"port {self.port}: client rc {self.client.returncode} in {self.client.seconds:.1f} s"
            f"\nclient stderr: {self.client.stderr.strip()}"
            f"\nguest rc {self.guest_rc}:\n{_short(self.guest_out)}{wire}{crash}"
        )


async def kernel_server_attempt(
    guest: siwvm.Guest, tmp_path: Path, tcpdump: bool, *, size: int, options: list[str]
) -> Attempt:
    await guest.ensure_async()
    port = next(_ports)
    start = time.monotonic()
    job = guest.start_job(RPING_SERVER.format(guest=siwvm.GUEST_IP, port=port, size=size))
    await job.wait_file("listening", 30)
    pcap = tmp_path / f"kernel-server-{port}.pcap" if tcpdump else None
    async with capture(tcpdump, pcap or Path(), port):
        argv = [*PING_CLI, "-c", "-a", siwvm.GUEST_IP, "-p", str(port), "-v", "-V"]
        argv += ["-C", str(COUNT), "-S", str(size), "--timeout", str(STEP_TIMEOUT), *options]
        client = await siwvm.run_in_netns(argv, RUN_LIMIT)
        if client.returncode != 0:
            job.touch("stop")
        try:
            result = await job.wait(30)
        except RuntimeError:  # the guest died
            result = siwvm.JobResult(-1, job.output())
        except trio.TooSlowError:  # the guest's kernel is wedged (rping unkillable)
            guest.kill()
            result = siwvm.JobResult(-1, job.output() + "\n(job did not end: guest killed)")
    attempt = Attempt(port, client, result.returncode, result.output, pcap)
    if not guest.alive:
        console = await guest.ensure_async()
        attempt.guest_crash = siwvm.oops(console) if console else "(no console log)"
    if pcap is not None:
        attempt.wire = await judge(pcap, port)
    attempt.seconds = time.monotonic() - start
    return attempt


@dataclass
class RaceLog:
    attempts: list[Attempt] = field(default_factory=list)

    def summary(self) -> str:
        races = sum(a.race for a in self.attempts)
        crashes = sum(bool(a.guest_crash) for a in self.attempts)
        return (
            f"{len(self.attempts)} attempt(s), {races} hit the siw responder race, "
            f"{crashes} crashed the guest"
        )


async def until_not_race(
    guest: siwvm.Guest, tmp_path: Path, tcpdump: bool, *, size: int, options: list[str]
) -> tuple[Attempt, RaceLog]:
    log = RaceLog()
    for _ in range(RACE_ATTEMPTS):
        attempt = await kernel_server_attempt(guest, tmp_path, tcpdump, size=size, options=options)
        log.attempts.append(attempt)
        if attempt.guest_crash:
            warnings.warn(
                f"the guest's kernel crashed after this attempt:\n{attempt.describe()}",
                stacklevel=1,
            )
        if attempt.ok or not attempt.race:
            break
        print(f"siw responder race (retrying):\n{attempt.describe()}")
    return log.attempts[-1], log


@pytest.mark.parametrize(
    ("crc", "p2p", "size"),
    [
        (True, False, 64),
        (False, False, 64),
        (True, True, 64),
        (False, True, 64),
        (True, False, 5001),
    ],
    ids=["crc", "nocrc", "crc-p2p", "nocrc-p2p", "crc-5001"],
)
async def test_kernel_server_our_client(
    guest: siwvm.Guest, tmp_path: Path, netns_tcpdump: bool, crc: bool, p2p: bool, size: int
) -> None:
    options = ["--crc" if crc else "--no-crc", *(["--p2p"] if p2p else [])]
    attempt, log = await until_not_race(guest, tmp_path, netns_tcpdump, size=size, options=options)
    print(f"{log.summary()}; last took {attempt.seconds:.1f} s")
    # our wire must be clean in every attempt, the racy ones included
    for a in log.attempts:
        if a.wire is not None:
            assert not a.wire["our_problems"], a.describe()
    assert attempt.ok, f"{log.summary()}; the last one failed:\n{attempt.describe()}"
    ours = data_lines(attempt.client.stdout, "ping data: ")
    assert not (diff := same_lines(ours, expected_lines("ping data: ", size))), diff
    assert attempt.guest_rc == 0, attempt.describe()
    kernel = data_lines(attempt.guest_out, "server ping data: ")
    assert not (diff := same_lines(kernel, expected_lines("server ping data: ", size))), diff
    if attempt.wire is not None:
        check_wire(attempt.wire, crc=crc, p2p=p2p)
        wire = attempt.wire
        print(f"siw PAD lint: {len(wire['guest_pad'])}, retransmissions: {wire['retransmissions']}")


# ---------------------------------------------------------------- our server, kernel client


async def our_server_kernel_client(
    guest: siwvm.Guest, tmp_path: Path, tcpdump: bool, *, crc: bool, size: int, library: bool
) -> tuple[siwvm.JobResult, Any, dict[str, Any] | None]:
    await guest.ensure_async()
    port = next(_ports)
    pcap = tmp_path / f"our-server-{port}.pcap"
    server: dict[str, Any] = {}
    seen: list[bytes] = []

    async def serve_cli() -> None:
        argv = [*PING_CLI, "-s", "-a", siwvm.HOST_IP, "-p", str(port), "-v", "-V"]
        argv += ["-S", str(size), "--timeout", "30", "--crc" if crc else "--no-crc"]
        server["done"] = await siwvm.run_in_netns(argv, RUN_LIMIT)

    async def serve_library() -> None:
        config = PingConfig(
            server=True, address=siwvm.HOST_IP, port=port, size=size, crc=crc, timeout=30,
            on_data=lambda _i, data: seen.append(data),
        )  # fmt: skip
        server["done"] = await siwvm.in_netns(run_server, config)

    with trio.fail_after(RUN_LIMIT + 30):
        async with capture(tcpdump, pcap, port), trio.open_nursery() as nursery:
            nursery.start_soon(serve_library if library else serve_cli)
            await siwvm.wait_listening(port)
            result = await guest.run(
                RPING_CLIENT.format(host=siwvm.HOST_IP, port=port, count=COUNT, size=size),
                RUN_LIMIT,
            )
    wire = await judge(pcap, port) if tcpdump else None
    server["seen"] = seen
    return result, server, wire


@pytest.mark.parametrize("crc", [True, False], ids=["crc", "nocrc"])
async def test_our_server_kernel_client(
    guest: siwvm.Guest, tmp_path: Path, netns_tcpdump: bool, crc: bool
) -> None:
    result, server, wire = await our_server_kernel_client(
        guest, tmp_path, netns_tcpdump, crc=crc, size=64, library=False
    )
    done = server["done"]
    assert result.returncode == 0, f"{result.output}\nour server: {done}"
    kernel = data_lines(result.output, "ping data: ")
    assert not (diff := same_lines(kernel, expected_lines("ping data: ", 64))), diff
    assert done.returncode == 0, done
    ours = data_lines(done.stdout, "server ping data: ")
    assert not (diff := same_lines(ours, expected_lines("server ping data: ", 64))), diff
    if wire is not None:
        # the kernel never asks for CRC; our Reply does with --crc, and then both use it
        check_wire(wire, crc=crc, p2p=False, req_crc=False)


async def test_our_server_library_kernel_client_large(
    guest: siwvm.Guest, tmp_path: Path, netns_tcpdump: bool
) -> None:
    """Our server as a coroutine in the namespace; 5001-byte pings span several segments."""
    size = 5001
    result, server, wire = await our_server_kernel_client(
        guest, tmp_path, netns_tcpdump, crc=True, size=size, library=True
    )
    assert result.returncode == 0, f"{result.output}\nour server: {server}"
    kernel = data_lines(result.output, "ping data: ")
    assert not (diff := same_lines(kernel, expected_lines("ping data: ", size))), diff
    ping_result = server["done"]
    assert ping_result.pings == COUNT and ping_result.disconnected_by_peer
    assert server["seen"] == [c_string(ping_data(i, size)) for i in range(COUNT)]
    if wire is not None:
        check_wire(wire, crc=True, p2p=False, req_crc=False)


# ---------------------------------------------------------------- how often the siw race hits


@pytest.fixture
def race_runs() -> int:
    """``$RDMASHIM_SIW_RACE_RUNS`` (a sync fixture, so that the skip keeps its reason)."""
    runs = int(os.environ.get(RACE_ENV) or 0)
    if runs <= 0:
        pytest.skip(f"set {RACE_ENV}=N to measure the siw responder race")
    return runs


@pytest.mark.parametrize(
    ("crc", "p2p"),
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["crc", "nocrc", "crc-p2p", "nocrc-p2p"],
)
async def test_initiator_race_rate(
    race_runs: int, guest: siwvm.Guest, tmp_path: Path, netns_tcpdump: bool, crc: bool, p2p: bool
) -> None:
    """With ``RDMASHIM_SIW_RACE_RUNS=N``: N connections, no retries; count the races.

    Every failure must be the race; the numbers are printed (run with ``-s``).
    """
    runs = race_runs
    options = ["--crc" if crc else "--no-crc", *(["--p2p"] if p2p else [])]
    attempts = []
    for _ in range(runs):
        attempts.append(
            await kernel_server_attempt(guest, tmp_path, netns_tcpdump, size=64, options=options)
        )
    races = [a for a in attempts if a.race]
    crashes = sum(bool(a.guest_crash) for a in attempts)
    how = "with" if netns_tcpdump else "without"
    print(
        f"\nsiw race {' '.join(options)} ({how} capture): {len(races)} of {runs} connections"
        f" stalled, {crashes} guest crash(es)"
    )
    for a in races:
        print(a.describe())
    others = [a for a in attempts if not a.ok and not a.race]
    assert not others, "\n\n".join(a.describe() for a in others)
