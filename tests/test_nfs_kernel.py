"""The Linux kernel's NFS client mounts our NFS server, over RPC-over-RDMA and over TCP.

One guest boots per module in the test bed's namespace (``tests/siwvm.py``; its
agent has already loaded siw and added ``siw0`` on ``eth0``). On the host,
:func:`serve_nfs` runs inside the namespace (our own engine, the bridge's
address, RDMA 20049, TCP 2049, our rpcbind on 111) over a temporary export
holding a small tree. In the guest, ``mount -t nfs -o vers=3,proto=rdma`` (then
``proto=tcp``) mounts it, lists it, copies the tree out and compares it, copies a
tree in, writes a file with ``dd``, renames, removes, makes a symlink, reads the
big file back with the page cache dropped, and unmounts. The guest reports the
checksums of everything it read and wrote; the host checks them against the
files on its disk, byte for byte.

The mount takes no options beyond ``vers``, ``proto`` and ``port``: no
``nolock``, so the guest starts rpcbind and rpc.statd as a Debian client has
them, and its locks go to the server's NLM (over TCP, for either mount):
:data:`LOCK_STEP` takes a ``lockf`` lock, sees a second process refused
(LOCK) and told the holder (F_GETLK: TEST), unlocks, has a blocking lock
wait for a holder and be granted when it lets go (the server's GRANTED
callback to the guest's lockd, faster than the client's 30 s re-poll), and
does the same refusal with ``flock``. Root squash is off for this export (the
guest's ``cp -a`` runs as root and keeps owners). :func:`test_kernel_big_file` then moves a
256 MiB file each way over RDMA and over TCP, uncaptured, and reports the rates. The RDMA
run is captured on the bridge and judged by the wire judge (Wireshark's iWARP,
RPC-over-RDMA and NFS dissectors) when tcpdump and tshark are here.

**tshark 4.0 loses MPA framing in long captures.** Where one TCP segment (the
host's GSO segments are up to 64 KiB) ends a 64 KiB FPDU, holds whole ones and
starts another 64 KiB FPDU, tshark's heuristic MPA dissector may report
"Unreassembled Packet" there and parse every later byte of that direction
as garbage (bad CRCs, absurd headers). The test therefore also frames both TCP
streams itself (:func:`fpdu_framing`: every FPDU from the start frame to the end
of the stream, every CRC32c checked) and accepts judge findings only when all
of them lie at or after the frame where tshark reported the unreassembled
packet and our own framing of the whole capture is clean; it prints both.

Needs root, QEMU and the image built by ``tools/guest/build.py``; skipped
otherwise, the skip naming what is missing.
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import crc32c
import pytest
import siwvm
import trio

from rdmashim.ulps.nfsrdma.server import ServerConfig, Serving, serve_nfs

import wirecap
from pcapstreams import tcp_streams

pytestmark = [pytest.mark.slow, pytest.mark.interop]

GUEST_IP = "10.77.0.12"
"""Our own tap and address, so another module's guest on tap 0 or 1 does not collide."""
TAP = 2
RDMA_PORT = 20049
TCP_PORT = 2049
RPCBIND_PORT = 111
BIG_MIB = 16
HUGE_MIB = 256
JOB_LIMIT = 900.0
NLM_POLL_SECONDS = 30
"""How often a blocked Linux NLM client asks again (NLMCLNT_POLL_TIMEOUT)."""

TREE = {
    "empty": b"",
    "one": b"x",
    "hello.txt": b"hello from the host\n",
    "sub/page": bytes(range(256)) * 16,
    "sub/deeper/odd": os.urandom(5001),
    "sub/deeper/big": os.urandom(300_000),
}
"""The tree the host exports (path -> contents), plus a symlink ``sub/link`` -> ``deeper/odd``."""

