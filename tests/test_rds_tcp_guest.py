"""Our RDS/TCP node against the Linux kernel's ``rds_tcp`` in a QEMU guest.

The guest (tap 6, 10.77.0.16) runs a Python program on a kernel RDS socket
(``AF_RDS``); our node runs on the host's bridge address (10.77.0.1) inside
the test bed's namespace, on TCP port 16385 as the kernel's. Messages go both
ways, pings on port 0 both ways, and the pair reconnects after the kernel's
``rds_tcp`` is unloaded and loaded again and after our node restarts.

Our address is the lower one, so our node carries the connection and the
kernel knocks when it speaks first (docs/rds.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import sys
import termios
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
import siwvm
import trio

from rdmashim.rdstools.info import format_info
from rdmashim.ulps.rds.node import RdsNode, RdsSocket
from rdmashim.ulps.rds.tcp import TcpSession
from rdmashim.ulps.rds.wire import RDS_CONG_MAP_BYTES, RDS_HEADER_LEN, RDS_TCP_PORT

pytestmark = [pytest.mark.slow, pytest.mark.interop]

T = TypeVar("T")
GUEST_IP = "10.77.0.16"
"""Our own tap and address, clear of the other guest modules' (taps 0 to 5)."""
TAP = 6
GUEST_NAME = "rdmashim-rdstcp"
HOST_IP = siwvm.HOST_IP
GUEST_PORT, HOST_PORT = 4000, 5000
SIZES = [0, 1, 47, 4095, 4097, 65536]
"""Message sizes, cycled (the kernel's default send buffer keeps them under 100 KiB)."""
N = 60
LIMIT = 120.0
KERNEL_WAIT = 90.0
"""Seconds the kernel side waits for any one message of ours before it gives up: the
guest's agent runs one job at a time, so a job waiting forever would keep the liveness
check of :func:`judged` from running and pass our stall off as the guest's."""

STALL_LIMIT = 30.0
"""Seconds our side waits for any one message of the kernel's before it asks both sides
for their state and fails: a round takes about 3 s, and our node forgets a peer idle
for 60 s (``peer_idle_expiry``), so its state is still there to show."""
STATE_WAIT = 15.0
"""Seconds the kernel side has to print its state and end when asked."""

