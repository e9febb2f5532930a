#!/usr/bin/env python3
"""Where an rds stress round trip goes: both ends' critical path, phase by phase.

``rds_stress.py``'s first case (``-t 1 -d 1``: one request in flight) is a
ping-pong: each end in turn wakes, reads the peer's message, hands it to the
stress tool, sends the answer and sleeps again. This script runs that case
with timestamps (``time.perf_counter_ns``) at the points where one layer hands
over to the next, in both processes, and prints the median time of each phase
at each end, beside raw TCP's round trip measured in the same run (samples
alternate ours, raw, ours, ...; raw TCP runs untraced, in a process of its
own).

The points: trio's I/O wait (an instrument's ``before_io_wait`` and
``after_io_wait``) or an idle wait in its place (``rdmashim.verbs.idle``: its call
and return; on the native engine the read is in the same call, so its phases
"trio resumes the reader" and "readv" are empty and the wait holds the read),
``os.readv`` and ``os.write``/``os.writev`` (the engine's socket calls), the
engine's ``received``, the RDS session's completion handler (``Session._on_cq``; with
RDS's C path on the native engine, the CQ's native handler takes a plain message inside
the read, and the session's note of what it took, ``Session._taken_in_c``, takes the
handler's place: what C took is folded into the session later, at most once a backstop),
the socket handing a message to its reader (``RdsSocket._take``),
``RdsSocket.sendto`` and the QP's ``post_send`` or ``post_send_batch`` (or, for a plain
message sent in C, ``run_native_handler``; for one sent through RDS's gate, the one call
into C that numbers, posts and writes it: the write phase holds it all). Each
hook costs about 0.3 us; a phase is counted only in cycles whose points came in
the usual order (a timer's wake-up or an acknowledgement in the middle leaves
the cycle out: the counts say how many were kept). Each end's CPU time per message
(``os.times`` over the traced samples, hooks included) is printed too: unlike the
wall-clock phases it does not count the time other processes on the machine take.

Usage::

    python benchmarks/rds_breakdown.py [--repeat N] [--duration S] [-q BYTES] [-a BYTES]
                                       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import trio
from rds_stress import CLIENT_IP, SERVER_IP, Case, _cpu, _free_port, ours, raw, raw_passive

from rdmashim.providers.softiwarp import driver, engines
from rdmashim.providers.softiwarp.cq import CQ
from rdmashim.providers.softiwarp.engine import Engine
from rdmashim.providers.softiwarp.native_cq import NativeCQ
from rdmashim.providers.softiwarp.native_link import NativeEngine, NativeLink
from rdmashim.providers.softiwarp.native_provider import NativeQP
from rdmashim.providers.softiwarp.qp import QP
from rdmashim.rdstools.common import open_node
from rdmashim.rdstools.defaults import STRESS_PORT
from rdmashim.rdstools.stress import PassiveResult, stress_passive
from rdmashim.ulps.rds.node import RdsSocket
from rdmashim.ulps.rds.plain import PlainReceiver
from rdmashim.ulps.rds.rdma_session import Session
from rdmashim.ulps.rds.settings import RdsSettings
from rdmashim.verbs.lending import WaitPoint

from report import cpu_line, engine_line, rds_path_line, run_meta
from streams import stop_process

CYCLE = (
    "wake", "read", "read_end", "engine_end", "handler", "handler_end", "take", "sendto",
    "post", "write", "write_end", "post_end", "sleep", "wake",
)  # fmt: skip
"""The points of one end's turn, in order: from waking up to waking up again."""

PHASES = (
    "trio resumes the reader",
    "readv",
    "engine: bytes to a completion",
    "completion handler dispatch",
    "RDS receive (completion handler)",
    "message to the reader",
    "the app (rds stress)",
    "RDS send",
    "engine: framing the Send",
    "write syscall",
    "engine: after the write",
    "back to waiting (trio)",
    "asleep: the peer's turn",
)
"""What happens between consecutive points of :data:`CYCLE`."""

HANDLER = PHASES.index("RDS receive (completion handler)")
SEND = PHASES.index("RDS send")
ENGINE_INSIDE = "  of which the engine's calls"

BUSY = len(PHASES) - 1
"""The phases before this one are the end's own work (awake)."""

RESULT_LINE = "-" * 72
BLOCKING = RdsSettings(busy_poll=0.0)
"""The nodes' settings: waits that block at once (see the module docstring)."""
GOAL = 0.7
"""The ratio issue 13 asks of rds stress (ours/raw TCP, tx/s)."""