GUEST_SCRIPT = r"""
set -e -o pipefail
PROTO={proto}; M=/mnt/nfs; W=/tmp/work.$PROTO
{prologue}
mkdir -p $W
mount -t nfs -o vers=3,proto=$PROTO,port={port} {host}:{export} $M
grep " $M " /proc/mounts
ls -lR $M
# read: the host's tree, copied out and compared
cp -a $M/tree $W/out
diff -r $M/tree $W/out
(cd $W/out && find . -type f -print0 | sort -z | xargs -0 sha256sum) > $JOB.read
readlink $W/out/sub/link > $JOB.readlink
# write: a tree in, a big file by dd, rename, remove, symlink
mkdir -p $W/gen/a/b $W/gen/c
head -c 0 /dev/urandom > $W/gen/zero
head -c 1 /dev/urandom > $W/gen/a/one
head -c 4097 /dev/urandom > $W/gen/a/b/page-plus-one
head -c 200000 /dev/urandom > $W/gen/c/two-hundred-k
ln -s a/b/page-plus-one $W/gen/rel-link
chmod 640 $W/gen/a/one; chmod 750 $W/gen/c; touch -d 2001-02-03T04:05:06 $W/gen/zero
cp -a $W/gen $M/in
dd if=/dev/urandom of=$W/big bs=1M count={big_mib} status=none
T1=$(date +%s)
dd if=$W/big of=$M/big.tmp bs=1M conv=fsync status=progress
echo "dd wrote {big_mib} MiB in $(( $(date +%s) - T1 )) s"
mv $M/big.tmp $M/in/big
ln -s in/a/one $M/link-to-one
mkdir -p $M/junk/x/y; echo junk > $M/junk/x/y/f; echo junk > $M/junk/g
rm -r $M/junk
test ! -e $M/junk
df -h $M
sync
# read back the big file with the page cache dropped: READ from the server
echo 3 > /proc/sys/vm/drop_caches
T2=$(date +%s)
cmp $W/big $M/in/big
echo "read back {big_mib} MiB in $(( $(date +%s) - T2 )) s"
diff -r $W/gen $M/in --exclude=big
(cd $W/gen && find . -type f -print0 | sort -z | xargs -0 sha256sum) > $JOB.wrote
(cd $W/gen && find . -mindepth 1 ! -type l -printf '%P %m %T@\n' | sort) > $JOB.modes
(cd $W && sha256sum big | sed 's| big$| ./big|') >> $JOB.wrote
readlink $M/link-to-one > $JOB.link
{locks}
umount $M
if grep -q " $M " /proc/mounts; then echo "still mounted"; exit 1; fi
dmesg | grep -iE "rpcrdma|nfs|siw|rpc|lockd" | tail -n 20 || true
echo "guest job done"
"""

LOCK_STEP = r"""
# locks go to the server's NLM (no nolock): each step under timeout, so a hang fails fast
L=$M/lockfile; echo lock > $L
timeout 90 python3 - $L $JOB.lockwait <<'PY'
import errno, fcntl, struct, subprocess, sys, time
path, report = sys.argv[1], sys.argv[2]
PROBE = (
    "import errno, fcntl, struct, sys\n"
    "f = open(sys.argv[1], 'r+')\n"
    "if sys.argv[2] == 'test':\n"  # F_GETLK: NLM TEST; prints the conflicting type
    "    got = fcntl.fcntl(f, fcntl.F_GETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, 0, 0, 0))\n"
    "    print(struct.unpack('hhqqi4x', got)[0]); sys.exit(0)\n"
    "try:\n"
    "    fcntl.lockf(f, fcntl.LOCK_EX | (fcntl.LOCK_NB if sys.argv[2] == 'nb' else 0))\n"
    "except OSError as e:\n"
    "    sys.exit(3 if e.errno in (errno.EAGAIN, errno.EACCES) else 4)\n"
)
def probe(mode, **kw):
    return subprocess.run([sys.executable, "-c", PROBE, path, mode], timeout=60, **kw)
holder = open(path, "r+")
fcntl.lockf(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # LOCK: granted (it hung without NLM)
assert probe("nb").returncode == 3, "a second owner got the lock the first holds"
test = probe("test", capture_output=True, text=True)
assert test.stdout.strip() == str(fcntl.F_WRLCK), test  # TEST names the holder's lock
fcntl.lockf(holder, fcntl.LOCK_UN)  # UNLOCK
assert probe("nb").returncode == 0, "the lock was not free after UNLOCK"
fcntl.lockf(holder, fcntl.LOCK_EX)
waiter = subprocess.Popen([sys.executable, "-c", PROBE, path, "block"])
time.sleep(3)
assert waiter.poll() is None, "a blocking lock did not wait for the holder"
released = time.monotonic()
fcntl.lockf(holder, fcntl.LOCK_UN)  # the server grants the waiter: GRANTED callback
assert waiter.wait(timeout=60) == 0, "the blocked lock was not granted"
took = time.monotonic() - released
open(report, "w").write("%.1f\n" % took)
print("blocked lock granted %.1f s after the release" % took)
PY
timeout 60 flock -n $L -c "! flock -n $L true"  # flock: a second open file is refused
timeout 60 flock -n $L true  # and free again after
echo "locks: done"
"""
"""fcntl/lockf and flock on the mount, through the server's NLM (GUEST_SCRIPT's last step)."""

