#!/usr/bin/env python3
"""Boot the test bed's guest under QEMU, run one script in it, and power it off (as root).

::

    sudo python3 tools/guest/boot.py -c 'modprobe siw && ibv_devices'
    sudo python3 tools/guest/boot.py script.sh --put pcaps/ --timeout 300
    sudo python3 tools/guest/bridge.py up 2  # then, on its bridge:
    sudo python3 tools/guest/boot.py --netns rdmashim-bed --net tap:tap0 --ip 10.77.0.10/24 s.sh
    sudo python3 tools/guest/boot.py --shell        # a shell on the serial console (Ctrl-A x quits)

The script runs as root in the guest with ``/host`` as its working directory:
the 9p share ``run/NAME/share`` of the cache (see ``guestbed.py``), emptied at
each boot; ``--put`` copies files or directories into it, ``--sync DIR`` shares
one more host directory at ``/sync`` (the same one for several guests). The
guest's output is printed when it powers off (it is also in ``share/out.log``
while it runs; the serial console in ``run/NAME/console.log``). The exit status
is the script's, 124 when ``--timeout`` ran out, 125 when the guest never ran it.

The root disk is a snapshot (nothing a guest writes stays), so any number of
guests can boot from one image. There is no KVM here worth using (a paravirtual
KVM hangs Debian's kernel early in boot), so QEMU emulates (TCG) unless
``--accel kvm`` is given: about 8 s from start to a running script.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import guestbed

USER_NET = "user,id=n0,net=10.0.2.0/24,host=10.0.2.2,dns=10.0.2.3,restrict=on"
"""QEMU's user-mode network, closed to the outside (``restrict=on``)."""
USER_IP, USER_GW = "10.0.2.15/24", "10.0.2.2"


def mac_for(name: str) -> str:
    """A stable locally administered MAC address per guest name."""
    digest = hashlib.sha256(name.encode()).digest()
    return "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])


def accelerator(choice: str) -> str:
    if choice == "kvm":
        return "kvm"
    return "tcg,thread=multi"


def netdev(net: str) -> str | None:
    if net == "none":
        return None
    if net == "user":
        return USER_NET
    if net.startswith("tap:"):
        return f"tap,id=n0,ifname={net[4:]},script=no,downscript=no"
    raise SystemExit(f"boot: --net {net}: user, tap:IFNAME or none")


def qemu_command(args: argparse.Namespace, share: Path) -> list[str]:
    image = guestbed.image_dir()
    p = guestbed.INIT_PARAM
    append = ["console=ttyS0", "panic=-1", "quiet", "loglevel=4", f"{p}.name={args.name}"]
    ip, gw = args.ip, args.gw
    if args.net == "user":
        ip, gw = ip or USER_IP, gw or USER_GW
    if ip:
        append.append(f"{p}.ip={ip}")
    if gw:
        append.append(f"{p}.gw={gw}")
    if args.shell:
        append.append(f"{p}.shell=1")
    cmd = [
        "qemu-system-x86_64", "-name", args.name, "-machine", "q35",
        "-accel", accelerator(args.accel), "-cpu", "max",
        "-smp", str(args.smp), "-m", str(args.mem),
        "-nographic", "-no-reboot", "-nodefaults", "-serial", "mon:stdio",
        "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.gz"),
        "-append", " ".join(append),
        "-drive", f"file={image / 'rootfs.ext4'},format=raw,if=virtio,snapshot=on",
        "-virtfs", f"local,path={share},mount_tag={guestbed.SHARE_TAG},security_model=none,id=s0",
        "-device", "virtio-rng-pci",
    ]  # fmt: skip
    if args.sync:
        args.sync.mkdir(parents=True, exist_ok=True)
        cmd += ["-virtfs", f"local,path={args.sync},mount_tag={guestbed.SYNC_TAG},"
                           "security_model=none,id=s1"]  # fmt: skip
    device = netdev(args.net)
    if device:
        cmd += ["-netdev", device, "-device", f"virtio-net-pci,netdev=n0,mac={mac_for(args.name)}"]
    if args.netns:
        cmd = ["ip", "netns", "exec", args.netns, *cmd]
    return cmd


def prepare_share(args: argparse.Namespace) -> Path:
    share = guestbed.run_dir(args.name) / "share"
    shutil.rmtree(share, ignore_errors=True)
    share.mkdir(parents=True)
    if args.command is not None:
        (share / "cmd.sh").write_text(args.command + "\n")
    elif args.script is not None:
        shutil.copyfile(args.script, share / "cmd.sh")
    for path in args.put:
        if path.is_dir():
            shutil.copytree(path, share / path.name, symlinks=True)
        else:
            shutil.copy2(path, share / path.name)
    return share


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("script", nargs="?", type=Path, help="a bash script to run in the guest")
    what.add_argument("-c", dest="command", help="a bash command line to run instead")
    what.add_argument("--shell", action="store_true", help="an interactive shell on the console")
    parser.add_argument("--name", default="guest", help="instance name (share, log, hostname)")
    parser.add_argument("--net", default="user", help="user (default), tap:IFNAME or none")
    parser.add_argument("--ip", help="eth0's address, CIDR (user net: 10.0.2.15/24)")
    parser.add_argument("--gw", help="default route")
    parser.add_argument("--netns", help="run QEMU in this network namespace (where the tap is)")
    parser.add_argument("--put", type=Path, action="append", default=[], help="copy into /host")
    parser.add_argument("--sync", type=Path, help="a host directory shared at /sync")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before QEMU is killed")
    parser.add_argument("--smp", type=int, default=2)
    parser.add_argument("--mem", type=int, default=1024, help="MiB")
    parser.add_argument("--accel", choices=["tcg", "kvm"], default="tcg")
    parser.add_argument("--quiet", action="store_true", help="do not print the guest's output")
    args = parser.parse_args(argv)
    missing = guestbed.missing_image()
    if missing:
        print(f"boot: {missing}", file=sys.stderr)
        return guestbed.NO_SCRIPT
    if shutil.which("qemu-system-x86_64") is None:
        print(
            "boot: qemu-system-x86_64 not found (apt-get install qemu-system-x86)", file=sys.stderr
        )
        return guestbed.NO_SCRIPT
    share = prepare_share(args)
    cmd = qemu_command(args, share)
    if args.shell:
        os.execvp(cmd[0], cmd)
    console = guestbed.run_dir(args.name) / "console.log"
    start = time.monotonic()
    with console.open("wb") as log:
        qemu = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        # A signal to this process (the tests kill its process group) takes QEMU along.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: (qemu.kill(), sys.exit(128 + signal.SIGTERM)))
        try:
            qemu.wait(args.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            qemu.kill()
            qemu.wait()
            timed_out = True
    took = time.monotonic() - start
    out = share / "out.log"
    if not args.quiet:
        if out.exists():
            sys.stdout.write(out.read_text(errors="replace"))
        else:
            tail = console.read_text(errors="replace").splitlines()[-40:]
            print("boot: the guest wrote no out.log; its console ends with:", *tail, sep="\n")
    rc_file = share / "rc"
    status = guestbed.TIMED_OUT if timed_out else guestbed.NO_SCRIPT
    if not timed_out and rc_file.exists():
        status = int(rc_file.read_text().strip() or guestbed.NO_SCRIPT)
    print(f"boot: guest {args.name}: exit {status} after {took:.1f} s (QEMU {qemu.returncode}); "
          f"share {share}", file=sys.stderr)  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
