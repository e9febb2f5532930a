"""The rdma-core backend's binding on a machine without RDMA hardware (as in CI).

libibverbs and librdmacm are loaded (Debian: ``libibverbs1 librdmacm1``), the
device list is empty, and choosing the backend raises the documented
``BackendUnavailable`` errors: one naming the packages when a library is
missing, one saying why no device is usable when there is none. Loading is
lazy: importing rdmashim opens no library.
"""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
from pathlib import Path

import pytest

import rdmashim
from rdmashim.cm import EventChannel
from rdmashim.providers.rdmacore import get_device_list, lib, unavailable_reason
from rdmashim.registry import backend_status
from rdmashim.verbs.errors import BackendUnavailable

MISSING = "libnonexistent-rdmashim-test.so.1"
HAS_RDMA_CM = Path("/dev/infiniband/rdma_cm").exists()


def _has_devices() -> bool:
    return any(Path("/sys/class/infiniband").glob("*"))


@pytest.fixture
def libibverbs() -> None:
    if ctypes.util.find_library("ibverbs") is None:
        pytest.skip("libibverbs not installed (apt-get install libibverbs1 ibverbs-providers)")


@pytest.fixture
def no_devices(libibverbs: None) -> None:
    if _has_devices():
        pytest.skip("this machine has RDMA devices")


def test_import_loads_no_library() -> None:
    code = (
        "import rdmashim, rdmashim.cm, rdmashim.providers.rdmacore as rc;"
        "from rdmashim.providers.rdmacore import lib;"
        "assert lib._loaded == {}, lib._loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_libraries_load(libibverbs: None) -> None:
    assert lib.verbs().ibv_get_device_list is not None
    if ctypes.util.find_library("rdmacm") is not None:
        assert lib.rdmacm().rdma_create_event_channel is not None


def test_device_list_is_empty_without_devices(no_devices: None) -> None:
    assert get_device_list() == []
    assert rdmashim.get_device_list(backend="rdmacore") == []


def test_missing_library_names_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lib.VERBS_ENV, MISSING)
    with pytest.raises(BackendUnavailable, match=r"apt-get install libibverbs1") as info:
        rdmashim.get_device_list(backend="rdmacore")
    assert MISSING in str(info.value)
    assert MISSING in (unavailable_reason() or "")


async def test_missing_librdmacm_fails_when_the_cm_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(lib.RDMACM_ENV, MISSING)
    with pytest.raises(BackendUnavailable, match=r"librdmacm1"):
        async with EventChannel(backend="rdmacore"):
            pass


async def test_open_device_without_device_says_why(no_devices: None) -> None:
    with pytest.raises(BackendUnavailable, match=r"no RDMA device.*rdma link add"):
        async with rdmashim.open_device(backend="rdmacore"):
            pass


async def test_event_channel_without_rdma_cm_says_what_to_load(no_devices: None) -> None:
    if ctypes.util.find_library("rdmacm") is None:
        pytest.skip("librdmacm not installed (apt-get install librdmacm1)")
    if HAS_RDMA_CM:
        pytest.skip("this machine has the rdma_cm device")
    with pytest.raises(BackendUnavailable, match=r"modprobe rdma_ucm"):
        async with EventChannel(backend="rdmacore"):
            pass


def test_backend_status_reports_the_reason(no_devices: None) -> None:
    status = {info.name: reason for info, reason in backend_status()}
    assert status["softiwarp"] is None
    assert status["rdmacore"] is not None and "no RDMA device" in status["rdmacore"]


def test_cli_devices_lists_rdmacore_as_unavailable(no_devices: None) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rdmashim.cli", "devices"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "(rdmacore unavailable: no RDMA device" in out
