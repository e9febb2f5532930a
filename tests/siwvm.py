"""The Linux kernel's siw in a QEMU guest as a test peer (the test bed in ``tools/guest``).

Helpers for ``tests/test_siw_interop.py``:

* :func:`missing_requirements`: why a guest cannot be booted here (root, QEMU,
  ``ip``, the image that ``tools/guest/build.py`` makes).
* :func:`netns_up`: the host network namespace :data:`NETNS` (bridge :data:`BRIDGE`
  = :data:`HOST_IP`, taps for the guests), made by ``tools/guest/bridge.py``.
* :class:`Guest`: boots one guest in that namespace with an *agent* as its
  script. The agent loads siw, adds ``siw0`` on ``eth0``, touches a readiness
  file in the share, then runs the shell *jobs* the host drops into the share
  one after another (``$JOB.sh`` -> ``$JOB.out`` and ``$JOB.rc``) until told to
  stop, so one boot (about 12 s under TCG) serves many tests. A job may touch
  ``$JOB.<name>`` files to signal the host (:meth:`Job.wait_file`) and look for
  files the host touches (:meth:`Job.touch`).
* :func:`guest_python_deps` / :func:`stage_tree`: trio, pytest, crc32c, ... for the
  guest's python3 (``pip install --target``, cached), and a copy of this tree in the
  installed layout; pass them as ``Guest(puts=[tree], sync=deps)`` and run Python
  with ``PYTHONPATH=/host/src:/sync``.
* :func:`capture` / :func:`judge`: tcpdump on the bridge and the wire judge's verdict
  (``tools/wirejudge.py``), less what the kernel's siw sends that is not ours to fix.
* :func:`netns_cmd` / :func:`run_in_netns`: a host command inside the namespace;
  :func:`in_netns`: a host coroutine inside it (its own trio loop in a thread
  that entered the namespace). ``wirecap.tcpdump(..., interface=BRIDGE,
  netns=NETNS)`` records the guest's traffic.

Host and guest share files through 9p (``run/NAME/share`` of the test bed's
cache = ``/host``; see ``tools/guest/guestbed.py``).
Everything here is synchronous or plain polling, so the guest can live in a
module-scoped fixture while the tests run in their own trio loops.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

import wirecap

REPO = Path(__file__).resolve().parent.parent
GUEST_TOOLS = REPO / "tools" / "guest"
sys.path.append(str(GUEST_TOOLS))
import guestbed  # noqa: E402  (tools/guest/guestbed.py: the test bed's cache and network plan)

NETNS = guestbed.NETNS
BRIDGE = guestbed.BRIDGE
HOST_IP = guestbed.BRIDGE_IP
"""The host's address on the namespace's bridge."""
GUEST_IP = "10.77.0.10"
SIW_KO_ENV = "RDMASHIM_SIW_KO"
"""A ``siw.ko`` (built for the guest's kernel) to load instead of the image's own."""
BOOT_TIMEOUT = 90.0
"""Seconds from starting QEMU until the agent is ready (TCG: about 12)."""
STOP_TIMEOUT = 30.0
TAP_WAIT = 1200.0
"""Seconds a guest waits for its tap while another test run on this machine (a second
clone, CI beside a developer) has a guest on it: QEMU cannot share a tap."""
POLL = 0.05

T = TypeVar("T")

_AGENT = r"""#!/bin/bash
# rdmashim test agent (tests/siwvm.py): set up siw, then run the host's jobs in order.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if [ -f /host/siw.ko ]; then
    SIW="modprobe ib_core && modprobe libcrc32c && insmod /host/siw.ko"  # a siw.ko under test
else
    SIW="modprobe siw"
fi
if ! { eval "$SIW" && modprobe rdma_ucm && rdma link add siw0 type siw netdev eth0; }; then
    echo "agent: siw setup failed"; dmesg | tail -20; exit 90
fi
echo "agent: $(uname -r), siw: $SIW"
touch /host/ready.__TOKEN__
n=1
while :; do
    j=/host/job.$n
    while [ ! -f "$j.sh" ]; do sleep 0.05; done
    [ -f "$j.last" ] && break
    JOB=$j bash "$j.sh" > "$j.out" 2>&1
    echo $? > "$j.rc.tmp"; mv "$j.rc.tmp" "$j.rc"
    n=$((n + 1))
done
dmesg > /host/dmesg.txt
echo "agent: $((n - 1)) jobs"
"""


def tap(index: int) -> str:
    """The name of the namespace's tap number ``index``."""
    return guestbed.TAP.format(index)


def cache_dir() -> Path:
    """The test bed's cache (``$RDMASHIM_GUEST_CACHE``, default ``/var/tmp/rdmashim-guest``)."""
    return guestbed.cache_dir()


def guest_tool(name: str) -> list[str]:
    """The command that runs ``tools/guest/NAME.py``."""
    return [sys.executable, str(GUEST_TOOLS / f"{name}.py")]


def missing_requirements() -> str | None:
    """Why a guest cannot be booted here, or None when it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the siw guest needs root (network namespace, tap devices)"
    for tool, package in (("qemu-system-x86_64", "qemu-system-x86"), ("ip", "iproute2")):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install {package}; see the README's test levels)"
    return guestbed.missing_image()


# ---------------------------------------------------------------- Python in the guest
GUEST_DEPS = ["pytest", "pytest-trio", "trio", "crc32c", "psutil", "hypothesis"]
"""What rdmashim and its tests need beyond the guest's python3 and python3-cffi."""


def pinned_deps() -> list[str]:
    """GUEST_DEPS at the versions installed here (unpinned where not installed)."""
    pins = []
    for name in GUEST_DEPS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pins.append(name)
    return pins


def guest_python_deps(log: Callable[[str], Any] = print) -> Path:
    """The guest's dependency directory, made with ``pip install --target`` if needed."""
    pins = pinned_deps()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    key = hashlib.sha256("\n".join([tag, *pins]).encode()).hexdigest()[:12]
    target = cache_dir() / "pydeps" / f"{tag}-{key}"
    if (target / ".complete").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One maker at a time: CI's background guest suite and an interop test may both
    # come here first; the second waits, then finds the directory complete.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / ".complete").is_file():
            return target
        return _install_deps(target, pins, log)


def _install_deps(target: Path, pins: list[str], log: Callable[[str], Any]) -> Path:
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"siwvm: pip install --target {target} {' '.join(pins)}")
    start = time.monotonic()
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
            "--no-compile", "--only-binary=:all:", "--target", str(tmp), *pins,
        ],
        check=True,
    )  # fmt: skip
    shutil.rmtree(tmp / "bin", ignore_errors=True)
    for leftover in tmp.glob("cffi*"):  # the guest's python3-cffi serves
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    (tmp / ".complete").write_text("\n".join(pins) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log(f"siwvm: guest dependencies ready in {time.monotonic() - start:.1f} s")
    return target


def stage_tree(dest: Path) -> Path:
    """Copy the working tree to ``dest`` in the installed package layout (with ``tests``
    and ``tools``)."""
    shutil.rmtree(dest, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis", ".pytest_cache")
    dest.mkdir(parents=True)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(REPO / "tests", dest / "tests", ignore=ignore)
    shutil.copytree(REPO / "tools", dest / "tools", ignore=ignore)  # siwvm imports tools/guest
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dirs = config["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dirs.items()):  # parents before children
        target = dest.joinpath(*package.split("."))
        shutil.copytree(REPO / folder, target, ignore=ignore, dirs_exist_ok=True)
    return dest


RPING_EXIT_RACE = "rdma_get_cm_event: Bad file descriptor"
"""What the guest's rping (rdma-core 44, Debian 12) prints when its CM thread reads the event
channel its main thread has just destroyed after a successful run; it then exits 255.
rdma-core fixed it in 2025 ("rping: Fix spurious failure return codes", PR 1622). The
tests count that exit as success and check every ping's data besides."""
REQUIRE_ENV = "RDMASHIM_REQUIRE_INTEROP"
"""Set to 1 (CI does once the image is built) to fail, not skip, where no guest can boot."""


def require_guest() -> None:
    """Skip the test (fail it under ``RDMASHIM_REQUIRE_INTEROP=1``) where no guest can boot."""
    why = missing_requirements()
    if why and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but the siw guest cannot boot here: {why}")
    if why:
        pytest.skip(why)


def netns_up(taps: int = 2) -> bool:
    """Create the namespace (idempotent); True when this call created it."""
    existed = (
        NETNS
        in subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    subprocess.run(
        [*guest_tool("bridge"), "up", str(taps)], capture_output=True, text=True, check=True
    )
    return not existed


def netns_down() -> None:
    subprocess.run([*guest_tool("bridge"), "down"], capture_output=True, check=False)


@contextlib.contextmanager
def booted(name: str, ip: str, tap_index: int, dmesg_keys: Sequence[str] = ()) -> Iterator[Guest]:
    """A guest booted on tap ``tap_index`` of the namespace for the block (a module fixture).

    Skips where no guest can boot. At the end it stops the guest, prints the
    last dmesg lines holding any of ``dmesg_keys``, and takes the namespace
    down only if this call made it.
    """
    require_guest()
    created = netns_up(taps=tap_index + 1)
    vm = Guest(name, ip=ip, tap=tap(tap_index))
    try:
        vm.start()
        print(f"\nguest {vm.name} ready after {vm.boot_seconds:.1f} s")
        yield vm
    finally:
        dmesg = vm.stop()
        if dmesg_keys:
            lines = [ln for ln in dmesg.splitlines() if any(k in ln.lower() for k in dmesg_keys)]
            print(f"\nguest dmesg ({', '.join(dmesg_keys)}): {len(lines)} lines", *lines[-15:],
                  sep="\n")  # fmt: skip
        if created:
            netns_down()


def netns_cmd(*argv: str) -> list[str]:
    """``argv`` run inside the namespace."""
    return ["ip", "netns", "exec", NETNS, *argv]


@dataclass
class Done:
    """A finished host command."""

    returncode: int | None
    """None when it was killed at its time limit."""
    stdout: str
    stderr: str
    seconds: float


async def run_in_netns(argv: list[str], limit: float) -> Done:
    """Run ``argv`` inside the namespace; kill it after ``limit`` seconds."""
    start = time.monotonic()
    result: Any = None
    with trio.move_on_after(limit):
        result = await trio.run_process(
            netns_cmd(*argv), capture_stdout=True, capture_stderr=True, check=False
        )
    took = time.monotonic() - start
    if result is None:
        return Done(None, "", f"killed after {limit} s", took)
    return Done(result.returncode, result.stdout.decode(), result.stderr.decode(), took)


async def in_netns(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``fn(*args)`` in a new trio loop in a thread that entered the namespace.

    ``setns`` moves only the calling thread, so the sockets the coroutine
    creates live in the namespace while the rest of the process stays outside.
    Use numeric addresses (name resolution runs in trio's worker threads).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{NETNS}", os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), f"setns({NETNS})")
            finally:
                os.close(fd)
            box["value"] = trio.run(fn, *args)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{NETNS}", daemon=True)
    thread.start()
    await trio.to_thread.run_sync(thread.join, abandon_on_cancel=True)
    if "error" in box:
        raise box["error"]
    return box["value"]


async def wait_listening(port: int, limit: float = 10.0) -> None:
    """Wait until something in the namespace listens on TCP ``port`` (without connecting)."""
    with trio.fail_after(limit):
        while True:
            out = await trio.run_process(
                netns_cmd("ss", "-Hltn", f"sport = :{port}"), capture_stdout=True, check=False
            )
            if out.stdout.strip():
                return
            await trio.sleep(POLL)


# ---------------------------------------------------------------- the guest


NO_CAPTURE_ENV = "RDMASHIM_SIW_NO_CAPTURE"
"""Set to 1 to run without tcpdump (the capture changes the timing the siw race depends on)."""


def can_capture() -> bool:
    """Whether captures can be taken (root, tcpdump, tshark; not switched off)."""
    return not wirecap.missing_requirements() and os.environ.get(NO_CAPTURE_ENV) != "1"


@asynccontextmanager
async def capture(enabled: bool, pcap: Path, port: int) -> AsyncIterator[Any]:
    """Capture ``port`` on the namespace's bridge into ``pcap`` while the block runs, if
    ``enabled`` (yields tcpdump's :class:`wirecap.Capture`, or None)."""
    if not enabled:
        yield None
        return
    async with wirecap.tcpdump(pcap, port, interface=BRIDGE, netns=NETNS) as cap:
        yield cap


CRC_PROBLEM = "FPDU(s) with a bad CRC32c"
"""The wire judge's problem line for FPDUs whose CRC32c is wrong (after their count)."""


def set_aside_guest(result: dict[str, Any], guest_ip: str) -> dict[str, Any]:
    """Split a wire judge verdict into the guest's findings and ours.

    The kernel's siw sends PAD bytes that are not zero (a receiver ignores them;
    the judge sets them aside itself with ``--pad-from``), and has been seen once
    to send an FPDU whose CRC32c is wrong (CI, a 65535-byte rping: see
    docs/interop.md). A bad CRC from the guest is its fault, and our side must
    answer it with a Terminate; whether that happened is the test's to check. TCP
    retransmissions (a slow TCG guest's delayed ACKs provoke tail-loss probes) are
    not framed by tshark; the judge lists them apart. Adds ``our_problems`` (must
    be empty), ``guest_pad``, ``guest_crc`` (the guest's bad FPDUs) and
    ``retransmissions`` (their frame numbers).
    """
    errors = result.get("crc_errors", [])
    theirs = [e for e in errors if e["src"].rsplit(":", 1)[0] == guest_ip]
    ours = len(errors) - len(theirs)
    problems = [p for p in result.get("problems", []) if not p.endswith(CRC_PROBLEM)]
    if ours:
        problems.insert(0, f"{ours} {CRC_PROBLEM}")
    result["our_problems"] = problems
    result["guest_crc"] = theirs
    result["guest_pad"] = result.get("pad_ignored", [])
    result["retransmissions"] = [r["frame"] for r in result.get("retransmitted_payload", [])]
    return result


async def judge(pcap: Path, port: int, guest_ip: str = GUEST_IP) -> dict[str, Any]:
    """The wire judge's verdict on a capture with the guest, split by
    :func:`set_aside_guest` (also adds ``judge_rc``)."""
    rc, result, _ = await wirecap.judge_capture(pcap, port, "--pad-from", guest_ip)
    result["judge_rc"] = rc
    return set_aside_guest(result, guest_ip)


@dataclass
class JobResult:
    returncode: int
    output: str


class Job:
    """One script the guest's agent runs; files ``job.N.*`` in the share."""

    def __init__(self, guest: Guest, n: int) -> None:
        self.guest = guest
        self.n = n
        self.prefix = guest.share / f"job.{n}"

    def path(self, suffix: str) -> Path:
        return Path(f"{self.prefix}.{suffix}")

    def touch(self, name: str) -> None:
        """Create ``$JOB.<name>`` for the guest to see."""
        self.path(name).touch()

    async def wait_file(self, name: str, limit: float) -> None:
        """Wait for the guest to create ``$JOB.<name>`` (fails early if the job ends)."""
        with trio.fail_after(limit):
            while not self.path(name).exists():
                if self.path("rc").exists():
                    raise RuntimeError(f"guest job {self.n} ended before {name}:\n{self.output()}")
                self.guest.check_alive()
                await trio.sleep(POLL)

    def output(self) -> str:
        try:
            return self.path("out").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def wait(self, limit: float) -> JobResult:
        """Wait until the job's script has exited (at most ``limit`` seconds)."""
        with trio.fail_after(limit):
            while not self.path("rc").exists():
                self.guest.check_alive()
                await trio.sleep(POLL)
        return JobResult(int(self.path("rc").read_text().strip()), self.output())


class Guest:
    """A booted siwvm guest running the job agent (see the module docstring)."""

    def __init__(
        self,
        name: str = "rdmashim-interop",
        *,
        ip: str = GUEST_IP,
        tap: str = guestbed.TAP.format(0),
        smp: int = 2,
        mem: int = 1024,
        lifetime: float = 1800.0,
        siw_ko: Path | None = None,
        puts: Sequence[Path] = (),
        sync: Path | None = None,
    ) -> None:
        self.name = name
        self.siw_ko = siw_ko
        self.puts = list(puts)
        """Files or directories copied into the share (``/host/NAME`` in the guest)."""
        self.sync = sync
        """A host directory the guest mounts at ``/sync``."""
        self.ip = ip
        self.tap = tap
        self.smp = smp
        self.mem = mem
        self.lifetime = lifetime
        self.run_dir = guestbed.run_dir(name)
        self.share = self.run_dir / "share"
        self.log_path = cache_dir() / "run" / f"{name}.boot.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.boot_seconds = 0.0
        self.boots = 0
        self.dmesg = ""
        self.crashes: list[Path] = []
        """Console logs of earlier boots that died (kept as ``NAME.crash-N.log``)."""
        self._jobs = 0
        self._token = uuid.uuid4().hex
        self._tap_lock: int | None = None
        """A descriptor holding the lock on :attr:`tap` while this guest boots or runs."""

    # -- lifetime (synchronous: usable from module-scoped fixtures)
    def _lock_tap(self) -> None:
        """Wait (at most :data:`TAP_WAIT`) until no other guest on this machine holds the
        tap, then hold it until the guest is stopped or killed."""
        if self._tap_lock is not None:
            return
        path = cache_dir() / "run" / f"{self.tap}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + TAP_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RuntimeError(
                        f"guest {self.name}: {self.tap} stayed in use by another test run "
                        f"on this machine for {TAP_WAIT:.0f} s ({path})"
                    ) from None
                time.sleep(1.0)
        self._tap_lock = fd

    def _unlock_tap(self) -> None:
        fd, self._tap_lock = self._tap_lock, None
        if fd is not None:
            os.close(fd)  # the lock goes with the descriptor

    def start(self) -> None:
        """Boot and wait until the agent is ready (siw0 up)."""
        self._lock_tap()
        self._jobs = 0
        self._token = uuid.uuid4().hex
        agent = cache_dir() / "run" / f"{self.name}.agent.sh"
        agent.parent.mkdir(parents=True, exist_ok=True)
        agent.write_text(_AGENT.replace("__TOKEN__", self._token))
        cmd = [
            *guest_tool("boot"), "--name", self.name, "--smp", str(self.smp),
            "--mem", str(self.mem), "--netns", NETNS, "--net", f"tap:{self.tap}",
            "--ip", f"{self.ip}/24", "--timeout", str(int(self.lifetime)),
        ]  # fmt: skip
        if self.siw_ko is not None:  # boot.py --put copies it into the share as /host/siw.ko
            staged = cache_dir() / "run" / f"{self.name}.module" / "siw.ko"
            staged.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.siw_ko, staged)
            cmd += ["--put", str(staged)]
        for path in self.puts:
            cmd += ["--put", str(path)]
        if self.sync is not None:
            cmd += ["--sync", str(self.sync)]
        cmd.append(str(agent))
        start = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # boot.py and QEMU: one process group
            )
        ready = self.share / f"ready.{self._token}"
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() - start > BOOT_TIMEOUT:
                self.kill()
                raise RuntimeError(f"guest {self.name} did not come up:\n{self.log_tail()}")
            time.sleep(POLL)
        self.boot_seconds = time.monotonic() - start
        self.boots += 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure(self) -> Path | None:
        """Reboot if the guest died; returns the dead boot's saved console log, if any."""
        if self.alive:
            return None
        saved = None
        console = self.run_dir / "console.log"
        if self.proc is not None and console.exists():
            saved = self.run_dir.parent / f"{self.name}.crash-{len(self.crashes) + 1}.log"
            shutil.copyfile(console, saved)
            self.crashes.append(saved)
        self.proc = None
        self.start()
        return saved

    def kill(self) -> None:
        """Power the guest off hard (a wedged kernel); :meth:`ensure` boots a new one."""
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # QEMU too, not only boot.py
            proc.wait()
        self._unlock_tap()

    async def ensure_async(self) -> Path | None:
        return await trio.to_thread.run_sync(self.ensure)

    def check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"guest {self.name} is not running:\n{self.log_tail()}")

    def stop(self) -> str:
        """Let the agent finish (or kill QEMU); return the guest's dmesg if it got one."""
        proc = self.proc
        if proc is None:
            self._unlock_tap()
            return self.dmesg
        if proc.poll() is None:
            self._jobs += 1
            last = self.share / f"job.{self._jobs}"
            Path(f"{last}.last").touch()
            _write_atomic(Path(f"{last}.sh"), "exit 0\n")
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.kill()
        dmesg = self.share / "dmesg.txt"
        self.dmesg = dmesg.read_text(errors="replace") if dmesg.exists() else ""
        self.proc = None
        self._unlock_tap()
        return self.dmesg

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for path in (self.log_path, self.run_dir / "console.log"):
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- jobs
    def start_job(self, script: str) -> Job:
        """Queue ``script`` (bash; ``$JOB`` is its file prefix in /host) for the agent."""
        self.check_alive()
        self._jobs += 1
        job = Job(self, self._jobs)
        _write_atomic(job.path("sh"), script)
        return job

    async def run(self, script: str, limit: float = 60.0) -> JobResult:
        """Run ``script`` in the guest and wait for it (at most ``limit`` seconds)."""
        return await self.start_job(script).wait(limit)


def oops(console_log: Path, lines: int = 12) -> str:
    """The first lines of a kernel oops or panic in a guest console log ("" if none)."""
    text = console_log.read_text(errors="replace").splitlines()
    for i, line in enumerate(text):
        if "BUG:" in line or "Oops" in line or "Kernel panic" in line:
            return "\n".join(text[i : i + lines])
    return ""


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)