PROLOGUE = r"""
if [ $PROTO = rdma ]; then modprobe rpcrdma; fi
rdma link show
pgrep -x rpcbind >/dev/null || rpcbind -w
pgrep -x rpc.statd >/dev/null || rpc.statd
mkdir -p $M; rm -rf $W
"""
"""What a Debian NFS client has running: rpcbind and rpc.statd (so no ``nolock``)."""

BIG_SCRIPT = r"""
set -e -o pipefail
PROTO={proto}; M=/mnt/nfs; W=/tmp/big.$PROTO
{prologue}
mkdir -p $W
mount -t nfs -o vers=3,proto=$PROTO,port={port} {host}:{export} $M
dd if=/dev/urandom of=$W/big bs=1M count={mib} status=none
sha256sum $W/big | cut -d' ' -f1 > $JOB.sum
T1=$(date +%s.%N)
dd if=$W/big of=$M/big bs=1M conv=fsync status=none
T2=$(date +%s.%N)
echo 3 > /proc/sys/vm/drop_caches
T3=$(date +%s.%N)
cmp $W/big $M/big
T4=$(date +%s.%N)
echo "$T1 $T2 $T3 $T4" > $JOB.times
umount $M
rm -rf $W
echo "guest job done"
"""
"""A {mib} MiB file written with fsync, then read back with the page cache dropped."""


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def guest() -> Iterator[siwvm.Guest]:
    """One booted guest with siw0 for the whole module (skipped where it cannot boot)."""
    with siwvm.booted("rdmashim-nfs-kernel", GUEST_IP, TAP, ("nfs", "rpc")) as vm:
        yield vm


def make_export(root: Path) -> Path:
    """The export directory with :data:`TREE` under ``tree``."""
    export = root / "export"
    for name, data in TREE.items():
        path = export / "tree" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (export / "tree" / "sub" / "link").symlink_to("deeper/odd")
    return export


@asynccontextmanager
async def nfs_server(export: Path, state: Path) -> AsyncIterator[Serving]:
    """:func:`serve_nfs` in the namespace (a trio loop of its own in a thread) for the block."""
    config = ServerConfig(
        export, root_squash=False, host=siwvm.HOST_IP, tcp_port=TCP_PORT,
        rdma_port=RDMA_PORT, rpcbind_port=RPCBIND_PORT, backend="softiwarp", state_dir=state,
    )  # fmt: skip
    here = trio.lowlevel.current_trio_token()
    started = trio.Event()
    box: dict[str, Any] = {}

    async def run() -> None:
        stop = trio.Event()
        box["stop"] = (trio.lowlevel.current_trio_token(), stop)
        async with trio.open_nursery() as nursery:
            box["serving"] = await nursery.start(serve_nfs, config)
            here.run_sync_soon(started.set)
            await stop.wait()
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(siwvm.in_netns, run)
        await started.wait()
        try:
            yield box["serving"]
        finally:
            token, stop = box["stop"]
            token.run_sync_soon(stop.set)


