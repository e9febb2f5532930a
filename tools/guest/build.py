#!/usr/bin/env python3
"""Build the kernel guest image of rdmashim's test bed (run as root).

::

    sudo python3 tools/guest/build.py            # idempotent: with nothing new, seconds
    sudo python3 tools/guest/build.py --check    # and boot it once: siw, rdma_rxe, RDS, NFS modules
    sudo python3 tools/guest/build.py --kver 6.1.0-56-amd64

The guest is a Debian kernel with a minimal Debian root file system, booted by
QEMU (``boot.py``). Debian builds its kernels without siw (``CONFIG_RDMA_SIW``
is not set), so siw.ko is compiled here, out of tree, from the
``linux-source-X.Y`` package of exactly the kernel's version against that
kernel's ``linux-headers`` and ``linux-kbuild``. Every other module (ib_core,
iw_cm, rdma_cm, rdma_ucm, rdma_rxe, rds, rds_rdma, rds_tcp, rpcrdma, nfsd,
nfs) is Debian's. The root file system comes from debootstrap (minbase) with
rdma-core, perftest, the kernel NFS client and server, tcpdump, fio and python3
installed by apt inside it, from the mirrors the host's apt sources name.

Stages, each skipped when its result is there and its inputs are unchanged:
download the kernel packages; unpack the kernel; build siw.ko; debootstrap +
apt; copy the modules the guest needs (with their dependencies, from
``modprobe --show-depends``); install the guest's init; pack a busybox
initramfs and the ext4 image. ``image/manifest.json`` records the inputs; when
they match, nothing is rebuilt. Needs: debootstrap, apt-get, dpkg, gcc, make,
libelf-dev, bc, kmod, e2fsprogs (mkfs.ext4 -d). The cache is
``$RDMASHIM_GUEST_CACHE`` (default ``/var/tmp/rdmashim-guest``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import guestbed

HERE = Path(__file__).resolve().parent
SUITE_ENV = "RDMASHIM_GUEST_SUITE"
PACKAGES = [
    "kmod", "iproute2", "iputils-ping", "procps", "psmisc", "busybox-static",
    "rdma-core", "ibverbs-providers", "ibverbs-utils", "rdmacm-utils", "perftest",
    "libibverbs-dev", "librdmacm-dev",  # the unversioned .so names cffi opens
    "python3", "python3-cffi", "tcpdump", "fio",
    "nfs-kernel-server", "nfs-common",
]  # fmt: skip
"""Installed into the root file system with apt (``--no-install-recommends``)."""
MODULES = [
    "virtio_pci", "virtio_blk", "virtio_net", "virtio_rng", "9p", "9pnet_virtio",
    "ext4", "crc32c_generic", "libcrc32c", "crc32_generic", "crc32_pclmul",  # rxe: crc32
    "af_packet", "tun", "veth", "bridge",
    "ib_core", "ib_uverbs", "ib_umad", "iw_cm", "ib_cm", "rdma_cm", "rdma_ucm", "rdma_rxe",
    "rds", "rds_rdma", "rds_tcp", "rpcrdma", "sunrpc", "auth_rpcgss", "lockd",
    "nfsd", "nfs", "nfsv3", "nfsv4",
]  # fmt: skip
"""Modules copied into the guest, with everything ``modprobe --show-depends`` adds (siw too)."""
INITRAMFS_MODULES = ["virtio_pci", "virtio_blk", "crc32c_generic", "ext4"]
"""What the initramfs loads to mount the root disk."""
IMAGE_SLACK_MB = 768
"""Free space in rootfs.ext4 beyond the files (the disk is a snapshot: nothing is kept)."""
EXCLUDES = ["/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*"]


def log(message: str) -> None:
    print(f"guest-build: {message}", flush=True)


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure, raise with the tail of its output."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise SystemExit(
            f"guest-build: {' '.join(argv[:6])} ... failed ({done.returncode}):\n{tail}"
        )
    return done


# ---------------------------------------------------------------- apt and packages


def apt_field(package: str, field: str) -> str:
    """A field of the candidate version of ``package`` (``apt-cache show``)."""
    out = run(["apt-cache", "show", "--no-all-versions", package]).stdout
    m = re.search(rf"^{field}: (.*)$", out, re.MULTILINE)
    if not m:
        raise SystemExit(f"guest-build: apt-cache show {package} has no {field}")
    return m.group(1).strip()


def default_kernel() -> str:
    """The version ``linux-image-amd64`` depends on, e.g. ``6.1.0-56-amd64``."""
    depends = apt_field("linux-image-amd64", "Depends")
    m = re.search(r"linux-image-(\d[^\s,(]*)", depends)
    if not m:
        raise SystemExit(f"guest-build: cannot read a kernel from {depends!r}")
    return m.group(1)


def download(cache: Path, package: str, version: str | None = None) -> Path:
    """``apt-get download`` into ``debs/`` unless there already; the .deb's path."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    quoted = version.replace(":", "%3a") if version else "*"
    found = sorted(debs.glob(f"{package}_{quoted}_*.deb"))
    if found:
        return found[-1]
    spec = f"{package}={version}" if version else package
    log(f"apt-get download {spec}")
    run(["apt-get", "download", "-o", "APT::Sandbox::User=root", spec], cwd=debs)
    found = sorted(debs.glob(f"{package}_{quoted}_*.deb"))
    if not found:
        raise SystemExit(f"guest-build: apt-get download {spec} left no .deb in {debs}")
    return found[-1]