class Tracer(trio.abc.Instrument):
    """Timestamps at the points of :data:`CYCLE`, in this process, while installed."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []
        self._undo: list[Callable[[], None]] = []
        self.inside: dict[int, int] = {}
        """For each completion handler run (the time of its ``handler_end`` point in
        :attr:`log`): ns of the engine's calls it made (:data:`ENGINE_CALLS`)."""
        self._engine_ns = 0

    def before_io_wait(self, timeout: float) -> None:
        """trio is about to wait for I/O (``timeout`` 0: a look, tasks are ready)."""
        self.log.append(("sleep" if timeout > 0 else "look", time.perf_counter_ns()))

    def after_io_wait(self, timeout: float) -> None:
        """trio's wait for I/O ended."""
        self.log.append(("wake" if timeout > 0 else "looked", time.perf_counter_ns()))

    def _hook(
        self, owner: Any, name: str, before: str, after: str | tuple[str, ...] | None
    ) -> None:
        """Log ``before`` when ``owner.name`` is called and ``after`` (each of them, at
        one time) when it returns."""
        original = getattr(owner, name)
        log, now = self.log, time.perf_counter_ns
        afters = (after,) if isinstance(after, str) else after
        if afters is None:  # (an async function: the call makes the coroutine it runs)

            def hooked(*args: Any, **kwargs: Any) -> Any:
                log.append((before, now()))
                return original(*args, **kwargs)
        else:

            def hooked(*args: Any, **kwargs: Any) -> Any:
                log.append((before, now()))
                try:
                    return original(*args, **kwargs)
                finally:
                    t = now()
                    log.extend((point, t) for point in afters)

        setattr(owner, name, hooked)
        self._undo.append(partial(setattr, owner, name, original))

    def _hook_idle_wait(self, owner: Any, name: str, after: tuple[str, ...]) -> None:
        """An idle wait (``rdmashim.verbs.idle``: the reader waits in a poll of its own in
        place of trio's wait): ``sleep`` at its call and ``after`` at its return, when it
        waited (it returns false, or ``driver.BUSY``, when it did not)."""
        original = getattr(owner, name)
        log, now = self.log, time.perf_counter_ns

        def hooked(*args: Any, **kwargs: Any) -> Any:
            t = now()
            got = original(*args, **kwargs)
            if got is not False and got is not driver.BUSY:
                done = now()
                log.append(("sleep", t))
                log.extend((point, done) for point in after)
            return got

        setattr(owner, name, hooked)
        self._undo.append(partial(setattr, owner, name, original))

    def _hook_native_reads(self) -> None:
        """The native engine's reads: C reads and processes in one call, and what came is
        handed on (to the driving reader's completion handler, in one hop) in
        ``NativeLink._took``, which the read's call makes before it returns. So the
        read's end is logged when ``_took`` is called: ``read_end`` and ``engine_end``,
        after an idle wait also ``wake`` and ``read`` (the wait and the read are one
        call into C); the idle wait's ``sleep`` at its call, logged once it is known
        to have waited (the log is put in time order before it is summed up)."""
        log, now = self.log, time.perf_counter_ns
        idle = [False]
        read, read_idle, took = NativeLink._read, NativeLink._read_idle, NativeLink._took

        def hooked_read(link: NativeLink) -> Any:
            log.append(("read", now()))
            return read(link)

        def hooked_read_idle(link: NativeLink) -> Any:
            t = now()
            idle[0] = True
            try:
                got = read_idle(link)
            finally:
                idle[0] = False
            if got is not driver.BUSY:
                log.append(("sleep", t))
            return got

        def hooked_took(link: NativeLink, n: int) -> Any:
            t = now()
            points = ("wake", "read", "read_end", "engine_end") if idle[0] else CYCLE[2:4]
            log.extend((point, t) for point in points)
            idle[0] = False
            return took(link, n)

        for name, hooked in (
            ("_read", hooked_read), ("_read_idle", hooked_read_idle), ("_took", hooked_took),
        ):  # fmt: skip
            original = getattr(NativeLink, name)
            setattr(NativeLink, name, hooked)
            self._undo.append(partial(setattr, NativeLink, name, original))

    def _hook_direct_sends(self) -> None:
        """A plain message sent through the gate of RDS's ``sendto`` in C (``rp_sendto``)
        is numbered, staged, posted and written in one call into C: that call is logged as
        the post and as the write (the framing and "after the write" phases are empty, the
        write phase holds them). Its wrapper is put on each session's receiver when the
        session sets how it posts (``PlainReceiver.posting``)."""
        log, now = self.log, time.perf_counter_ns
        posting = PlainReceiver.posting

        def hooked_posting(receiver: PlainReceiver, *args: Any) -> None:
            posting(receiver, *args)
            sendto = receiver.sendto

            def timed(*call: Any) -> Any:
                t = now()
                log.extend((("post", t), ("write", t)))
                try:
                    return sendto(*call)
                finally:
                    t = now()
                    log.extend((("write_end", t), ("post_end", t)))

            receiver.sendto = timed  # type: ignore[assignment]

        PlainReceiver.posting = hooked_posting  # type: ignore[method-assign]
        self._undo.append(partial(setattr, PlainReceiver, "posting", posting))

    def _hook_handler(self, name: str) -> None:
        """Log ``handler`` and ``handler_end`` around the session's completion handler
        (``_on_cq``), or its note of what the CQ's native handler took (``_taken_in_c``), and
        how long the engine's calls inside it took (:attr:`inside`)."""
        original = getattr(Session, name)
        log, now, inside = self.log, time.perf_counter_ns, self.inside

        def hooked(session: Session, *args: Any) -> None:
            self._engine_ns = 0
            log.append(("handler", now()))
            try:
                original(session, *args)
            finally:
                t = now()
                inside[t] = self._engine_ns
                log.append(("handler_end", t))

        setattr(Session, name, hooked)
        self._undo.append(partial(setattr, Session, name, original))

    def _hook_engine(self, owner: Any, name: str) -> None:
        """Add the time of each call of ``owner.name`` to the handler run under way."""
        original = getattr(owner, name)
        now = time.perf_counter_ns

        def hooked(*args: Any, **kwargs: Any) -> Any:
            t = now()
            try:
                return original(*args, **kwargs)
            finally:
                self._engine_ns += now() - t

        setattr(owner, name, hooked)
        self._undo.append(partial(setattr, owner, name, original))

    def install(self) -> None:
        """Hook the points (in a trio run: the instrument is the run's). On the native
        engine one C call reads the socket and processes what came (``NativeLink._read``:
        the readv phase holds both, the engine's is empty), and one frames a post's
        Sends and writes them (``NativeEngine.submit_send``, or ``run_hook`` for what RDS's
        C staged: the write phase holds both; framing is the Python around it), and one
        sends a plain message through RDS's gate (:meth:`_hook_direct_sends`)."""
        native_engine = engines.chosen()[0] == "native"
        cq_class, qp_class = (NativeCQ, NativeQP) if native_engine else (CQ, QP)
        for owner, name in (
            (cq_class, "poll_into"), (CQ, "req_notify"), (CQ, "__len__"),
            (qp_class, "post_recv_batch"), (qp_class, "post_send_batch"), (qp_class, "post_send"),
            (qp_class, "run_native_handler"),
        ):  # fmt: skip
            self._hook_engine(owner, name)  # (before the post's points: those go outside)
        if native_engine:
            self._hook_native_reads()
            self._hook(NativeEngine, "submit_send", "write", "write_end")
            self._hook(NativeEngine, "run_hook", "write", "write_end")
            self._hook(NativeQP, "post_send", "post", "post_end")
            self._hook(NativeQP, "post_send_batch", "post", "post_end")
            self._hook(NativeQP, "run_native_handler", "post", "post_end")
            self._hook_direct_sends()
        else:
            self._hook_idle_wait(WaitPoint, "block", ("wake",))
            self._hook(os, "readv", "read", "read_end")
            self._hook(os, "write", "write", "write_end")
            self._hook(os, "writev", "write", "write_end")
            self._hook(Engine, "received", "engine", "engine_end")
            self._hook(QP, "post_send", "post", "post_end")
            self._hook(QP, "post_send_batch", "post", "post_end")
        self._hook_handler("_on_cq")
        self._hook_handler("_taken_in_c")
        self._hook(RdsSocket, "_take", "take", None)
        self._hook(RdsSocket, "sendto", "sendto", None)
        trio.lowlevel.add_instrument(self)
        self._undo.append(partial(trio.lowlevel.remove_instrument, self))

    def uninstall(self) -> None:
        """Put everything back."""
        while self._undo:
            self._undo.pop()()

    def summary(self) -> dict[str, Any]:
        """Each phase's median (us) over the cycles whose points came in order, how many
        did, and how often each point came."""
        self.log.sort(key=lambda point: point[1])  # (stable: a time's points keep their order)
        log = [point for point in self.log if point[0] != "engine"]  # (after readv)
        names = [name for name, _ in log]
        phases: list[list[int]] = [[] for _ in PHASES]
        engine_inside: list[int] = []
        span = len(CYCLE)
        end = CYCLE.index("handler_end")
        i = 0
        while i + span <= len(log):
            if names[i] == "wake" and names[i : i + span] == list(CYCLE):
                for k in range(len(PHASES)):
                    phases[k].append(log[i + k + 1][1] - log[i + k][1])
                engine_inside.append(self.inside.get(log[i + end][1], 0))
                i += span - 1  # its last wake starts the next cycle
            else:
                i += 1
        return {
            "cycles": len(phases[0]),
            "counts": {name: names.count(name) for name in sorted(set(CYCLE))},
            "median_us": [statistics.median(p) / 1000 if p else math.nan for p in phases],
            "handler_engine_us": (
                statistics.median(engine_inside) / 1000 if engine_inside else math.nan
            ),
            "handler_own_us": (
                statistics.median(
                    [h - e for h, e in zip(phases[HANDLER], engine_inside, strict=True)]
                )
                / 1000
                if engine_inside
                else math.nan
            ),
        }


