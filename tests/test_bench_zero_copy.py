"""``benchmarks/zero_copy.py``: each way of sending a READ's MiB delivers the file's
bytes framed as FPDUs, held byte for byte by the receiver's check, and the check
catches a sender that gets one byte wrong (so its figures are of senders that work)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from benchrun import BENCHMARKS, run_benchmark

sys.path.insert(0, str(BENCHMARKS))
import zero_copy


@pytest.fixture(scope="module")
def cached_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zero-copy") / "file"
    path.write_bytes(os.urandom(zero_copy.FILE_MIB * zero_copy.MIB))
    return path


@pytest.mark.parametrize("method", zero_copy.METHODS)
def test_each_method_delivers_the_files_bytes_framed(cached_file: Path, method: str) -> None:
    cpu, rate = zero_copy.run(method, str(cached_file), 3, check=True)
    assert cpu > 0 and rate > 0


def test_the_receivers_check_catches_a_wrong_byte(
    cached_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = zero_copy.copy_sender

    def one_byte_off(fd: int) -> zero_copy.Sender:
        send = real(fd)

        def wrong(sock: socket.socket, offset: int, out: int) -> None:
            send(sock, offset + 1 if offset else offset, out)  # (the second MiB is shifted)

        return wrong

    monkeypatch.setattr(zero_copy, "copy_sender", one_byte_off)
    with pytest.raises(SystemExit, match="did not get every byte"):
        zero_copy.run("copy", str(cached_file), 2, check=True)


def test_the_script_prints_each_method_beside_copy() -> None:
    done = run_benchmark("zero_copy.py", "--mib", "2", "--repeat", "1", "--check")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert set(zero_copy.METHODS) <= set(rows)
    assert rows["copy"][-1] == "1.000"