def unpack(deb: Path, dest: Path) -> None:
    run(["dpkg-deb", "-x", str(deb), str(dest)])


APT_ETC = Path("/etc/apt")


def sources(etc: Path = APT_ETC) -> list[tuple[str, list[str], list[str]]]:
    """The host's apt sources: (URI, suites, components) of every ``deb`` entry, from
    ``sources.list.d/*.sources`` (deb822) and ``sources.list`` / ``sources.list.d/*.list``."""
    entries: list[tuple[str, list[str], list[str]]] = []
    for path in sorted((etc / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.strip().startswith("#") or ":" not in line:
                    continue
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                for uri in fields.get("uris", "").split():
                    entries.append(
                        (
                            uri,
                            fields.get("suites", "").split(),
                            fields.get("components", "").split(),
                        )
                    )
    listed = [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*.list"))]
    for path in listed:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
            if len(words) >= 4 and words[0] == "deb":
                entries.append((words[1], [words[2]], words[3:]))
    return entries


def mirror(suite: str) -> str:
    """The host's mirror of ``suite`` itself (not -updates or -security)."""
    for uri, suites, _ in sources():
        if suite in suites:
            return uri
    raise SystemExit(f"guest-build: no apt source for {suite!r} in /etc/apt (sources.list[.d])")


def host_suite() -> str:
    """The host's Debian release name (``VERSION_CODENAME``)."""
    text = Path("/etc/os-release").read_text()
    m = re.search(r"^VERSION_CODENAME=(\S+)", text, re.MULTILINE)
    if not m:
        raise SystemExit("guest-build: no VERSION_CODENAME in /etc/os-release")
    return m.group(1).strip('"')


def guest_sources(suite: str) -> str:
    """A sources.list for the guest: the host's entries for ``suite`` and its -updates/-security."""
    lines = []
    for uri, suites, components in sources():
        mine = [s for s in suites if s == suite or s.startswith(f"{suite}-")]
        for s in mine:
            lines.append(f"deb {uri} {s} {' '.join(components)}")
    return "\n".join(dict.fromkeys(lines)) + "\n"


# ---------------------------------------------------------------- stages


def stage_kernel(cache: Path, kver: str) -> tuple[Path, str]:
    """Unpack ``linux-image-KVER``; (its root, the package version)."""
    version = apt_field(f"linux-image-{kver}", "Version")
    root = cache / "kernel" / kver
    if not (root / ".done").is_file():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        unpack(download(cache, f"linux-image-{kver}", version), root)
        run(["depmod", "-b", str(root), kver])
        (root / ".done").write_text(version + "\n")
    return root, version


def stage_siw(cache: Path, kver: str, version: str) -> Path:
    """siw.ko, built out of tree from ``linux-source-X.Y`` of ``version``."""
    build = cache / "siw" / kver
    ko = build / "src" / "siw.ko"
    if ko.is_file() and (build / ".done").is_file():
        return ko
    series = re.match(r"\d+\.\d+", kver)
    if series is None:
        raise SystemExit(f"guest-build: cannot read X.Y from {kver}")
    major = series.group(0)
    shutil.rmtree(build, ignore_errors=True)
    headers = build / "headers"
    headers.mkdir(parents=True)
    # linux-headers-KVER's Depends name its -common package and linux-kbuild.
    needed = [f"linux-headers-{kver}"]
    needed += re.findall(r"(linux-(?:headers-[^\s,(]*-common[^\s,(]*|kbuild-[\d.]+))",
                         apt_field(f"linux-headers-{kver}", "Depends"))  # fmt: skip
    for package in dict.fromkeys(needed):
        pinned = version if package.startswith("linux-headers") else None
        unpack(download(cache, package, pinned), headers)
    source_deb = download(cache, f"linux-source-{major}", version)
    log(f"siw sources from {source_deb.name}")
    unpacked = build / "source-deb"
    unpack(source_deb, unpacked)
    tarballs = sorted((unpacked / "usr" / "src").glob(f"linux-source-{major}.tar.*"))
    if not tarballs:
        raise SystemExit(f"guest-build: no kernel tarball in {source_deb.name}")
    src = build / "src"
    src.mkdir()
    member = f"linux-source-{major}/drivers/infiniband/sw/siw"
    run(["tar", "-xf", str(tarballs[0]), "-C", str(src), "--strip-components=5", member])
    shutil.rmtree(unpacked)  # the tarball is ~140 MB; siw's files are all we keep
    kbuild = headers / "usr" / "src" / f"linux-headers-{kver}"
    makefile = kbuild / "Makefile"
    # The flavour's Makefile includes the -common tree by absolute path: point it here.
    text = makefile.read_text()
    makefile.write_text(re.sub(r"(?m)^include /usr/src/", f"include {headers}/usr/src/", text))
    log(f"make siw.ko against {kbuild.name}")
    run(["make", "-C", str(kbuild), f"M={src}", "CONFIG_RDMA_SIW=m", f"-j{os.cpu_count() or 1}",
         "modules"])  # fmt: skip
    if not ko.is_file():
        raise SystemExit("guest-build: make finished but siw.ko is missing")
    vermagic = run(["modinfo", "-F", "vermagic", str(ko)]).stdout.split()[0]
    if vermagic != kver:
        raise SystemExit(f"guest-build: siw.ko's vermagic {vermagic} is not {kver}")
    (build / ".done").write_text(version + "\n")
    return ko


def chroot(root: Path, *argv: str) -> None:
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "DEBIAN_FRONTEND": "noninteractive",
        "LC_ALL": "C",
    }
    run(["chroot", str(root), *argv], env=env)


def stage_rootfs(cache: Path, suite: str) -> Path:
    """debootstrap minbase, then :data:`PACKAGES` with apt inside (re-run when the list changes)."""
    root = cache / "rootfs"
    stamp = root / ".rdmashim-packages"
    wanted = " ".join(PACKAGES) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted:
        return root
    if not stamp.is_file():
        shutil.rmtree(root, ignore_errors=True)
        source = mirror(suite)
        log(f"debootstrap --variant=minbase {suite} from {source}")
        run(["debootstrap", "--variant=minbase", suite, str(root), source])
        (root / "etc" / "apt" / "sources.list").write_text(guest_sources(suite))
        (root / "etc" / "dpkg" / "dpkg.cfg.d" / "rdmashim-nodoc").write_text(
            "".join(f"path-exclude {p}\n" for p in EXCLUDES)
        )
        # No daemon may start inside the chroot while packages install.
        policy = root / "usr" / "sbin" / "policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    log(f"apt-get install in the guest's root: {len(PACKAGES)} packages")
    proc = root / "proc"
    run(["mount", "-t", "proc", "proc", str(proc)])
    try:
        chroot(root, "apt-get", "update", "-qq")
        chroot(root, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES)
        chroot(root, "apt-get", "clean")
    finally:
        subprocess.run(["umount", str(proc)], check=False)
    shutil.rmtree(root / "var" / "lib" / "apt" / "lists", ignore_errors=True)
    (root / "var" / "lib" / "apt" / "lists" / "partial").mkdir(parents=True)
    stamp.write_text(wanted)
    return root


def module_files(kernel: Path, kver: str, names: list[str]) -> list[Path]:
    """The .ko files of ``names`` and their dependencies, in load order (builtins left out)."""
    files: list[Path] = []
    for name in names:
        out = subprocess.run(
            ["modprobe", "-d", str(kernel), "-S", kver, "--show-depends", name],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(f"guest-build: module {name} not in {kver}: {out.stderr.strip()}")
        for line in out.stdout.splitlines():
            words = line.split()
            if words and words[0] == "insmod":
                files.append(Path(words[1]))
    return list(dict.fromkeys(files))


def stage_modules(root: Path, kernel: Path, kver: str, siw_ko: Path) -> list[str]:
    """Copy :data:`MODULES` (and deps) and siw.ko into the root file system; their names."""
    tree = kernel / "lib" / "modules" / kver
    dest = root / "lib" / "modules" / kver
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for extra in ("modules.order", "modules.builtin", "modules.builtin.modinfo"):
        if (tree / extra).is_file():
            shutil.copy2(tree / extra, dest / extra)
    copied = []
    for ko in module_files(kernel, kver, MODULES):
        target = dest / ko.relative_to(tree)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ko, target)
        copied.append(ko.name)
    (dest / "extra").mkdir()
    shutil.copy2(siw_ko, dest / "extra" / "siw.ko")
    run(["depmod", "-b", str(root), kver])
    # siw's dependencies must be in the guest: modprobe resolves them from what was copied.
    run(["modprobe", "-d", str(root), "-S", kver, "--show-depends", "siw"])
    return sorted([*copied, "siw.ko"])


def stage_files(root: Path) -> None:
    """The guest's init, host name, NFS export and mount points."""
    init = root / "sbin" / "rdmashim-init"
    shutil.copyfile(HERE / "init.sh", init)
    init.chmod(0o755)
    (root / "etc" / "hostname").write_text("rdmashim-guest\n")
    for folder in ("host", "sync", "export", "mnt/nfs"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "export" / "hello.txt").write_text("rdmashim guest NFS export\n")
    (root / "etc" / "exports").write_text(
        "/export *(rw,no_root_squash,insecure,no_subtree_check,fsid=0)\n"
    )


CONSOLE = ("dev/console", 0o020600, b"", (5, 1))
"""The character device the kernel opens as the initramfs init's stdin/stdout."""


def cpio_newc(
    entries: list[tuple[str, int, bytes] | tuple[str, int, bytes, tuple[int, int]]],
) -> bytes:
    """A cpio archive in the kernel's initramfs format ("newc"): (name, mode, data[, rdev])."""
    out = bytearray()

    def add(name: str, mode: int, data: bytes, ino: int, rdev: tuple[int, int]) -> None:
        encoded = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(encoded), 0]
        out.extend(b"070701" + b"".join(b"%08X" % f for f in fields) + encoded)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data, *rdev) in enumerate(entries, start=1):
        add(name, mode, data, ino, rdev[0] if rdev else (0, 0))
    add("TRAILER!!!", 0, b"", 0, (0, 0))
    return bytes(out)