def sums(text: str) -> dict[str, str]:
    """``sha256sum`` output as {path without ./: digest}."""
    out = {}
    for line in text.splitlines():
        digest, name = line.split(maxsplit=1)
        out[name.removeprefix("./")] = digest
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def mount_and_exercise(
    guest: siwvm.Guest, tmp_path: Path, proto: str, port: int, pcap: Path | None
) -> dict[str, Any]:
    """Serve, run :data:`GUEST_SCRIPT`, and check on the host what the guest read and wrote."""
    export = make_export(tmp_path)
    script = GUEST_SCRIPT.format(
        proto=proto, port=port, host=siwvm.HOST_IP, export=export, big_mib=BIG_MIB,
        prologue=PROLOGUE, locks=LOCK_STEP,
    )  # fmt: skip
    start = time.monotonic()
    async with (
        siwvm.capture(pcap is not None, pcap or Path(), port),
        nfs_server(export, tmp_path / "state") as serving,
    ):
        assert serving.rpcbind_port == RPCBIND_PORT, serving
        job = guest.start_job(script)
        result = await job.wait(JOB_LIMIT)
    took = time.monotonic() - start
    print(f"\n--- guest ({proto}, {took:.1f} s):\n{result.output}")
    assert result.returncode == 0, result.output
    # what the guest read is the host's tree
    read = sums(job.path("read").read_text())
    assert read == {name: hashlib.sha256(data).hexdigest() for name, data in TREE.items()}
    assert job.path("readlink").read_text().strip() == "deeper/odd"
    # what the guest wrote is on the host's disk, byte for byte
    wrote = sums(job.path("wrote").read_text())
    assert set(wrote) == {"zero", "a/one", "a/b/page-plus-one", "c/two-hundred-k", "big"}
    for name, digest in wrote.items():
        assert sha(export / "in" / name) == digest, name
    assert (export / "in" / "big").stat().st_size == BIG_MIB << 20
    for line in job.path("modes").read_text().splitlines():  # cp -a: SETATTR mode and mtime
        name, mode, mtime = line.split()
        st = (export / "in" / name).lstat()
        assert (oct(st.st_mode & 0o7777), int(float(mtime))) == (
            oct(int(mode, 8)),
            int(st.st_mtime),
        ), name
    assert os.readlink(export / "in" / "rel-link") == "a/b/page-plus-one"
    assert os.readlink(export / "link-to-one") == "in/a/one"
    assert job.path("link").read_text().strip() == "in/a/one"
    assert not (export / "junk").exists() and not (export / "big.tmp").exists()
    # the blocked lock came through the GRANTED callback, not the client's 30 s re-poll
    assert float(job.path("lockwait").read_text()) < NLM_POLL_SECONDS - 5
    return {"seconds": took, "output": result.output}


MPA_KEY_LEN = 16
MPA_FLAG_C = 0x40


def fpdu_framing(pcap: Path, port: int) -> tuple[dict[str, int], list[str], int | None]:
    """Frame both directions of the MPA connection on ``port`` in ``pcap`` ourselves.

    Returns the FPDU count per direction, the problems (a stream that does not
    end on an FPDU boundary, a bad CRC32c when CRCs were negotiated) and the
    first frame from which the capture lost bytes, if it did: the first frame of the
    FPDU the loss cuts (tshark cannot dissect that FPDU's captured part either). Where
    the capture lost bytes (tcpdump dropped packets under load) a stream is framed up
    to the loss, which is printed, not counted as a problem of ours.
    """
    streams = [s for s in tcp_streams(pcap) if port in (s.src[1], s.dst[1])]
    data = {f"{s.src[0]}:{s.src[1]}": s.data() for s in streams}
    cut = {f"{s.src[0]}:{s.src[1]}" for s in streams if s.gap is not None}
    for s in streams:
        if s.gap is not None:
            print(f"capture of {s.src[0]}:{s.src[1]} lost bytes at stream offset {s.gap}")
    crc_on = any(d[MPA_KEY_LEN] & MPA_FLAG_C for d in data.values() if len(d) > MPA_KEY_LEN)
    counts, problems = {}, []
    gaps = []
    by_src = {f"{s.src[0]}:{s.src[1]}": s for s in streams}
    for src, d in data.items():
        (pd_len,) = struct.unpack_from(">H", d, MPA_KEY_LEN + 2)
        off, n = MPA_KEY_LEN + 4 + pd_len, 0
        while off < len(d):
            if off + 2 > len(d):
                if src not in cut:
                    problems.append(f"{src}: {len(d) - off} byte(s) after the last FPDU")
                elif off < len(d):
                    gaps.append(by_src[src].frame_at(off))
                break
            (ulpdu,) = struct.unpack_from(">H", d, off)
            crc_at = off + 2 + ulpdu + (-(2 + ulpdu)) % 4
            if crc_at + 4 > len(d):
                if src not in cut:
                    problems.append(f"{src}: FPDU {n} at {off} runs past the end ({ulpdu} bytes)")
                else:
                    gaps.append(by_src[src].frame_at(off))
                break
            want = crc32c.crc32c(d[off:crc_at]).to_bytes(4, "little")
            if crc_on and d[crc_at : crc_at + 4] != want:
                problems.append(f"{src}: FPDU {n} at stream offset {off}: bad CRC32c")
            off, n = crc_at + 4, n + 1
        counts[src] = n
    gaps += [s.gap_frame for s in streams if s.gap_frame is not None]
    return counts, problems, min(gaps, default=None)


