#!/usr/bin/env python3
"""Run the shared API suite (``tests/api``) inside the test bed's guest, once per backend.

::

    sudo /work/venv/bin/python tools/vm_api_suite.py                      # the default runs
    sudo /work/venv/bin/python tools/vm_api_suite.py --backend softiwarp  # one of them
    sudo /work/venv/bin/python tools/vm_api_suite.py --backend rdmacore -- -x -k cm

What it does:

1. Prepares the guest's Python test dependencies once, in
   ``$CACHE/pydeps/<key>`` (``pip install --target``; pytest, pytest-trio, trio,
   crc32c, hypothesis at the versions this Python has, so the guest runs what the
   host runs). The guest is Debian bookworm with python3.11, python3-cffi and
   rdma-core but no pip packages; the host's Python is 3.11 too, so the wheels
   fit. cffi is left to the guest's python3-cffi.
2. Stages a copy of the working tree as the installed package layout
   (``rdmashim/`` with ``verbs``, ``providers``, ``cm`` and ``ulps`` inside, per pyproject's
   ``package-dir``), plus ``tests/`` and ``pyproject.toml``.
3. Boots one guest (``tools/guest/boot.py --smp 1 --net user``; the
   dependencies are its ``/sync`` share, the staged tree is ``/host/src``), loads
   siw and adds ``siw_eth0`` on eth0 (the kernel's rdma_cm does not resolve
   127.0.0.1 to a siw device on ``lo``), and for each backend runs
   ``RDMASHIM_BACKEND=<name> RDMASHIM_API_HOST=<eth0's address> python3 -m
   pytest tests/api``; the connections take the kernel's loopback path. A backend whose module
   raises ``BackendUnavailable`` in the guest is reported as unavailable. When a
   backend's suite fails in three tests or fewer, they run once more, their DEBUG log captured
   (``rerun`` in the results: whether the failure repeats); the backend's status
   stays failed. A failed test shows the library's INFO log records in either run.
   The ``rxe:rdmacore`` run (:data:`RXE`) is rdmacore on Soft-RoCE: siw_eth0 makes way
   for ``rxe_eth0`` on the same eth0, so it runs last; the suite then meets InfiniBand
   semantics (the IB CM, RNR retry, NAKed Writes, immediate data) on the same guest.

The guest's output is printed as it comes. The exit status is 0 when every
backend that ran passed and at least one ran, 1 otherwise, 2 when the guest
could not run the suite, and 77 when this machine cannot boot the guest (the
reason is printed). ``--json PATH`` writes the per-backend results
(``tests/test_vm_api_suite.py`` reads them). Needs root, QEMU and the image
``tools/guest/build.py`` makes (see ``tests/siwvm.py``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import siwvm  # noqa: E402  (tests/siwvm.py: requirements, cache and harness paths)

DEFAULT_NAME = "api-suite"
GUEST_TIMEOUT = 60
"""``RDMASHIM_API_TIMEOUT`` in the guest: seconds any one wait may take under TCG."""
RUN_LIMIT = 1500
"""Seconds the whole guest may run (boot, setup, every backend's suite)."""
SUITE_LIMIT = 600
"""Seconds one backend's pytest may run in the guest before it is killed (a suite takes
about 100 s under TCG; a hung one would otherwise hold the guest until ``RUN_LIMIT``)."""
SKIP = 77

_GUEST_SCRIPT = r"""#!/bin/bash
# tools/vm_api_suite.py: the shared API suite against the kernel's siw on lo.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if ! { modprobe siw && modprobe rdma_ucm && rdma link add siw_eth0 type siw netdev eth0; }; then
    echo "vm-api-suite: siw setup failed"; dmesg | tail -20; exit 90
fi
# The kernel's rdma_cm cannot resolve 127.0.0.1 to a siw device on lo (rping fails
# too: ADDR_ERROR), so siw is bound to eth0 and the pairs connect over its address.
HOST=$(ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)
echo "vm-api-suite: $(uname -r); $(python3 --version); $(rdma link show | tr '\n' ' ')"
export PYTHONPATH=/host/src:/sync PYTHONDONTWRITEBYTECODE=1 RDMASHIM_API_TIMEOUT=__TIMEOUT__
export RDMASHIM_API_HOST=$HOST
# RDS runs three nodes: two more addresses on eth0, which siw_eth0 serves too.
BASE=${HOST%.*}; LAST=${HOST##*.}
for n in 1 2; do ip addr add $BASE.$((LAST + n))/24 dev eth0; done
export RDMASHIM_API_RDS_HOSTS=$HOST,$BASE.$((LAST + 1)),$BASE.$((LAST + 2))
echo "vm-api-suite: RDMASHIM_API_HOST=$HOST RDMASHIM_API_RDS_HOSTS=$RDMASHIM_API_RDS_HOSTS"
cd /host/src
rc=0
for b in __BACKENDS__; do
    # "ibal+rdmacore": the ibal backend on rdmacore's CAs; "rping:ibal+rdmacore": our
    # rping client on that backend against the kernel's rping -s.
    # "rxe:rdmacore": rdmacore on Soft-RoCE; siw_eth0 makes way for rxe_eth0 (both on
    # eth0, rdma_cm would pick either), so rxe runs come last.
    if [ "${b#rxe:}" != "$b" ] && ! rdma link show rxe_eth0 > /dev/null 2>&1; then
        rdma link del siw_eth0
        if ! { modprobe rdma_rxe && rdma link add rxe_eth0 type rxe netdev eth0; }; then
            echo "== backend $b: rxe setup failed"; dmesg | tail -5
            echo error > /host/status.$b; rc=1; continue
        fi
        echo "vm-api-suite: $(rdma link show | tr '\n' ' ')"
    fi
    run=${b#rxe:}; run=${run#rping:}; name=${run%%+*}; hca=""
    [ "$run" != "$name" ] && hca=${run#*+}
    python3 - "$name" $hca > /host/probe.$b 2>&1 <<'EOF'
import sys
from rdmashim.registry import load_backend
from rdmashim.verbs.errors import BackendUnavailable
try:
    for name in sys.argv[1:]:
        load_backend(name)
except BackendUnavailable as exc:
    print(exc)
    sys.exit(3)
EOF
    probe=$?
    if [ $probe = 3 ]; then
        echo "== backend $b: unavailable: $(cat /host/probe.$b)"
        echo unavailable > /host/status.$b
        continue
    elif [ $probe != 0 ]; then
        echo "== backend $b: import failed"; cat /host/probe.$b
        echo error > /host/status.$b; rc=1
        continue
    fi
    start=$(date +%s%N)
    if [ "${b#rping:}" != "$b" ]; then
        echo "== $b: kernel rping -s, our ping -c -V -C 5 (RDMASHIM_BACKEND=$name on $hca)"
        timeout 90 rping -s -a $HOST -p 7174 -V > /host/rping-server.txt 2>&1 & P=$!
        sleep 1
        RDMASHIM_BACKEND=$name RDMASHIM_IBAL_HCA=$hca timeout 60 \
            python3 -m rdmashim ping -c -a $HOST -p 7174 -C 5 -V -v 2>&1 | tee /host/pytest.$b.txt
        r=${PIPESTATUS[0]}
        wait $P; s=$?
        echo "kernel rping -s exit $s: $(cat /host/rping-server.txt)" | tee -a /host/pytest.$b.txt
        # rdma-core 44's rping exits 255 after a good run now and then (siwvm.RPING_EXIT_RACE);
        # our side checked every ping's data (-V), and so did rping's.
        if [ $s = 255 ] && grep -qF __RPING_EXIT_RACE__ /host/rping-server.txt; then
            echo "kernel rping's exit race: counted as 0" | tee -a /host/pytest.$b.txt; s=0
        fi
        [ $s = 0 ] || r=1
    else
        once=""
        for o in __CM_PAIRS_ONCE__; do
            [ "$o" = "$b" ] && once="--deselect tests/api/test_cm_states.py"
        done
        echo "== backend $b: python3 -m pytest tests/api $once __PYTEST_ARGS__"
        # A run that hangs past the limit is killed (faulthandler has shown its stacks).
        RDMASHIM_BACKEND=$name RDMASHIM_IBAL_HCA=$hca timeout -k 10 __SUITE_LIMIT__ \
            python3 -m pytest -p no:cacheprovider -p no:hypothesispytest --log-level=INFO \
            tests/api $once __PYTEST_ARGS__ \
            2>&1 | tee /host/pytest.$b.txt
        r=${PIPESTATUS[0]}
        [ $r = 124 ] && echo "killed: still running after __SUITE_LIMIT__ s" >> /host/pytest.$b.txt
        failed=$(grep -oP '^FAILED \K\S+' /host/pytest.$b.txt | sort -u)
        if [ $r != 0 ] && [ -n "$failed" ] && [ $(echo "$failed" | wc -l) -le 3 ]; then
            # Once more, the failed tests alone (a few: more is no flake), their DEBUG
            # log captured: whether a failure repeats, and what the library did.
            echo "== backend $b: rerun of the failed tests"
            RDMASHIM_BACKEND=$name RDMASHIM_IBAL_HCA=$hca timeout -k 10 __SUITE_LIMIT__ \
                python3 -m pytest -p no:cacheprovider -p no:hypothesispytest \
                --log-level=DEBUG $failed 2>&1 | tee /host/rerun.$b.txt
            [ ${PIPESTATUS[0]} = 0 ] && echo passed > /host/rerun-status.$b \
                || echo failed > /host/rerun-status.$b
        fi
    fi
    echo $(( ($(date +%s%N) - start) / 1000000 )) > /host/ms.$b
    [ $r = 0 ] && echo passed > /host/status.$b || { echo failed > /host/status.$b; rc=1; }
    echo $r > /host/rc.$b
done
dmesg | grep -vE "Command line|taint|verification" \
    | grep -E "siw|rdma|BUG:|Oops|Call Trace" | tail -20
exit $rc
"""


@dataclass
class BackendResult:
    """What one backend's run in the guest came to."""

    status: str
    """passed, failed, unavailable (BackendUnavailable in the guest), error, or missing."""
    returncode: int | None
    summary: str
    """pytest's last line (``N passed, ...``) or why nothing ran."""
    seconds: float | None
    output: str
    rerun: str | None = None
    """After a failure, the failed tests run once more: passed or failed (None: not rerun)."""
    rerun_output: str = ""


IBAL_ON_RDMACORE = ("ibal+rdmacore", "rping:ibal+rdmacore")
"""Runs beyond one per backend: the ibal backend on rdma-core's CAs (the kernel's siw)
through tests/api, and its rping client against the kernel's ``rping -s``."""


RXE = "rxe:rdmacore"
"""The rdmacore backend on the kernel's Soft-RoCE (rdma_rxe on eth0) instead of siw:
the suite on an InfiniBand-transport device. It replaces siw_eth0, so it runs last."""


HOST_RUNS = ("softiwarp", "ibal")
"""Backends the host's own suite runs whole (``tests/api`` on the built-in engine, and
``tests/test_api_on_ibal.py``): the guest adds nothing to them, so by default it skips
them (``--backend softiwarp`` still runs one there)."""

CM_PAIRS_ONCE = ("ibal+rdmacore", RXE)
"""Runs that leave out ``tests/api/test_cm_states.py`` (every CM state and call, about
330 s under TCG): the ``rdmacore`` run covers rdma-core's CM id on siw, the host
covers ibal's, and neither the CA under IBAL nor the device under rdma_cm changes
the table."""


def registered_backends() -> list[str]:
    """The runs the guest adds to the host's suite: every backend this tree registers
    (the guest runs the same tree) but :data:`HOST_RUNS`, then ibal on rdma-core
    (:data:`IBAL_ON_RDMACORE`), then rdmacore on rxe (:data:`RXE`)."""
    from rdmashim.registry import BACKENDS

    return [*(b for b in BACKENDS if b not in HOST_RUNS), *IBAL_ON_RDMACORE, RXE]


def guest_script(
    backends: list[str], pytest_args: list[str], timeout: int, suite_limit: int = SUITE_LIMIT
) -> str:
    return (
        _GUEST_SCRIPT.replace("__BACKENDS__", " ".join(shlex.quote(b) for b in backends))
        .replace("__PYTEST_ARGS__", " ".join(shlex.quote(a) for a in pytest_args))
        .replace("__TIMEOUT__", str(timeout))
        .replace("__SUITE_LIMIT__", str(suite_limit))
        .replace("__CM_PAIRS_ONCE__", " ".join(shlex.quote(b) for b in CM_PAIRS_ONCE))
        .replace("__RPING_EXIT_RACE__", shlex.quote(siwvm.RPING_EXIT_RACE))
    )


def boot(name: str, deps: Path, src: Path, script: Path, limit: int, echo: bool) -> tuple[int, str]:
    """Boot the guest, echo its output while it runs; (boot.py's status, its report line)."""
    share = siwvm.guestbed.run_dir(name) / "share"
    cmd = [
        *siwvm.guest_tool("boot"), "--name", name, "--smp", "1", "--mem", "1024",
        "--net", "user", "--sync", str(deps), "--put", str(src), "--timeout", str(limit),
        str(script),
    ]  # fmt: skip
    out_log = share / "out.log"
    shutil.rmtree(share, ignore_errors=True)  # not to echo an earlier run's output
    shown = 0
    with subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,  # boot.py repeats out.log at the end; it is echoed here
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        stderr = ""
        while True:
            done = proc.poll() is not None
            if echo and out_log.exists():
                data = out_log.read_bytes()
                if len(data) < shown:  # a fresh share: boot.py removed the old one
                    shown = 0
                sys.stdout.write(data[shown:].decode(errors="replace"))
                sys.stdout.flush()
                shown = len(data)
            if done:
                stderr = proc.stderr.read() if proc.stderr else ""
                return proc.returncode, stderr.strip()
            time.sleep(0.5)


def collect(name: str, backends: list[str]) -> dict[str, BackendResult]:
    """Read each backend's result files from the guest's share."""
    share = siwvm.cache_dir() / "run" / name / "share"

    def read(path: str) -> str | None:
        p = share / path
        return p.read_text(errors="replace").strip() if p.exists() else None

    results = {}
    for b in backends:
        status = read(f"status.{b}") or "missing"
        output = read(f"pytest.{b}.txt") or read(f"probe.{b}") or ""
        lines = [line for line in output.splitlines() if line.strip()]
        rc = read(f"rc.{b}")
        ms = read(f"ms.{b}")
        results[b] = BackendResult(
            status=status,
            returncode=int(rc) if rc and rc.lstrip("-").isdigit() else None,
            summary=lines[-1].strip("= ") if lines else "(no output)",
            seconds=int(ms) / 1000 if ms and ms.isdigit() else None,
            output=output,
            rerun=read(f"rerun-status.{b}"),
            rerun_output=read(f"rerun.{b}.txt") or "",
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run tests/api in the siw VM (see the module docstring).",
        epilog="Arguments after -- go to pytest in the guest.",
    )
    parser.add_argument(
        "--backend",
        action="append",
        help="backend to run (repeatable; default: what only the guest adds)",
    )
    parser.add_argument("--name", default=DEFAULT_NAME, help=f"guest name (default {DEFAULT_NAME})")
    parser.add_argument("--json", type=Path, help="write the per-backend results here")
    parser.add_argument("--timeout", type=int, default=RUN_LIMIT, help="seconds for the guest")
    parser.add_argument(
        "--wait-limit",
        type=int,
        default=GUEST_TIMEOUT,
        help=f"RDMASHIM_API_TIMEOUT in the guest (default {GUEST_TIMEOUT})",
    )
    parser.add_argument(
        "--suite-limit",
        type=int,
        default=SUITE_LIMIT,
        help=f"seconds one backend's pytest may run in the guest (default {SUITE_LIMIT})",
    )
    parser.add_argument("--quiet", action="store_true", help="do not echo the guest's output")
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backends = args.backend or registered_backends()
    report: dict = {"backends": {}, "requirements": None}

    def finish(code: int) -> int:
        report["exit"] = code
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        return code

    why = siwvm.missing_requirements()
    if why:
        print(f"vm-api-suite: cannot boot the siw guest here: {why}")
        report["requirements"] = why
        return finish(SKIP)
    start = time.monotonic()
    deps = siwvm.guest_python_deps(log=(lambda *_: None) if args.quiet else print)
    report["deps"] = str(deps)
    report["deps_seconds"] = round(time.monotonic() - start, 1)
    run = siwvm.cache_dir() / "run"
    src = siwvm.stage_tree(run / f"{args.name}.stage" / "src")
    script = run / f"{args.name}.suite.sh"
    script.write_text(guest_script(backends, args.pytest_args, args.wait_limit, args.suite_limit))
    boot_start = time.monotonic()
    rc, line = boot(args.name, deps, src, script, args.timeout, echo=not args.quiet)
    report["guest_seconds"] = round(time.monotonic() - boot_start, 1)
    report["guest_exit"] = rc
    report["guest_report"] = line
    results = collect(args.name, backends)
    report["backends"] = {b: asdict(r) for b, r in results.items()}
    print(f"\nvm-api-suite: {line}")
    for b, r in results.items():
        took = f" in {r.seconds:.0f} s" if r.seconds is not None else ""
        print(f"vm-api-suite: {b}: {r.status}{took}: {r.summary}")
        if r.rerun is not None:
            print(f"vm-api-suite: {b}: the failed tests, run again: {r.rerun}")
    ran = [r for r in results.values() if r.status in ("passed", "failed", "error")]
    no_run = (90, siwvm.guestbed.NO_SCRIPT, siwvm.guestbed.TIMED_OUT)
    if rc in no_run or not any(r.status != "missing" for r in results.values()):
        print(f"vm-api-suite: the guest did not run the suite (boot.py exit {rc})")
        return finish(2)
    if ran and all(r.status == "passed" for r in ran):
        return finish(0)
    return finish(1)


if __name__ == "__main__":
    sys.exit(main())