def stage_initramfs(root: Path, kernel: Path, kver: str, dest: Path) -> None:
    """busybox (the guest's busybox-static), the disk modules and ``initramfs-init.sh``."""
    directory, regular, link = 0o040755, 0o100755, 0o120777
    entries: list = [(d, directory, b"") for d in ("bin", "dev", "proc", "sys", "root", "modules")]
    entries.append(CONSOLE)
    entries.append(("bin/busybox", regular, (root / "bin" / "busybox").read_bytes()))
    for applet in ("sh", "mount", "umount", "insmod", "sleep", "switch_root"):
        entries.append((f"bin/{applet}", link, b"busybox"))
    modules = module_files(kernel, kver, INITRAMFS_MODULES)
    for ko in modules:
        entries.append((f"modules/{ko.name}", 0o100644, ko.read_bytes()))
    order = "".join(f"{ko.name}\n" for ko in modules).encode()
    entries.append(("modules.list", 0o100644, order))
    entries.append(("init", regular, (HERE / "initramfs-init.sh").read_bytes()))
    dest.write_bytes(gzip.compress(cpio_newc(entries), compresslevel=6, mtime=0))


def used_mb(root: Path) -> int:
    out = run(["du", "-sm", "--apparent-size", str(root)]).stdout
    return int(out.split()[0])