def findings_after_lost_framing(wire: dict[str, Any], capture_lost: int | None) -> int | None:
    """The frame where framing was lost, by tshark or by the capture itself (``capture_lost``,
    the first frame after bytes tcpdump dropped), if every judge finding lies at or after it."""
    lost = [m["frame"] for m in wire.get("malformed", []) if "Unreassembled" in m["what"]]
    lost += [capture_lost] if capture_lost is not None else []
    if not lost:
        return None
    first = min(lost)
    frames = [
        item["frame"]
        for key in ("crc_errors", "malformed", "expert_errors", "undissected_payload", "lint")
        for item in wire.get(key, [])
    ]
    return first if all(frame >= first for frame in frames) else None


# ---------------------------------------------------------------- tests


async def test_kernel_mounts_over_rdma(guest: siwvm.Guest, tmp_path: Path) -> None:
    """proto=rdma: the kernel's rpcrdma over its siw against our engine; the wire judged."""
    pcap = tmp_path / "nfs-rdma.pcap" if siwvm.can_capture() else None
    await mount_and_exercise(guest, tmp_path, "rdma", RDMA_PORT, pcap)
    if pcap is None:
        return
    counts, framing, capture_lost = fpdu_framing(pcap, RDMA_PORT)
    print(f"\nour own framing of the capture: {counts} FPDUs, problems: {framing}")
    assert not framing
    wire = await siwvm.judge(pcap, RDMA_PORT, GUEST_IP)
    text = wirecap.summary(wire)
    assert wire["rdmap_opcodes"].get("Read Request") and wire["rdmap_opcodes"].get("Write")
    assert any("READ" in k for k in wire.get("nfs", {})), "no NFS dissected"
    if wire["our_problems"]:
        lost = findings_after_lost_framing(wire, capture_lost)
        assert lost is not None, f"the wire judge found problems:\n{text}"
        print(
            f"\nwire judge: clean up to frame {lost}, where MPA framing was lost "
            f"({len(wire['crc_errors'])} bad CRCs and {len(wire['lint'])} lint findings "
            f"after it); our own framing of every FPDU is clean"
        )
    else:
        print(f"\nwire judge: clean, {wire['fpdus']} FPDUs, NFS {wire.get('nfs')}")


async def test_kernel_mounts_over_tcp(guest: siwvm.Guest, tmp_path: Path) -> None:
    """proto=tcp: the same over RPC on TCP (MOUNT found through our rpcbind)."""
    await mount_and_exercise(guest, tmp_path, "tcp", TCP_PORT, None)


@pytest.mark.parametrize(("proto", "port"), [("rdma", RDMA_PORT), ("tcp", TCP_PORT)])
async def test_kernel_big_file(guest: siwvm.Guest, tmp_path: Path, proto: str, port: int) -> None:
    """A 256 MiB file written with ``dd conv=fsync`` and read back with cold caches; the
    copy on the host's disk is byte-exact. Prints the guest's rates (under emulation)."""
    export = tmp_path / "export"
    export.mkdir()
    script = BIG_SCRIPT.format(
        proto=proto, port=port, host=siwvm.HOST_IP, export=export, mib=HUGE_MIB,
        prologue=PROLOGUE,
    )  # fmt: skip
    async with nfs_server(export, tmp_path / "state"):
        job = guest.start_job(script)
        result = await job.wait(JOB_LIMIT)
    assert result.returncode == 0, result.output
    assert (export / "big").stat().st_size == HUGE_MIB << 20
    assert sha(export / "big") == job.path("sum").read_text().strip()
    t1, t2, t3, t4 = map(float, job.path("times").read_text().split())
    print(
        f"\nkernel client over {proto}, {HUGE_MIB} MiB: "
        f"write+fsync {HUGE_MIB / (t2 - t1):.1f} MiB/s, "
        f"cold read {HUGE_MIB / (t4 - t3):.1f} MiB/s (guest under emulation)"
    )
