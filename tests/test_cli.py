"""The rdmashim command as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rdmashim", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_devices_lists_loopback_device() -> None:
    out = run("devices")
    assert out.returncode == 0, out.stderr
    assert "siw_lo" in out.stdout and "softiwarp" in out.stdout


def test_devinfo_reports_iwarp_limits() -> None:
    out = run("devinfo", "-d", "siw_lo", "-v")
    assert out.returncode == 0, out.stderr
    assert "transport:\t\t\tiWARP (1)" in out.stdout
    assert "max_sge_rd:" in out.stdout and "max_private_data:" in out.stdout


def test_devinfo_unknown_device_is_a_clear_error() -> None:
    out = run("devinfo", "-d", "siw_nosuch")
    assert out.returncode == 1
    assert "no device 'siw_nosuch'" in out.stderr


def test_demo_verifies_data() -> None:
    out = run("demo", "-n", "4", "-s", "200000", "--no-crc")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("data verified") == 2
    assert "MPA CRC off" in out.stdout
