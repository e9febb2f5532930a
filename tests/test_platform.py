"""The base install works without cffi; the rdmacore backend then says how to get it.

cffi is the ``rdmacore`` extra. Each test runs Python in a subprocess with
``sys.modules["cffi"] = None``, so any ``import cffi`` there fails as it does
where cffi is not installed, while the test environment itself keeps cffi for
the rdma-core binding tests.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_CFFI = "import sys; sys.modules['cffi'] = None\n"
EXTRA_HINT = "pip install 'rdmashim[rdmacore]'"


def python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter where cffi cannot be imported."""
    return subprocess.run(
        [sys.executable, "-c", BLOCK_CFFI + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_devices_lists_softiwarp_and_explains_rdmacore() -> None:
    out = python("from rdmashim.cli import main; sys.exit(main(['devices']))")
    assert out.returncode == 0, out.stderr
    assert "siw_lo" in out.stdout and "softiwarp" in out.stdout
    (line,) = [row for row in out.stdout.splitlines() if "rdmacore unavailable" in row]
    assert "needs cffi" in line and EXTRA_HINT in line


def test_choosing_rdmacore_names_the_extra() -> None:
    out = python(
        """
        from rdmashim.registry import load_backend
        from rdmashim.verbs.errors import BackendUnavailable
        try:
            load_backend("rdmacore")
        except BackendUnavailable as exc:
            print(exc)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "needs cffi" in out.stdout and EXTRA_HINT in out.stdout


def test_base_modules_open_a_softiwarp_device() -> None:
    out = python(
        """
        import trio
        import rdmashim, rdmashim.cm, rdmashim.providers.softiwarp, rdmashim.ulps.rds

        async def main():
            async with rdmashim.open_device("siw_lo") as ctx:
                mr = ctx.alloc_pd().reg_mr(bytearray(4096), rdmashim.Access.LOCAL_WRITE)
                print(ctx.query_port(1).state.name, mr.length, mr.addr != 0)

        trio.run(main)
        print(sorted(m for m in sys.modules if m.startswith("rdmashim.providers.rdmacore")))
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["ACTIVE 4096 True", "[]"]


def test_demo_moves_data_without_cffi() -> None:
    out = python(
        "from rdmashim.cli import main; sys.exit(main(['demo', '-n', '2', '-s', '65536']))"
    )
    assert out.returncode == 0, out.stderr + out.stdout


def test_rdmacore_event_channel_names_the_extra() -> None:
    out = python(
        """
        import trio
        from rdmashim.cm import EventChannel
        from rdmashim.verbs.errors import BackendUnavailable

        async def main():
            async with EventChannel(backend="rdmacore"):
                pass

        try:
            trio.run(main)
        except BackendUnavailable as exc:
            print(exc)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "needs cffi" in out.stdout and EXTRA_HINT in out.stdout


def test_pinning_holds_the_buffer_in_place() -> None:
    out = python(
        """
        from rdmashim.verbs.buffers import pin
        from rdmashim.verbs.errors import VerbsError
        data = bytearray(b"x" * 64)
        pinned = pin(data, writable=True)
        try:
            data.extend(b"more")
        except BufferError:
            print("held")
        pinned.view[:2] = b"ok"
        pinned.release()
        pinned.release()
        data.extend(b"!")
        print(bytes(data[:2]).decode(), len(data))
        try:
            pin(b"read only", writable=True)
        except VerbsError as exc:
            print("refused", exc.errno)
        print(pin(b"read only", writable=False).addr != 0)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["held", "ok", "65", "refused", "13", "True"]
