"""Where the kernel guest test bed keeps its files, and its network plan.

Shared by ``build.py`` (makes the image), ``boot.py`` (runs a script in a guest),
``bridge.py`` (the host side of the guests' network) and ``tests/siwvm.py``.

Everything lives under one cache directory, ``$RDMASHIM_GUEST_CACHE`` or
``/var/tmp/rdmashim-guest``::

    debs/            the Debian packages apt-get downloaded (kernel, headers, source)
    kernel/KVER/     the unpacked kernel package (vmlinuz, modules)
    siw/KVER/        siw's sources and the out-of-tree build (siw.ko)
    rootfs/          the guest's root file system (debootstrap + apt)
    image/           what a boot needs: vmlinuz, initrd.gz, rootfs.ext4, manifest.json
    run/NAME/        one guest's share (``/host`` in the guest) and console.log
    pydeps/          Python wheels for the guest (tests/siwvm.py)
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "RDMASHIM_GUEST_CACHE"
DEFAULT_CACHE = Path("/var/tmp/rdmashim-guest")

IMAGE_FILES = ("vmlinuz", "initrd.gz", "rootfs.ext4")
"""The three files a boot needs, in ``image/``."""
MANIFEST = "manifest.json"
"""``image/manifest.json``: the kernel version, package list and input key of the image."""

NETNS = "rdmashim-bed"
"""The host network namespace that holds the bridge and the guests' taps."""
BRIDGE = "br0"
BRIDGE_IP = "10.77.0.1"
PREFIX = 24
TAP = "tap{}"
"""Tap device names, by index (``tap0``, ``tap1``, ...)."""

NO_SCRIPT, TIMED_OUT = 125, 124
"""``boot.py``'s exit status when the guest never ran its script / when it ran out of time."""

INIT_PARAM = "rdmashim"
"""Prefix of the kernel command line parameters the guest's init reads (``rdmashim.ip=``)."""
SHARE_TAG = "host0"
SYNC_TAG = "sync0"


def cache_dir() -> Path:
    """The test bed's cache directory (``$RDMASHIM_GUEST_CACHE`` overrides the default)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def image_dir() -> Path:
    return cache_dir() / "image"


def run_dir(name: str) -> Path:
    """One guest's directory: ``share/`` (its ``/host``) and ``console.log``."""
    return cache_dir() / "run" / name


def missing_image() -> str | None:
    """Which image file is missing (with the command that makes it), or None."""
    for name in IMAGE_FILES:
        path = image_dir() / name
        if not path.is_file():
            here = Path(__file__).resolve().parent
            return f"{path} missing: run `python3 {here / 'build.py'}` as root"
    return None
