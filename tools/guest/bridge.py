#!/usr/bin/env python3
"""The host side of the guests' network: a bridge in a network namespace of its own.

::

    sudo python3 tools/guest/bridge.py up 2        # namespace, bridge, taps tap0 and tap1
    sudo python3 tools/guest/bridge.py exec ss -tn # a host command inside it
    sudo python3 tools/guest/bridge.py down

The namespace (``guestbed.NETNS``) holds the bridge ``br0`` with the host's
address ``10.77.0.1/24`` and one tap per guest; ``boot.py --netns NS --net
tap:tapN --ip 10.77.0.1N/24`` attaches a guest. Host programs that talk to the
guests run inside the namespace (``exec``, or ``ip netns exec``). Nothing in it
is routed anywhere else. ``up`` is idempotent and adds missing taps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import guestbed


def ip(*args: str, netns: str | None = None, check: bool = True) -> bool:
    """Run ``ip ARGS`` (inside ``netns``); whether it succeeded."""
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise SystemExit(f"netns: {' '.join(cmd)}: {done.stderr.strip()}")
    return done.returncode == 0


def exists(netns: str) -> bool:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return netns in (line.split()[0] for line in listing.stdout.splitlines() if line.strip())


def up(netns: str, taps: int) -> None:
    if not exists(netns):
        ip("netns", "add", netns)
    ip("link", "set", "lo", "up", netns=netns)
    bridge = guestbed.BRIDGE
    if not ip("link", "show", bridge, netns=netns, check=False):
        # No STP and no forwarding delay: a tap forwards the moment it is up.
        ip("link", "add", bridge, "type", "bridge", "stp_state", "0", "forward_delay", "0",
           netns=netns)  # fmt: skip
    ip("addr", "replace", f"{guestbed.BRIDGE_IP}/{guestbed.PREFIX}", "dev", bridge, netns=netns)
    ip("link", "set", bridge, "up", netns=netns)
    for index in range(taps):
        tap = guestbed.TAP.format(index)
        if not ip("link", "show", tap, netns=netns, check=False):
            ip("tuntap", "add", "dev", tap, "mode", "tap", netns=netns)
        ip("link", "set", tap, "master", bridge, "up", netns=netns)


def down(netns: str) -> None:
    if exists(netns):
        ip("netns", "delete", netns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", default=guestbed.NETNS, help="namespace name")
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("up", help="create (or complete) the namespace")
    make.add_argument("taps", type=int, nargs="?", default=2, help="number of taps (default 2)")
    sub.add_parser("down", help="delete the namespace and its taps")
    run = sub.add_parser("exec", help="run a command inside the namespace")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.action == "up":
        up(args.netns, args.taps)
    elif args.action == "down":
        down(args.netns)
    else:
        os.execvp("ip", ["ip", "netns", "exec", args.netns, *args.argv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