KERNEL_SIDE = rf"""
import ctypes, errno, os, socket, struct, subprocess, sys, threading, time
job, host, me, n = os.environ["JOB"], sys.argv[1], sys.argv[2], int(sys.argv[3])
sizes = [int(x) for x in sys.argv[4].split(",")]
s = socket.socket(socket.AF_RDS, socket.SOCK_SEQPACKET, 0)
s.bind((me, {GUEST_PORT}))
s.settimeout({KERNEL_WAIT})              # a wait of ours that never ends frees the agent
libc = ctypes.CDLL(None, use_errno=True)
def table(opt):                          # an RDS_INFO_* table (the guest has no rds-info)
    size = ctypes.c_int(4096)
    while True:
        buf = ctypes.create_string_buffer(size.value)
        each = libc.getsockopt(s.fileno(), 276, opt, buf, ctypes.byref(size))
        if each > 0 or ctypes.get_errno() != errno.ENOSPC:
            return [buf.raw[i : i + each] for i in range(0, size.value, max(each, 1))]
def rds_state():
    out = ["--- the kernel's RDS at " + time.strftime("%T")]
    for e in table(10001):               # RDS_INFO_CONNECTIONS
        tx, rx, la, fa, tr, fl = struct.unpack_from("<QQ4s4s16sB", e)
        out.append("conn %s->%s %s next_tx %d next_rx %d flags %#x" % (socket.inet_ntoa(la),
                   socket.inet_ntoa(fa), tr.rstrip(b"\0").decode(), tx, rx, fl))
    for name, opt in (("send", 10003), ("retrans", 10004), ("recv", 10005)):
        rows = [struct.unpack_from("<QI", e) + struct.unpack_from(">HH", e, 20)
                for e in table(opt)]
        out.append("%s queue (seq, bytes, lport, fport): %s" % (name, rows))
    for e in table(10007):               # RDS_INFO_TCP_SOCKETS
        v = struct.unpack_from("<4s2s4s2sQQIII", e)
        out.append("tcp %s:%d->%s:%d hdr_rem %d data_rem %d sent_nxt %d expected_una %d "
                   "seen_una %d" % (socket.inet_ntoa(v[0]), int.from_bytes(v[1], "big"),
                   socket.inet_ntoa(v[2]), int.from_bytes(v[3], "big"), *v[4:]))
    counters = [struct.unpack_from("<32sQ", e) for e in table(10000)]
    out.append("counters: " + ", ".join("%s %d" % (k.rstrip(b"\0").decode(), v)
                                         for k, v in counters if v))
    ss = subprocess.run(["ss", "-tnoi", "( sport = :16385 or dport = :16385 )"],
                        capture_output=True, text=True)
    out.append(ss.stdout.rstrip())
    dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()
    out += [line for line in dmesg if "rds" in line.lower()][-15:]
    return "\n".join(out)
def asked():                             # our side saw a stall: show the state, and end
    while not os.path.exists(job + ".dump"):
        time.sleep(0.05)
    print("kernel side asked for its state at", step, flush=True)
    print(rds_state(), flush=True)
    os._exit(3)
step = "ready"
threading.Thread(target=asked, daemon=True).start()
open(job + ".ready", "w").close()
while not os.path.exists(job + ".go"):
    time.sleep(0.05)
def body(tag, i):
    return (b"%s%d:" % (tag, i) + bytes(range(256)) * 300)[: max(sizes[i % len(sizes)], 8)]
step = "sending"
try:
    for i in range(n):                   # the kernel speaks first (it knocks)
        step = "sending message %d" % i
        s.sendto(body(b"k", i), (host, {HOST_PORT}))
    for i in range(n):                   # then echoes what we send
        step = "waiting for message %d" % i
        data, addr = s.recvfrom(1 << 20)
        s.sendto(b"echo:" + data, addr)
    step = "pinging"
    s.sendto(b"", (host, 0))             # an RDS ping to our node
    data, addr = s.recvfrom(100)
except OSError as exc:
    print("kernel side stopped", step, repr(exc), flush=True)
    print(rds_state(), flush=True)
    raise
print("pong", repr(data), addr[0], addr[1], flush=True)
s.close()
"""


def body(tag: bytes, i: int) -> bytes:
    """What the kernel side sends as message ``i`` (the same rule as KERNEL_SIDE)."""
    return (b"%s%d:" % (tag, i) + bytes(range(256)) * 300)[: max(SIZES[i % len(SIZES)], 8)]


def kernel_job(vm: siwvm.Guest, reload: bool = False) -> siwvm.Job:
    """Start the kernel side in the guest (after reloading ``rds_tcp`` if ``reload``)."""
    sizes = ",".join(map(str, SIZES))
    return vm.start_job(
        "set -e\n"
        + ("rmmod rds_tcp\necho rds_tcp unloaded\n" if reload else "")
        + "modprobe rds_tcp\n"
        + f"cat > $JOB.py <<'EOF'\n{KERNEL_SIDE}EOF\n"
        + f"python3 $JOB.py {HOST_IP} {GUEST_IP} {N} {sizes}\n"
    )


@pytest.fixture(scope="module")
def guest() -> Iterator[siwvm.Guest]:
    with siwvm.booted(GUEST_NAME, GUEST_IP, TAP, ("rds",)) as vm:
        yield vm


ALIVE_LIMIT = 30.0
"""Seconds a guest that still runs programs takes to run ``true``."""


async def judged(guest: siwvm.Guest, run: Awaitable[T]) -> T:
    """``await run``; if it times out, tell our failure from the guest's.

    In one CI run the guest stopped running anything (``modprobe`` of a loaded module
    not done in 60 s) in the middle of this module, its kernel printing no oops. When
    the guest cannot run ``true`` either, the test is an xfail that says so, with the
    console's oops if any; when it can, the exchange stalled (our node or the kernel's
    rds_tcp) and the test fails, with what the kernel side last said. (The kernel side
    ends when our side asks it for its state (:func:`receive`), and gives up a wait of
    ours after :data:`KERNEL_WAIT`: else its job would keep ``true`` from running.)
    """
    try:
        return await run
    except (trio.TooSlowError, BaseExceptionGroup) as exc:
        if isinstance(exc, BaseExceptionGroup) and not exc.subgroup(trio.TooSlowError):
            raise
        try:
            await guest.run("true", ALIVE_LIMIT)
        except trio.TooSlowError:
            crash = siwvm.oops(guest.run_dir / "console.log") or "no oops on the console"
            pytest.xfail(f"the guest stopped running programs ({crash}); not our node's doing")
        said = {p.name: p.read_text()[-500:] for p in sorted(guest.share.glob("job.*.out"))}
        exc.add_note(f"the guest runs programs, so the exchange stalled; its jobs said {said}")
        raise