# =============================================================================================
# the passive processes
# =============================================================================================


async def serve_rds(cm_port: int) -> dict[str, Any]:
    """The traced passive end, until stdin closes; its summary."""
    tracer = Tracer()
    async with (
        trio.open_nursery() as nursery,
        open_node(SERVER_IP, cm_port, settings=BLOCKING) as node,
    ):
        result = PassiveResult()
        await nursery.start(lambda task_status: stress_passive(
            node, STRESS_PORT, once=False, result=result, task_status=task_status
        ))  # fmt: skip
        tracer.install()
        print("READY", flush=True)
        cpu, requests = _cpu(), result.requests
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        cpu, requests = _cpu() - cpu, result.requests - requests
        tracer.uninstall()
        nursery.cancel_scope.cancel()
    return {**tracer.summary(), "cpu_us_per_message": cpu * 1e6 / max(1, requests)}


async def serve_raw() -> None:
    """The raw TCP passive end (untraced), until stdin closes."""
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host=SERVER_IP)
        port = listeners[0].socket.getsockname()[1]
        nursery.start_soon(trio.serve_listeners, partial(raw_passive, 0.0), listeners)
        print(f"READY {port}", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()


# =============================================================================================
# the active process
# =============================================================================================


async def client_main(cm_port: int, raw_port: int, args: argparse.Namespace) -> dict[str, Any]:
    case = Case(args.q, args.a, 1, 1)
    tracer = Tracer()
    samples: dict[str, list[Any]] = {"ours": [], "raw": []}
    cpu = 0.0
    async with open_node(CLIENT_IP, cm_port, settings=BLOCKING) as node:
        for i in range(args.repeat):
            if sys.stderr.isatty():
                sys.stderr.write(f"\r{case.label}: sample {i + 1}/{args.repeat}".ljust(60))
            tracer.install()
            start = _cpu()
            try:
                with trio.fail_after(10 * args.duration + 60):
                    samples["ours"].append(await ours(node, case, args.duration))
            finally:
                cpu += _cpu() - start
                tracer.uninstall()
            with trio.fail_after(10 * args.duration + 60):
                samples["raw"].append(await raw(raw_port, case, args.duration, 0.0))
    if sys.stderr.isatty():
        sys.stderr.write("\r" + " " * 60 + "\r")
    requests = max(1, sum(s.requests for s in samples["ours"]))
    active = {**tracer.summary(), "cpu_us_per_message": cpu * 1e6 / requests}
    return {"case": case, "samples": samples, "active": active}


def _start(cmd: list[str]) -> tuple[subprocess.Popen[bytes], list[str]]:
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().split()
    if not line or line[0] != "READY":
        stop_process(proc)
        raise RuntimeError(f"{cmd[2:]}: passive side did not start (said {line!r})")
    return proc, line


def print_table(doc: dict[str, Any]) -> None:
    act, pas = doc["active"], doc["passive"]
    print(RESULT_LINE)
    print(f" rds stress {doc['case']}: one round trip, phase by phase (medians, us)")
    print(engine_line(width=0))
    print(rds_path_line(width=0))
    print(cpu_line(width=0))
    print(RESULT_LINE)
    print(f" {'phase':<40}{'active':>10}{'passive':>10}")
    busy = [sum(side["median_us"][:BUSY]) for side in (act, pas)]
    for k, name in enumerate(PHASES):
        if k == BUSY:
            print(f" {'awake (the sum above)':<40}{busy[0]:>10.1f}{busy[1]:>10.1f}")
        print(f" {name:<40}{act['median_us'][k]:>10.1f}{pas['median_us'][k]:>10.1f}")
        if k == HANDLER:
            print(f" {ENGINE_INSIDE:<40}{act['handler_engine_us']:>10.1f}"
                  f"{pas['handler_engine_us']:>10.1f}")  # fmt: skip
    print(RESULT_LINE)
    own = [side["handler_own_us"] + side["median_us"][SEND] for side in (act, pas)]
    print(
        f" RDS's own per message (handler less the engine's calls, and send): "
        f"{own[0]:.1f} and {own[1]:.1f} us"
    )
    print(
        f" CPU per message (os.times, traced; the wall figures above depend on what else "
        f"runs): {act['cpu_us_per_message']:.1f} and {pas['cpu_us_per_message']:.1f} us"
    )
    o, r = doc["median"]["ours"], doc["median"]["raw"]
    print(
        f" round trip: ours {o['rtt_us']:.0f} us ({o['tx_per_s']:.0f} tx/s), raw TCP "
        f"{r['rtt_us']:.0f} us ({r['tx_per_s']:.0f} tx/s); ratio (tx/s) {doc['ratio']:.3f}"
    )
    syscalls = [side["median_us"][1] + side["median_us"][9] for side in (act, pas)]
    print(
        f" awake: readv and write {syscalls[0]:.1f} and {syscalls[1]:.1f} us, the rest "
        f"(Python) {busy[0] - syscalls[0]:.1f} and {busy[1] - syscalls[1]:.1f} us"
    )
    goal = r["rtt_us"] / GOAL
    print(
        f" a ratio of {GOAL} needs a round trip of {goal:.0f} us: "
        f"{max(0.0, (o['rtt_us'] - goal) / 2):.0f} us less at each end"
    )
    for side, s in (("active", act), ("passive", pas)):
        turns = max(1, s["counts"]["take"])
        print(
            f" {side}: {s['cycles']} of {turns} turns in order; per turn: "
            f"{s['counts']['wake'] / turns:.2f} wake-ups, "
            f"{s['counts']['handler'] / turns:.2f} handler runs, "
            f"{s['counts']['write'] / turns:.2f} writes"
        )
    print(RESULT_LINE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="samples per side (default 3)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds a sample (default 2)")
    p.add_argument("-q", type=int, default=1024, help="request bytes (default 1024)")
    p.add_argument("-a", type=int, default=256, help="ack bytes (default 256)")
    p.add_argument("--json", metavar="FILE", help="write the phases' medians and samples")
    p.add_argument("--serve-rds", type=int, metavar="CM_PORT", help=argparse.SUPPRESS)
    p.add_argument("--serve-raw", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_rds is not None:
        print(json.dumps(trio.run(serve_rds, args.serve_rds)), flush=True)
        return 0
    if args.serve_raw:
        trio.run(serve_raw)
        return 0
    if args.repeat < 1 or not 0 < args.duration <= 600:
        p.error("--repeat must be at least 1 and --duration in (0, 600]")
    if not 16 <= args.q <= 65536 or not 16 <= args.a <= 65536:
        p.error("-q and -a must be 16 .. 65536 bytes (the stress header is 16)")
    me = [sys.executable, str(Path(__file__).resolve())]
    cm_port = _free_port()
    rds_side, _ = _start([*me, "--serve-rds", str(cm_port)])
    try:
        raw_side, line = _start([*me, "--serve-raw"])
        try:
            run = trio.run(client_main, cm_port, int(line[1]), args)
        finally:
            stop_process(raw_side)
    finally:
        assert rds_side.stdout is not None
        stop_process(rds_side)
        passive = json.loads(rds_side.stdout.read().decode().strip().splitlines()[-1])
    med = {
        side: {
            key: statistics.median(getattr(s, key) for s in run["samples"][side])
            for key in ("tx_per_s", "rtt_us")
        }
        for side in ("ours", "raw")
    }
    doc: dict[str, Any] = {
        "meta": {
            **run_meta(),
            "repeat": args.repeat,
            "duration_s": args.duration,
        },
        "case": run["case"].label,
        "median": med,
        "ratio": med["ours"]["tx_per_s"] / med["raw"]["tx_per_s"],
        "phases": list(PHASES),
    }
    doc["active"], doc["passive"] = run["active"], passive
    print_table(doc)
    if args.json:
        doc["samples"] = {side: [vars(s) for s in run["samples"][side]] for side in ("ours", "raw")}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
