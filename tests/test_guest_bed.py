"""The kernel guest test bed itself (``tools/guest``).

Without root: the pieces ``build.py`` and ``boot.py`` are made of (apt sources in
both formats, the initramfs archive read back the way the kernel reads it, the
QEMU command line). With the image (marker ``interop``): one boot that loads every
kernel module the test levels use and finds every tool the tests run.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
from pathlib import Path

import pytest
import siwvm

sys.path.insert(0, str(siwvm.GUEST_TOOLS))
import boot
import build
import guestbed


def read_newc(archive: bytes) -> dict[str, tuple[int, bytes, tuple[int, int]]]:
    """Parse a "newc" cpio archive as the kernel's initramfs unpacker does."""
    entries = {}
    pos = 0
    while True:
        assert archive[pos : pos + 6] == b"070701", archive[pos : pos + 6]
        fields = [int(archive[pos + 6 + 8 * i : pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rdev, namesize = fields[1], fields[6], (fields[9], fields[10]), fields[11]
        name = archive[pos + 110 : pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        data = archive[pos : pos + size]
        pos += size
        pos += -pos % 4
        if name == "TRAILER!!!":
            return entries
        entries[name] = (mode, data, rdev)


def test_initramfs_archive_reads_back() -> None:
    entries = [
        ("bin", 0o040755, b""),
        ("bin/busybox", 0o100755, b"\x7fELF" + bytes(range(7))),  # a length not a multiple of 4
        ("bin/sh", 0o120777, b"busybox"),
        build.CONSOLE,
    ]
    parsed = read_newc(build.cpio_newc(entries))
    assert list(parsed) == ["bin", "bin/busybox", "bin/sh", "dev/console"]
    assert parsed["bin/busybox"] == (0o100755, b"\x7fELF" + bytes(range(7)), (0, 0))
    assert parsed["bin/sh"][:2] == (0o120777, b"busybox")
    assert parsed["dev/console"] == (0o020600, b"", (5, 1))


def test_apt_sources_in_both_formats(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# http://snapshot.example/archive\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb-src\nURIs: http://src.example/debian\nSuites: bookworm\nComponents: main\n\n"
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main contrib\n"
    )
    (tmp_path / "sources.list").write_text(
        "# a comment\ndeb [arch=amd64] http://old.example/debian trixie main\n"
    )
    found = build.sources(tmp_path)
    assert found == [
        ("http://mirror.example/debian", ["bookworm", "bookworm-updates"], ["main"]),
        ("http://security.example/debian-security", ["bookworm-security"], ["main", "contrib"]),
        ("http://old.example/debian", ["trixie"], ["main"]),
    ]


def test_qemu_command(tmp_path: Path) -> None:
    args = argparse.Namespace(
        name="g1", ip="10.77.0.11/24", gw=None, shell=False, accel="tcg", smp=1, mem=768,
        sync=tmp_path / "sync", net="tap:tap1", netns=guestbed.NETNS,
    )  # fmt: skip
    cmd = boot.qemu_command(args, tmp_path / "share")
    assert cmd[:4] == ["ip", "netns", "exec", guestbed.NETNS]
    append = cmd[cmd.index("-append") + 1].split()
    assert "rdmashim.name=g1" in append and "rdmashim.ip=10.77.0.11/24" in append
    assert "tap,id=n0,ifname=tap1,script=no,downscript=no" in cmd
    assert any(a.endswith("snapshot=on") for a in cmd)
    assert any(f"mount_tag={guestbed.SYNC_TAG}" in a for a in cmd)
    assert boot.mac_for("g1") == boot.mac_for("g1") != boot.mac_for("g2")
    user = argparse.Namespace(**{**vars(args), "net": "user", "ip": None, "netns": None})
    cmd = boot.qemu_command(user, tmp_path / "share")
    assert cmd[0] == "qemu-system-x86_64" and "rdmashim.ip=10.0.2.15/24" in " ".join(cmd)


MODULES = ["siw", "rdma_rxe", "rds", "rds_rdma", "rds_tcp", "rpcrdma", "nfsd", "nfs", "rdma_ucm"]
TOOLS = ["rping", "ib_write_bw", "ib_send_bw", "ib_read_bw", "ibv_devinfo", "tcpdump", "fio",
         "rpc.nfsd", "exportfs", "mount.nfs", "python3"]  # fmt: skip


@pytest.mark.interop
def test_two_guests_on_one_tap_take_turns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Two test runs on one machine (CI beside a developer's run) must not boot two
    # QEMUs on one tap (the second fails: "Device or resource busy"): the second waits.
    monkeypatch.setattr(siwvm, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(siwvm, "TAP_WAIT", 1.5)
    first = siwvm.Guest("bed-a", tap="tap9")
    second = siwvm.Guest("bed-b", tap="tap9")
    other = siwvm.Guest("bed-c", tap="tap10")
    first._lock_tap()
    other._lock_tap()  # another tap is free
    with pytest.raises(RuntimeError, match="tap9 stayed in use"):
        second._lock_tap()
    first.stop()  # never booted: stopping gives the tap back all the same
    second._lock_tap()
    second.kill()
    first._lock_tap()
    first.stop()
    other.stop()


def test_guest_has_every_module_and_tool() -> None:
    siwvm.require_guest()
    script = f"""
for m in {" ".join(MODULES)}; do modprobe $m || echo "no module $m"; done
rdma link add rxe0 type rxe netdev eth0 && rdma link add siw0 type siw netdev eth0
rdma link show
for t in {" ".join(TOOLS)}; do command -v $t > /dev/null || echo "no tool $t"; done
python3 -c "import cffi"
lsmod | cut -d' ' -f1 | sort
"""
    done = subprocess.run(
        [*siwvm.guest_tool("boot"), "--name", "bed-check", "--smp", "1", "--timeout", "240",
         "-c", script],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"
    assert "no module" not in out and "no tool" not in out, out
    assert "link rxe0/1" in out and "link siw0/1" in out, out
    loaded = set(out.split())
    assert set(MODULES) <= loaded, set(MODULES) - loaded
    manifest = guestbed.image_dir() / guestbed.MANIFEST
    assert "siw.ko" in manifest.read_text()
    assert gzip.decompress((guestbed.image_dir() / "initrd.gz").read_bytes())[:6] == b"070701"
