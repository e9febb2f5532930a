"""A bounded slice of the wire fuzzer (tools/fuzz_wire.py) as a test: no crash, no hang,
no stray write, the listener always accepting; and the fuzzer's own parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from rdmashim.providers.softiwarp import ddp, engines, fastpath, native
from rdmashim.providers.softiwarp.terminate import DdpTaggedCode, ddp_tagged

from tooling import tool

fuzz_wire = tool("fuzz_wire")

TABLE = fuzz_wire.nominal_table()


@pytest.mark.parametrize("engine", ["native", "python-compiled", "python"])
def test_ci_slice_finds_no_crash_hang_or_stray_write(engine: str) -> None:
    """The responder runs the native engine, the Python one with the compiled kernels, or
    the Python one with the Python kernels (the environment chooses in the child)."""
    env = dict(os.environ)
    env[engines.ENV_ENGINE] = "native" if engine == "native" else "python"
    if engine == "python":
        env[fastpath.ENV_NO_EXTENSIONS] = "1"
    elif engine == "native" and not native.AVAILABLE:
        pytest.skip(f"native engine unavailable: {native.WHY_NOT}")
    elif fastpath.COMPILED is None:
        pytest.skip(f"compiled kernels unavailable: {fastpath.WHY_NOT}")
    proc = subprocess.run(
        [sys.executable, fuzz_wire.__file__, "--count", "3000", "--time", "90", "--workers", "4",
         "--seed", "7", "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    summary = json.loads(proc.stdout)
    assert summary["crashes"] == 0, summary["crash_details"]
    assert summary["hangs"] == 0, summary["hang_details"]
    assert summary["stray_writes"] == 0, summary["stray_details"]
    assert summary["listener_refused"] == 0
    assert summary["internal_errors"] == 0, summary["internal_error_details"]
    assert proc.returncode == 0
    assert summary["inputs"] >= 300  # the time bound may stop it early on a loaded machine
    assert set(summary["classes"]) == set(fuzz_wire.CLASSES)
    outcomes = {k for c in summary["classes"].values() for k in c["outcomes"]}
    assert {"terminate LLP/MPA/CRC", "terminate RDMAP/REMOTE_OPERATION/OPCODE"} <= outcomes


def test_inputs_are_deterministic_for_a_seed() -> None:
    gen = fuzz_wire.Generator(TABLE)
    first = [gen.case(5, i) for i in range(200)]
    again = [gen.case(5, i) for i in range(200)]
    assert [(c.cls, c.request, c.stream) for c in first] == [
        (c.cls, c.request, c.stream) for c in again
    ]
    assert len({c.stream for c in first}) > 150
    assert {c.cls for c in first} == set(fuzz_wire.CLASSES)


def test_every_class_generates_without_error() -> None:
    gen = fuzz_wire.Generator(TABLE)
    classes = {gen.case(11, i).cls for i in range(20000)}  # raises on a generator bug
    assert classes == set(fuzz_wire.CLASSES)


def test_valid_seeds_frame_as_the_engine_parses_them() -> None:
    gen = fuzz_wire.Generator(TABLE, classes=("valid",))
    for i in range(100):
        case = gen.case(1, i)
        data, pos = case.stream, 0
        while pos < len(data):
            hdr = ddp.parse_header(data, pos)
            assert hdr is not None
            pos += 2 + hdr.ulpdu_len + ddp.pad_len(hdr.ulpdu_len) + 4
        assert pos == len(data)


def test_scan_terminate_finds_the_code_after_other_fpdus() -> None:
    code = ddp_tagged(DdpTaggedCode.TO_WRAP)
    term = ddp.encode_terminate(ddp.Terminate(code))
    write = fuzz_wire._tagged(ddp.Opcode.WRITE, True, 0x100, 0, b"abc")
    body = fuzz_wire.Fpdu(bytearray(term[:20]), term[20:])
    for crc in (False, True):
        assert fuzz_wire.scan_terminate(fuzz_wire.frame([write, body], crc), crc) == code
        assert fuzz_wire.scan_terminate(fuzz_wire.frame([write], crc), crc) is None


def test_a_starved_responder_is_told_apart_from_a_hang() -> None:
    """The responder stopped (SIGSTOP) for 3 s mid-run times out every input in flight;
    tried again alone they are answered, so they count as stalls, not hangs."""
    proc = subprocess.Popen(
        [sys.executable, fuzz_wire.__file__, "--count", "100000", "--time", "12", "--workers",
         "4", "--seed", "9", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        responder = None
        while responder is None and time.monotonic() < deadline:
            time.sleep(0.5)
            children = psutil.Process(proc.pid).children()
            responder = next((c for c in children if "--responder" in c.cmdline()), None)
        assert responder is not None, "no responder process"
        time.sleep(3)
        responder.suspend()
        time.sleep(3)
        responder.resume()
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    summary = json.loads(out)
    assert summary["hangs"] == 0, summary["hang_details"]
    assert summary["stalls_retried_ok"] >= 1, summary
    assert proc.returncode == 0
