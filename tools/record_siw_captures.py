#!/usr/bin/env python3
"""Record the reference captures of the Linux kernel's siw in ``tests/captures`` (as root).

::

    sudo .venv/bin/python tools/record_siw_captures.py            # all of them, about 3 minutes
    sudo .venv/bin/python tools/record_siw_captures.py --out /tmp/caps

One guest of the test bed (``tools/guest``; build it first) boots on the test
bed's bridge. Inside it, the kernel talks to itself over siw on eth0's address
(the TCP connection takes the guest's loopback, where tcpdump records it):

* ``siw-rping.pcap``: ``rping -C 5`` (Send, Read Request/Response, Write);
* ``siw-write_bw.pcap``, ``siw-send_bw.pcap``, ``siw-read_bw.pcap``: perftest
  ``ib_write_bw`` / ``ib_send_bw`` / ``ib_read_bw -R`` with 4 KiB messages,
  rdma_cm and the Send-based exchange of perftest included (``-n 40``);
* ``siw-nfs3-rdma-mount-head.pcap``: the first packets of an NFSv3 mount over
  RDMA (port 20049; the client's MPA Request carries RPC-over-RDMA private data),
  a read and a small write.

Between the host (rdmashim's engine, ``rdmashim ping`` in the test bed's
namespace) and the guest's kernel, on the bridge:

* ``host-client-vs-siw-rping-crc.pcap``: our client with CRC against ``rping -s``;
* ``host-client-vs-siw-rping-rev1.pcap``: our client asking for MPA rev 1 (siw
  answers rev 1, then cannot post its RDMA Read: rev 1 has no IRD/ORD);
* ``siw-client-vs-host-rping.pcap``: the kernel's ``rping -c`` against our server.

Every capture is cut to at most :data:`MAX_PACKETS` packets; ``captures.json``
beside them records the kernel, the commands and the sizes.
``tests/test_siw_captures.py`` reads them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import siwvm  # noqa: E402  (tests/siwvm.py: the guest, the namespace, host commands in it)

import wirecap  # noqa: E402  (tests/wirecap.py: tcpdump)

MAX_PACKETS = 200
JUDGE = REPO / "tools" / "wirejudge.py"
IN_GUEST_PORTS = {
    "siw-rping.pcap": 7174,
    "siw-write_bw.pcap": 18515,
    "siw-send_bw.pcap": 18515,
    "siw-read_bw.pcap": 18515,
    "siw-nfs3-rdma-mount-head.pcap": 20049,
}
GUEST_NAME = "record-captures"
PING = [sys.executable, "-m", "rdmashim.cli", "ping"]
RACE_ATTEMPTS = 5
"""Our client against siw's responder can hit siw's accept race (docs/interop.md): retry."""

IN_GUEST = r"""
IP=__IP__
MAX=__MAX__
OUT=/host/caps; mkdir -p $OUT
record() {  # record NAME PORT: tcpdump on lo until `finish`
    tcpdump -i lo -s 0 -U -c $MAX -w $OUT/$1 "tcp port $2" 2> $OUT/$1.log & CAP=$!
    for i in $(seq 100); do grep -q "listening on" $OUT/$1.log && break; sleep 0.1; done
}
finish() { sleep 1; kill -INT $CAP 2>/dev/null; wait $CAP; rm -f $OUT/*.log $OUT/*.txt; }
listening() {
    for i in $(seq 200); do ss -Hltn "sport = :$1" | grep -q . && return; sleep 0.05; done
}

record siw-rping.pcap 7174
rping -s -a $IP -p 7174 -C 5 & S=$!; listening 7174
rping -c -a $IP -p 7174 -C 5 -v; wait $S
finish

for t in write send read; do
    record siw-${t}_bw.pcap 18515
    ib_${t}_bw -R -d siw0 -s 4096 -n 40 -p 18515 > $OUT/server.txt 2>&1 & S=$!
    listening 18515
    ib_${t}_bw -R -d siw0 -s 4096 -n 40 -p 18515 $IP > $OUT/client.txt 2>&1; C=$?
    wait $S; echo "ib_${t}_bw: server exit $?, client exit $C"
    finish
done

modprobe rpcrdma; modprobe nfsd
mount -t nfsd nfsd /proc/fs/nfsd
rpcbind -w; exportfs -ra; rpc.mountd; rpc.nfsd 2
echo rdma 20049 > /proc/fs/nfsd/portlist
record siw-nfs3-rdma-mount-head.pcap 20049
mount -t nfs -o vers=3,proto=rdma,port=20049,mountproto=tcp,nolock $IP:/export /mnt/nfs
cat /mnt/nfs/hello.txt
dd if=/dev/zero of=/mnt/nfs/written bs=4096 count=4 2>&1 | tail -1
umount /mnt/nfs
finish
ls -l $OUT
"""

RPING_SERVER = r"""
rping -s -a {ip} -p {port} -v -C 5 > $JOB.rping 2>&1 & P=$!
for i in $(seq 200); do ss -Hltn "sport = :{port}" | grep -q . && break; sleep 0.05; done
touch $JOB.listening
while kill -0 $P 2>/dev/null && [ ! -f $JOB.stop ]; do sleep 0.05; done
kill -9 $P 2>/dev/null; wait $P; echo "rping exit $?"; cat $JOB.rping
"""


def trim(source: Path, dest: Path, packets: int) -> None:
    """Copy a capture (pcap, from tcpdump), keeping its first ``packets`` packets."""
    data = source.read_bytes()
    out, pos, count = bytearray(data[:24]), 24, 0
    little = data[:4] == b"\xd4\xc3\xb2\xa1"
    while pos + 16 <= len(data) and count < packets:
        length = int.from_bytes(data[pos + 8 : pos + 12], "little" if little else "big")
        out += data[pos : pos + 16 + length]
        pos += 16 + length
        count += 1
    dest.write_bytes(out)


def cut_at_a_whole_fpdu(source: Path, dest: Path, port: int) -> dict:
    """Trim to :data:`MAX_PACKETS`, then drop the tail packets that hold the start of an FPDU
    whose end was cut off (tshark cannot frame them); the judge's verdict on the result."""
    packets = MAX_PACKETS
    for _ in range(10):
        trim(source, dest, packets)
        argv = [sys.executable, str(JUDGE), str(dest), str(port), "--pad-from", siwvm.GUEST_IP]
        verdict = json.loads(subprocess.run(argv, capture_output=True, text=True).stdout)
        cut = [u["frame"] for u in verdict.get("undissected_payload", [])]
        if not cut or min(cut) < verdict["frames_on_port"] - 5:
            return verdict
        packets = min(cut) - 1
    return verdict


async def host_client(
    guest: siwvm.Guest, work: Path, name: str, port: int, *options: str
) -> tuple[str, int]:
    """Our ``ping -c`` against the guest's ``rping -s``, retried on siw's accept race;
    (a note, the port)."""
    for attempt in range(1, RACE_ATTEMPTS + 1):
        job = guest.start_job(RPING_SERVER.format(ip=siwvm.GUEST_IP, port=port))
        await job.wait_file("listening", 60)
        pcap = work / name
        async with wirecap.tcpdump(pcap, port, interface=siwvm.BRIDGE, netns=siwvm.NETNS):
            argv = [*PING, "-c", "-a", siwvm.GUEST_IP, "-p", str(port), "-C", "5", *options]
            done = await siwvm.run_in_netns([*argv, "--timeout", "5"], 90)
        job.touch("stop")
        await job.wait(60)
        if done.returncode == 0 or "rev=1" in " ".join(options) or attempt == RACE_ATTEMPTS:
            return f"{name}: ours exit {done.returncode} after {attempt} attempt(s)", port
        port += 1
    raise AssertionError("unreachable")


async def kernel_client(guest: siwvm.Guest, work: Path, name: str, port: int) -> str:
    """The guest's ``rping -c`` against our ``ping -s``."""
    result: dict[str, siwvm.Done] = {}

    async def serve() -> None:
        argv = [*PING, "-s", "-a", siwvm.HOST_IP, "-p", str(port), "--timeout", "30"]
        result["server"] = await siwvm.run_in_netns(argv, 120)

    async with (
        wirecap.tcpdump(work / name, port, interface=siwvm.BRIDGE, netns=siwvm.NETNS),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(serve)
        await siwvm.wait_listening(port)
        done = await guest.run(f"rping -c -a {siwvm.HOST_IP} -p {port} -C 5 -v", 120)
    return f"{name}: kernel exit {done.returncode}, ours {result['server'].returncode}"


async def record(work: Path) -> dict[str, object]:
    """Record every capture into ``work``; the facts for the manifest."""
    created = siwvm.netns_up()
    guest = siwvm.Guest(GUEST_NAME)
    notes: list[str] = []
    ports = dict(IN_GUEST_PORTS)
    try:
        await trio.to_thread.run_sync(guest.start)
        script = IN_GUEST.replace("__IP__", siwvm.GUEST_IP).replace("__MAX__", str(MAX_PACKETS))
        done = await guest.run(script, 600)
        print(done.output)
        if done.returncode != 0:
            raise SystemExit(f"record: the in-guest recordings failed (exit {done.returncode})")
        for pcap in (guest.share / "caps").glob("*.pcap"):
            shutil.copyfile(pcap, work / pcap.name)
        for name, port, options in (
            ("host-client-vs-siw-rping-crc.pcap", 7300, ["--crc"]),
            ("host-client-vs-siw-rping-rev1.pcap", 7310, ["--no-crc", "--mpa-rev=1"]),
        ):
            note, ports[name] = await host_client(guest, work, name, port, *options)
            notes.append(note)
        ports["siw-client-vs-host-rping.pcap"] = 7320
        notes.append(await kernel_client(guest, work, "siw-client-vs-host-rping.pcap", 7320))
        kernel = (await guest.run("uname -r", 30)).output.strip()
    finally:
        guest.stop()
        if created:
            siwvm.netns_down()
    return {
        "recorded_by": "tools/record_siw_captures.py",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "guest_kernel": kernel,
        "siw": "built out of tree from Debian's linux-source for that kernel (tools/guest)",
        "max_packets": MAX_PACKETS,
        "guest_ip": siwvm.GUEST_IP,
        "host_ip": siwvm.HOST_IP,
        "notes": notes,
        "ports": ports,
    }


def publish(work: Path, out: Path, manifest: dict) -> None:
    """Cut each capture into ``out``; write ``captures.json`` with sizes and judge findings."""
    out.mkdir(parents=True, exist_ok=True)
    sizes, problems = {}, {}
    for pcap in sorted(work.glob("*.pcap")):
        verdict = cut_at_a_whole_fpdu(pcap, out / pcap.name, manifest["ports"][pcap.name])
        if not verdict.get("ok"):
            problems[pcap.name] = verdict.get("problems")
        sizes[pcap.name] = (out / pcap.name).stat().st_size
    manifest.update(sizes=sizes, judge_problems=problems)
    (out / "captures.json").write_text(json.dumps(manifest, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "captures")
    args = parser.parse_args(argv)
    why = siwvm.missing_requirements() or wirecap.missing_requirements()
    if why:
        print(f"record: cannot record here: {why}", file=sys.stderr)
        return 2
    work = siwvm.cache_dir() / "run" / f"{GUEST_NAME}.work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    manifest = trio.run(record, work)
    publish(work, args.out, manifest)
    print(json.dumps(manifest, indent=1))
    return 1 if manifest["judge_problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