async def within(limit: float, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``fn(*args)``, failing after ``limit`` s (in the namespace's own trio loop)."""
    with trio.fail_after(limit):
        return await fn(*args)


def our_state(node: RdsNode) -> str:
    """Our node's side of a stall: rds-info's tables, and what they leave out."""
    extra = [
        f"peer {rds.peer}: heard {rds.heard}, peer generation {rds.peer_generation:#x}, "
        f"session {'up' if rds.connected else 'none'}, counters {rds.counters}"
        + (
            f", the session read {rds.session.bytes_read} bytes ({rds.session.decoder.buffered} "
            "of a message not whole)"
            if isinstance(rds.session, TcpSession)
            else ""
        )
        for rds in node.connections()
    ]
    extra.append(
        f"peers expired {node.peers_expired}, dropped for no socket {node.drops_no_socket}, "
        f"for a full socket {node.drops_rcvbuf_full}"
    )
    return "\n".join([f"--- our node at {time.strftime('%T')}", format_info(node), *extra])


async def receive(
    node: RdsNode, sock: RdsSocket, job: siwvm.Job, what: str, into: list[Any]
) -> tuple[bytes, tuple[str, int]]:
    """``sock.recvfrom()``, kept in ``into``; when :data:`STALL_LIMIT` passes first, both
    sides' state in a TooSlowError, with the tags of what came before (the kernel side
    prints its own state and ends: see :func:`judged`)."""
    with trio.move_on_after(STALL_LIMIT):
        message = await sock.recvfrom()
        into.append(message)
        return message
    tags = b" ".join(data.split(b":")[0] for data, _ in into).decode(errors="replace")
    ours = f"{our_state(node)}\nthe socket took, in order: {tags}"
    job.touch("dump")
    with contextlib.suppress(trio.TooSlowError):
        await job.wait(STATE_WAIT)
    raise trio.TooSlowError(
        f"no {what} within {STALL_LIMIT} s\n{ours}\n--- the kernel side\n{job.output()}"
    )


def all_read_and_taken(node: RdsNode, sock: RdsSocket) -> bool:
    """Whether our node took every byte the kernel wrote and gave its socket every message
    in them: one session carried them and is up, nothing waits unread in its socket, what
    it read is whole messages, maps and numbered ones, none of them dropped, and our
    socket holds none untaken."""
    (rds,) = node.connections()
    c, session = rds.counters, rds.session
    if not isinstance(session, TcpSession) or session.lost or c.sessions - c.sessions_refused != 1:
        return False
    unread = fcntl.ioctl(session.stream.socket.fileno(), termios.FIONREAD, b"\0" * 4)
    maps = c.cong_updates_received
    whole = RDS_HEADER_LEN * (c.recv_messages + maps) + RDS_CONG_MAP_BYTES * maps + c.recv_bytes
    dropped = c.recv_drop_old_seq + node.drops_no_socket + node.drops_rcvbuf_full
    return (
        int.from_bytes(unread, sys.byteorder) == 0 and session.decoder.buffered == 0
        and session.bytes_read == whole and not dropped and not sock.received
    )  # fmt: skip


def kernel_flushed(node: RdsNode, sock: RdsSocket, got: list[Any], kernel_said: str) -> str:
    """Why the kernel's messages missing from ``got`` are the kernel's loss, or "" when
    any part of that loss's signature is missing (then the stall is a failure).

    Captured once in 45 runs of this module (and the stall of issue 31): k0, the first
    message of the round after our restart, never came, though the kernel sent the rest
    and held nothing. The kernel numbered k0 before it learned our new generation; our
    probe, which shows it, waits in the socket the kernel accepts, and its receive path
    takes it (``recv.c`` ``rds_conn_peer_gen_update``: ``RDS_MSG_FLUSH`` on every message
    on the retransmit list) while its send path, after the congestion map, has just moved
    k0 to that list and not yet looked at the flag, which makes ``rds_send_xmit``
    (``send.c``) drop k0 unsent. The signature: our node took every byte the kernel wrote
    and delivered every message in them (:func:`all_read_and_taken`), so k0 was never on
    the wire; the kernel restarted its numbering in this round; the kernel sent all it
    had (it waits for our message 0), holds nothing to send or resend, and TCP acked all
    it wrote; the missing ones are all numbered before its restart (of 60, the last
    ``next_tx - 1`` carry its new numbers); and our socket took the others once, in order.
    """
    (rds,) = node.connections()
    conn = re.search(r"conn \S+ tcp next_tx (\d+) ", kernel_said)
    tcp = re.search(r"expected_una (\d+) seen_una (\d+)", kernel_said)
    quiet = (
        "asked for its state at waiting for message 0" in kernel_said
        and "send queue (seq, bytes, lport, fport): []" in kernel_said
        and "retrans queue (seq, bytes, lport, fport): []" in kernel_said
    )
    if not (conn and tcp and quiet and tcp[1] == tcp[2] and rds.counters.peer_restarts):
        return ""
    renumbered = N - (int(conn[1]) - 1)  # k(renumbered) was the first numbered 1
    tags = [data.split(b":")[0] for data, _ in got]
    missing = [i for i in range(N) if b"k%d" % i not in tags]
    kept = [(body(b"k", i), (GUEST_IP, GUEST_PORT)) for i in range(N) if i not in missing]
    if not missing or max(missing) >= renumbered or got != kept:
        return ""
    if not all_read_and_taken(node, sock):
        return ""
    names = ", ".join(f"k{i}" for i in missing)
    return (
        f"the kernel dropped {names} unsent: numbered before it learned our new generation "
        f"(k0-k{renumbered - 1}), flagged RDS_MSG_FLUSH by rds_conn_peer_gen_update as "
        "rds_send_xmit moved it to the retransmit list, dropped there; our node read and "
        "delivered every byte the kernel wrote"
    )


async def exchange(node: RdsNode, sock: RdsSocket, job: siwvm.Job) -> dict[str, Any]:
    """One round with the kernel side: its messages, our messages and its echoes, pings.
    A stall waiting for the kernel's messages that has the signature of
    :func:`kernel_flushed` is an xfail saying so; any other stall fails."""
    await job.wait_file("ready", 60)
    job.touch("go")
    got: list[Any] = []
    try:
        for i in range(N):
            await receive(node, sock, job, f"kernel message {i}", got)
    except trio.TooSlowError:
        reason = kernel_flushed(node, sock, got, job.output())
        if reason:
            pytest.xfail(reason)
        raise
    accounted = all_read_and_taken(node, sock)  # (the kernel's burst is all here now)
    ours = [b"h%d:" % i + os.urandom(SIZES[i % len(SIZES)]) for i in range(N)]
    for data in ours:
        await sock.sendto(data, (GUEST_IP, GUEST_PORT))
    echoes: list[Any] = []
    for i in range(N):
        await receive(node, sock, job, f"echo {i}", echoes)
    await sock.sendto(b"", (GUEST_IP, 0))  # the kernel answers pings on port 0
    pong = await receive(node, sock, job, "pong", [])
    (conn,) = node.connections()
    return {
        "got": got, "ours": ours, "echoes": echoes, "pong": pong, "accounted": accounted,
        "sessions": conn.counters.sessions, "refused": conn.counters.sessions_refused,
        "peer_generation": conn.peer_generation,
        "counters": {
            k: getattr(conn.counters, k)
            for k in ("recv_messages", "send_messages", "retransmits", "recv_drop_old_seq",
                      "peer_restarts", "recv_seq_gaps", "cong_updates_sent")
        },
    }  # fmt: skip


def check_round(facts: dict[str, Any], job_result: siwvm.JobResult) -> None:
    keys = ("sessions", "refused", "peer_generation", "counters")
    shown = {k: v for k, v in facts.items() if k in keys}
    print("\nround with the kernel:", shown)
    assert job_result.returncode == 0, job_result.output
    assert facts["got"] == [(body(b"k", i), (GUEST_IP, GUEST_PORT)) for i in range(N)]
    assert facts["echoes"] == [(b"echo:" + m, (GUEST_IP, GUEST_PORT)) for m in facts["ours"]]
    assert facts["pong"] == (b"", (GUEST_IP, 0))
    assert f"pong b'' {HOST_IP} 0" in job_result.output  # our node answered its ping
    # What kernel_flushed relies on holds whenever one session carried the burst.
    assert facts["accounted"] or facts["sessions"] - facts["refused"] > 1


@pytest.fixture
def node_log(caplog: pytest.LogCaptureFixture) -> None:
    """Our node's INFO lines (sessions lost, knocks, restarts) in a failure's report."""
    caplog.set_level(logging.INFO, logger="rdmashim.ulps.rds")


@pytest.mark.usefixtures("node_log")
async def test_messages_both_ways_and_pings(guest: siwvm.Guest) -> None:
    async def host() -> dict[str, Any]:
        async with RdsNode(HOST_IP, RDS_TCP_PORT, transport="tcp") as node:
            sock = node.bind(HOST_PORT)
            job = kernel_job(guest)
            facts = await exchange(node, sock, job)
            facts["result"] = await job.wait(LIMIT)
            return facts

    facts = await judged(guest, siwvm.in_netns(within, LIMIT, host))
    check_round(facts, facts["result"])
    # One session carried it all; the kernel may reset one that met its own knock.
    assert facts["sessions"] - facts["refused"] == 1


@pytest.mark.usefixtures("node_log")
async def test_reconnects_after_rmmod_and_after_our_restart(guest: siwvm.Guest) -> None:
    async def host() -> list[dict[str, Any]]:
        rounds = []
        async with RdsNode(HOST_IP, RDS_TCP_PORT, transport="tcp") as node:
            sock = node.bind(HOST_PORT)
            first = kernel_job(guest)
            rounds.append(await exchange(node, sock, first))
            rounds[-1]["result"] = await first.wait(LIMIT)
            second = kernel_job(guest, reload=True)  # the kernel's rds_tcp goes and comes back
            rounds.append(await exchange(node, sock, second))
            rounds[-1]["result"] = await second.wait(LIMIT)
        async with RdsNode(HOST_IP, RDS_TCP_PORT, transport="tcp") as node:  # we restart
            sock = node.bind(HOST_PORT)
            third = kernel_job(guest)
            rounds.append(await exchange(node, sock, third))
            rounds[-1]["result"] = await third.wait(LIMIT)
        return rounds

    rounds = await judged(guest, siwvm.in_netns(within, 3 * LIMIT, host))
    for facts in rounds:
        check_round(facts, facts["result"])
    assert "rds_tcp unloaded" in rounds[1]["result"].output
    assert rounds[1]["sessions"] >= 2  # the same node, connected again


async def test_rds_ping_cli_to_the_kernels_port_0(guest: siwvm.Guest) -> None:
    """``rdmashim rds ping -p 0 --transport tcp``: pinged as rds-ping pings, the kernel
    answers in ``rds_send_pong`` (no program on its side)."""
    loaded = await judged(guest, guest.run("modprobe rds_tcp && echo loaded", 60))
    assert loaded.returncode == 0, loaded.output
    argv = [
        sys.executable, "-m", "rdmashim", "rds", "ping", "-I", HOST_IP, "--transport", "tcp",
        "--cm-port", str(RDS_TCP_PORT), "-p", "0", "-c", "3", "-i", "200ms", GUEST_IP,
    ]  # fmt: skip
    done = await judged(guest, siwvm.run_in_netns(argv, 60))
    print("\n" + done.stdout)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == ["1", "2", "3"], lines


async def test_a_timeout_while_the_guest_runs_programs_fails(guest: siwvm.Guest) -> None:
    """:func:`judged` excuses only a guest that stopped: our own timeout stays a failure."""

    async def too_slow() -> None:
        with trio.fail_after(0.01):
            await trio.sleep(1)

    with pytest.raises(trio.TooSlowError):
        await judged(guest, too_slow())