def stage_image(root: Path, dest: Path) -> None:
    size = used_mb(root) + IMAGE_SLACK_MB
    tmp = dest.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    run(["mkfs.ext4", "-q", "-F", "-L", "rdmashim", "-d", str(root), str(tmp), f"{size}M"])
    tmp.rename(dest)


def inputs_key(*parts: object) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
    return digest.hexdigest()[:16]


def build(kver: str | None, suite: str) -> dict[str, object]:
    cache = guestbed.cache_dir()
    image = guestbed.image_dir()
    image.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    kver = kver or default_kernel()
    log(f"kernel {kver}, suite {suite}, cache {cache}")
    kernel, version = stage_kernel(cache, kver)
    siw_ko = stage_siw(cache, kver, version)
    root = stage_rootfs(cache, suite)
    key = inputs_key(
        kver, version, siw_ko.read_bytes(), PACKAGES, MODULES, INITRAMFS_MODULES,
        (HERE / "init.sh").read_bytes(), (HERE / "initramfs-init.sh").read_bytes(),
        Path(__file__).read_bytes(),
    )  # fmt: skip
    manifest_path = image / guestbed.MANIFEST
    if manifest_path.is_file() and guestbed.missing_image() is None:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") == key:
            log(f"image up to date ({time.monotonic() - start:.1f} s)")
            return manifest
    manifest_path.unlink(missing_ok=True)
    modules = stage_modules(root, kernel, kver, siw_ko)
    stage_files(root)
    shutil.copyfile(kernel / "boot" / f"vmlinuz-{kver}", image / "vmlinuz")
    stage_initramfs(root, kernel, kver, image / "initrd.gz")
    log("mkfs.ext4 -d rootfs")
    stage_image(root, image / "rootfs.ext4")
    manifest = {
        "key": key,
        "kernel": kver,
        "kernel_package_version": version,
        "suite": suite,
        "packages": PACKAGES,
        "modules": modules,
        "sizes_mb": {
            name: round((image / name).stat().st_blocks * 512 / 2**20, 1)
            for name in guestbed.IMAGE_FILES
        },
        "rootfs_mb": used_mb(root),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"image built in {time.monotonic() - start:.1f} s: {manifest['sizes_mb']} (MB on disk)")
    return manifest


