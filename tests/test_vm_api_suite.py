"""The shared API suite (``tests/api``) inside the test bed's guest, for every registered backend.

Beside one run per backend, the ibal backend runs on rdma-core's CAs (the kernel's
siw), through tests/api and as an rping client of the kernel's ``rping -s``
(``tools/vm_api_suite.py``'s ``IBAL_ON_RDMACORE``), and the rdmacore backend runs the
suite once more on the kernel's Soft-RoCE, rxe (``RXE``: an InfiniBand-transport device).

One guest boots for the module: ``tools/vm_api_suite.py --json`` (the developer
command of the README) runs ``python3 -m pytest tests/api`` in it once per
backend, with ``RDMASHIM_BACKEND`` set, against the kernel's siw on ``lo``.
Each backend's test here fails when its in-guest pytest failed, and shows that
output. A backend whose module says ``BackendUnavailable`` in the guest is
skipped, except one the guest is built to have (:data:`GUEST_HAS`) while
``RDMASHIM_REQUIRE_INTEROP=1``. Without root, QEMU or the image everything is
skipped (failed under ``RDMASHIM_REQUIRE_INTEROP=1``), as in ``test_siw_interop``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import siwvm

from tooling import tool

pytestmark = [pytest.mark.slow, pytest.mark.interop]

vm_api_suite = tool("vm_api_suite")
RUNS = vm_api_suite.registered_backends()
GUEST_HAS = set(RUNS)
"""Runs the guest image provides for (python3, python3-cffi, rdma-core, siw, rxe): all."""
FLAKY = "ibal+rdmacore"
"""A run that failed now and then in the emulated guest, each time one test alone waiting
60 s for an event that never came: a completion channel event (test_one_channel_many_cqs,
twice), later a CONNECT_REQUEST (test_channel_event_only_after_arming, once). Not
reproduced in the guest since (about 260 runs of the first, 25 runs of test_cm, test_cq and
test_cq_handler for the second). Its failure counts as xfail only when the failed tests
pass when run again (the xfail text holds both runs' output, the failed test's INFO log
records included, for the investigation); a failure that repeats fails."""
LIMIT = 2400.0
"""Seconds for the whole run: pip (first time), boot, each backend's suite under TCG."""


STARTED = "RDMASHIM_VM_API_RUN"
"""A directory where a run of ``tools/vm_api_suite.py`` started before pytest writes
``results.json``, its output in ``out.log`` and its exit status in ``exit`` when done
(``.ci/run`` starts it as soon as the guest is built, so its 15 minutes in the guest
overlap the rest of the suite on the other core). Unset: the run starts here."""


def _run_here(out: Path) -> tuple[int, str]:
    run = subprocess.run(
        [sys.executable, vm_api_suite.__file__, "--name", "api-pytest", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=LIMIT,
        check=False,
    )
    return run.returncode, f"{run.stdout}\n{run.stderr}"


def _run_started(where: Path) -> tuple[int, str]:
    """Wait for the run started before pytest (at most :data:`LIMIT` from now)."""
    done = where / "exit"
    deadline = time.monotonic() + LIMIT
    while not done.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the vm_api_suite run started in {where} did not end within {LIMIT} s")
        time.sleep(5)
    log = where / "out.log"
    output = log.read_text(errors="replace") if log.exists() else ""
    return int(done.read_text().strip() or "1"), output


@pytest.fixture(scope="module")
def vm_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    siwvm.require_guest()
    # The run has its own bound (LIMIT); pytest's faulthandler_timeout (pyproject.toml)
    # would dump every thread's stack into the log two minutes into it, though nothing
    # hangs. pytest arms the dump again for the next test.
    faulthandler.cancel_dump_traceback_later()
    started = os.environ.get(STARTED)
    if started:
        out = Path(started) / "results.json"
        returncode, output = _run_started(Path(started))
    else:
        out = tmp_path_factory.mktemp("vm-api") / "results.json"
        returncode, output = _run_here(out)
    if not out.exists():
        pytest.fail(f"{vm_api_suite.__name__} wrote no results (exit {returncode}):\n{output}")
    results = json.loads(out.read_text())
    if returncode == 2:
        pytest.fail(f"the guest did not run the suite:\n{output[-6000:]}")
    print(f"\n{results.get('guest_report')}; pip deps in {results.get('deps_seconds')} s")
    return results


@pytest.mark.parametrize("backend", RUNS)
def test_api_suite_in_the_siw_vm(vm_results: dict[str, Any], backend: str) -> None:
    result = vm_results["backends"][backend]
    print(f"\n{backend}: {result['status']}: {result['summary']}")
    if result["status"] == "unavailable":
        reason = f"{backend} is unavailable in the guest: {result['output']}"
        if backend in GUEST_HAS and os.environ.get(siwvm.REQUIRE_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    if backend == FLAKY and result["status"] == "failed" and result.get("rerun") == "passed":
        pytest.xfail(
            f"{FLAKY}: failed, then passed when its failed tests ran again (an event lost "
            f"now and then under emulation, being investigated):\n{result['output'][-3000:]}\n"
            f"the rerun:\n{result['rerun_output'][-6000:]}"
        )
    assert result["status"] == "passed", f"in-guest pytest of {backend}:\n{result['output']}"


@pytest.mark.parametrize(
    ("exit_status", "output", "counted"),
    [
        (0, "server DISCONNECT EVENT...", 0),
        (255, f"server DISCONNECT EVENT...\n{siwvm.RPING_EXIT_RACE}", 0),
        (255, "rping: data mismatch", 1),
        (1, siwvm.RPING_EXIT_RACE, 1),
    ],
)
def test_the_guest_counts_rpings_exit_race_as_success_and_nothing_else(
    tmp_path: Path, exit_status: int, output: str, counted: int
) -> None:
    """The rping run of the guest's script, run by bash as the guest runs it: the kernel
    rping's exit 255 with its exit race (after a good run, rdma-core 44) counts as 0; any
    other failure still fails the run."""
    script = vm_api_suite.guest_script(["rping:ibal+rdmacore"], [], 60)
    start = script.index("        wait $P; s=$?")
    end = script.index("[ $s = 0 ] || r=1", start) + len("[ $s = 0 ] || r=1")
    (tmp_path / "rping-server.txt").write_text(output)
    snippet = script[start:end].replace("/host/", f"{tmp_path}/").replace("$b", "run")
    shell = f'r=0\n(exit {exit_status}) & P=$!\n{snippet}\necho "r=$r"\n'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, check=True)
    assert done.stdout.strip().endswith(f"r={counted}"), done.stdout
