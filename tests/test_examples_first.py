"""The programs of docs/first-programs.md run as they are and print what they should,
each as a subprocess on the built-in engine over loopback; the page quotes them as they
are (every code block of a section is in that section's example)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "first-programs.md"
TIMEOUT = 120


def free_rds_port() -> int:
    """A TCP port free on both 127.0.0.1 and 127.0.0.2 (the example's two nodes)."""
    for _ in range(20):
        with socket.socket() as one, socket.socket() as two:
            one.bind(("127.0.0.1", 0))
            port = int(one.getsockname()[1])
            try:
                two.bind(("127.0.0.2", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


def run_example(name: str, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, timeout=TIMEOUT, check=False, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, f"{name} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout.splitlines()


@pytest.mark.parametrize("name", ["write_read.py", "write_read_cm.py"])
def test_write_and_read_back(name: str) -> None:
    assert run_example(name) == [
        "read back b'written by RDMA'",
        "the server's buffer holds b'written by RDMA'",
    ]


def test_flow_controlled_batches() -> None:
    assert run_example("batch_credits.py") == [
        "received 10000 messages in order",
        "sent 10000 messages, 16 per post, at most 64 in flight",
    ]


def test_rds_request_and_reply() -> None:
    assert run_example("rds_request_reply.py", str(free_rds_port())) == [
        "127.0.0.1:4000 answered b'reply to a request'"
    ]


def test_rdma_by_cookie_over_rds() -> None:
    assert run_example("rds_rdma_cookie.py", str(free_rds_port())) == [
        "written: the server's buffer holds b'written by RDMA'",
        "the client's Write: SUCCESS; its Read: SUCCESS, b'read by RDMA'",
    ]


def test_nfs_client_against_its_own_server() -> None:
    assert run_example("nfs_client.py") == [
        "hello.txt: 20000 bytes",
        "read back the same bytes: True",
        "on the server's disk: True",
    ]


def test_the_page_quotes_its_examples_as_they_are() -> None:
    sections = re.split(r"^## ", PAGE.read_text(), flags=re.MULTILINE)[1:]
    quoted = 0
    for section in sections:
        named = re.search(r"`examples/(\w+\.py)`", section.splitlines()[0])
        if named is None:
            continue
        source = (ROOT / "examples" / named[1]).read_text()
        for block in re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL):
            assert block in source, f"docs/first-programs.md quotes {named[1]} wrongly:\n{block}"
            quoted += 1
    assert quoted >= 5