CHECK_SCRIPT = r"""
set -e
for m in siw rdma_rxe rds rds_rdma rds_tcp rpcrdma nfsd nfs rdma_ucm; do modprobe $m; done
rdma link add siw0 type siw netdev eth0
ibv_devices
python3 -c "import cffi, platform; print(platform.python_version(), cffi.__version__)"
for t in rping ib_write_bw ib_send_bw ib_read_bw tcpdump fio rpc.nfsd mount.nfs exportfs; do
    command -v $t >/dev/null || { echo "missing $t"; exit 1; }
done
echo "guest check ok: $(uname -r)"
"""


def check() -> int:
    """Boot the image once and load every module the tests use."""
    boot = [sys.executable, str(HERE / "boot.py"), "--name", "build-check", "--timeout", "180",
            "-c", CHECK_SCRIPT]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(boot, check=False)
    log(f"check boot: exit {done.returncode} in {time.monotonic() - start:.1f} s")
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kver", help="kernel ABI version (default: linux-image-amd64's)")
    parser.add_argument(
        "--suite", default=os.environ.get(SUITE_ENV), help="Debian suite (default: the host's)"
    )
    parser.add_argument("--check", action="store_true", help="boot the image once afterwards")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("guest-build: run as root (debootstrap, chroot, mount)", file=sys.stderr)
        return 2
    for tool in ("debootstrap", "apt-get", "dpkg-deb", "make", "gcc", "modprobe", "mkfs.ext4"):
        if shutil.which(tool) is None:
            print(f"guest-build: {tool} not found (see the README's test levels)", file=sys.stderr)
            return 2
    build(args.kver, args.suite or host_suite())
    return check() if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
