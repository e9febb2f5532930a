"""``rdmashim nfs ls|stat|get|put|mkdir|rm``: an NFSv3 export from the command line.

Each command names a remote path as ``SERVER:/export/path``: MOUNT's EXPORT
list says which exports the server has, and the longest one that is a prefix
of the path (component by component) is mounted; the rest is the path inside
it. The client is :class:`rdmashim.ulps.nfsrdma.client.NfsClient`, over
RPC-over-RDMA by default (``--proto tcp`` for TCP). ``get`` and ``put`` show
a progress bar (rate, ETA) on stderr when it is a terminal, and end with a
summary line (on stderr when ``get`` writes the file to stdout, ``-``).
``mkdir -p`` makes the missing parents and accepts a directory that exists;
``rm -r`` removes a directory and everything under it, depth first. Every NFS
failure is one line naming its status, exit 1.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rdmashim.cliargs import Parser, UsageError, backend, host, port, rate
from rdmashim.ulps.nfsrdma.nfs3_types import FType3, Nfsstat3

if TYPE_CHECKING:
    from rdmashim.ulps.nfsrdma.client import NfsClient, Progress
    from rdmashim.ulps.nfsrdma.nfs3_types import Fattr3

REMOTE_HELP = (
    "SERVER:/export/path; the export is the longest one the server lists (MOUNT EXPORT) "
    "that is a prefix of the path, the rest is the path inside it"
)


@dataclass(frozen=True)
class Remote:
    """A ``SERVER:/export/path`` argument: the server's address and the whole path."""

    text: str
    server: str
    path: str


def remote(text: str) -> Remote:
    """An argparse type: ``SERVER:/export/path`` (the server resolved to an address)."""
    server, sep, rest = text.partition(":/")
    if not sep or not server:
        raise argparse.ArgumentTypeError(f"{text!r} is not SERVER:/export/path")
    return Remote(text, host(server.strip("[]")), "/" + rest)


Action = Callable[["NfsClient", str, argparse.Namespace], Awaitable[None]]


def add_client(nsub: argparse._SubParsersAction[Parser]) -> None:
    """The client subcommands, on the subparsers ``nsub`` of ``rdmashim nfs``."""
    commands: list[tuple[str, str, Action]] = [
        ("ls", "list a directory (or show one file)", _ls),
        ("stat", "show the attributes of a path", _stat),
        ("get", "copy a remote file to a local path", _get),
        ("put", "copy a local file to a remote path", _put),
        ("mkdir", "make a directory", _mkdir),
        ("rm", "remove a file or an empty directory (-r: a whole tree)", _rm),
    ]
    for name, what, action in commands:
        p = nsub.add_parser(name, help=f"NFS client: {what}", description=f"{what[0].upper()}"
                            f"{what[1:]} on an NFSv3 server. REMOTE is {REMOTE_HELP}.")  # fmt: skip
        if name == "put":
            p.add_argument("src", type=Path, help="the local file")
        p.add_argument("remote", type=remote, metavar="REMOTE", help=REMOTE_HELP)
        if name == "get":
            p.add_argument("dest", type=Path,
                           help="the local file (or directory) to write; - for stdout")  # fmt: skip
        if name in ("get", "put"):
            p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        if name == "mkdir":
            p.add_argument("--mode", type=lambda s: int(s, 8), default=0o755, help="octal mode")
            p.add_argument("-p", "--parents", action="store_true",
                           help="make missing parents; an existing dir is no error")  # fmt: skip
        if name == "rm":
            p.add_argument("-r", "--recursive", action="store_true",
                           help="remove a directory and everything under it")  # fmt: skip
        p.add_argument("--proto", choices=("rdma", "tcp"), default="rdma", help="transport")
        p.add_argument("--port", type=port, default=None,
                       help="NFS port (default: rpcbind's, else 20049 rdma, 2049 tcp)")  # fmt: skip
        p.add_argument("--rpcbind-port", type=port, default=111, help="the server's rpcbind port")
        p.add_argument("--mount-port", type=port, default=None,
                       help="MOUNT port (default: from rpcbind)")  # fmt: skip
        p.add_argument("-b", "--backend", type=backend, default=None, help="RDMA backend")
        p.set_defaults(func=_run, action=action)


def _run(args: argparse.Namespace) -> int:
    import trio

    if args.action is _put:
        if not args.src.is_file():
            raise UsageError(f"{args.src}: not a file")
        args.size = args.src.stat().st_size
    if args.action is _get:
        args.to_stdout = str(args.dest) == "-"
        args.into_dir = not args.to_stdout and args.dest.is_dir()
        if not (args.to_stdout or args.into_dir or args.dest.parent.is_dir()):
            raise UsageError(f"{args.dest.parent}: no such directory")
    trio.run(_main, args)
    return 0


async def _main(args: argparse.Namespace) -> None:
    from rdmashim.ulps.nfsrdma.client import (
        NfsClient,
        NfsError,
        ServerUnreachable,
        list_exports,
        split_remote,
    )

    where: Remote = args.remote
    try:
        exports = await list_exports(
            where.server, rpcbind_port=args.rpcbind_port, mount_port=args.mount_port
        )
    except ServerUnreachable as exc:
        if exc.program != "rpcbind":
            raise
        raise ServerUnreachable(exc.program, exc.host, exc.port, exc.reason, NO_RPCBIND) from None
    export, inner = split_remote(exports, where.path)
    async with NfsClient.connect(
        where.server, export, proto=args.proto, port=args.port, rpcbind_port=args.rpcbind_port,
        mount_port=args.mount_port, backend=args.backend,
    ) as nfs:  # fmt: skip
        try:
            await args.action(nfs, inner, args)
        except NfsError as exc:  # name the path as the user did; say which option helps
            server = where.text.partition(":/")[0]
            hint = exc.hint or COMMAND_HINTS.get((args.nfs_command, exc.status), "")
            raise NfsError(exc.status, f"{server}:{_join(export, exc.path)}", hint) from None


NO_RPCBIND = "no rpcbind there? then give --mount-port and --port"
COMMAND_HINTS: dict[tuple[str, int], str] = {
    ("mkdir", Nfsstat3.NFS3ERR_EXIST): "mkdir -p takes a directory that exists",
    ("rm", Nfsstat3.NFS3ERR_NOTEMPTY): "rm -r removes it and everything under it",
    ("put", Nfsstat3.NFS3ERR_NOENT): "put makes no directory: rdmashim nfs mkdir -p makes it",
    ("get", Nfsstat3.NFS3ERR_ISDIR): "get copies a file; rdmashim nfs ls lists a directory",
}
"""What to say with a status one of the commands met, when the status alone says too little."""


def _join(export: str, path: str) -> str:
    return export.rstrip("/") + "/" + path.lstrip("/") if path.strip("/") else export


_FORMAT_OF_TYPE = {FType3.REG: stat.S_IFREG, FType3.DIR: stat.S_IFDIR, FType3.BLK: stat.S_IFBLK,
                   FType3.CHR: stat.S_IFCHR, FType3.LNK: stat.S_IFLNK,
                   FType3.SOCK: stat.S_IFSOCK, FType3.FIFO: stat.S_IFIFO}  # fmt: skip
"""An ``ftype3`` -> the ``st_mode`` file type bits."""


def _line(name: str, a: Fattr3) -> str:
    mode = stat.filemode(_FORMAT_OF_TYPE[a.ftype] | a.mode)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(a.mtime[0]))
    return f"{mode} {a.nlink:>3} {a.uid:>6} {a.gid:>6} {a.size:>12} {when} {name}"


async def _ls(nfs: NfsClient, path: str, args: argparse.Namespace) -> None:
    attrs = await nfs.getattr(path)
    if attrs.ftype is not FType3.DIR:
        print(_line(path.rsplit("/", 1)[-1] or "/", attrs))
        return
    for name, entry in sorted(await nfs.listdir(path)):
        print(_line(name, entry))


async def _stat(nfs: NfsClient, path: str, args: argparse.Namespace) -> None:
    a = await nfs.getattr(path)
    print(f"  path: {args.remote.text}")
    print(f"  type: {stat.filemode(_FORMAT_OF_TYPE[a.ftype] | a.mode)} ({a.mode:o})")
    print(f"  size: {a.size}  used: {a.used}  links: {a.nlink}")
    print(f"   uid: {a.uid}  gid: {a.gid}  fileid: {a.fileid}  fsid: {a.fsid:#x}")
    for label, (sec, nsec) in (("atime", a.atime), ("mtime", a.mtime), ("ctime", a.ctime)):
        print(f"{label}: {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(sec))}.{nsec:09d}")


async def _mkdir(nfs: NfsClient, path: str, args: argparse.Namespace) -> None:
    from rdmashim.ulps.nfsrdma.client import NfsError
    from rdmashim.ulps.nfsrdma.nfs3_types import NFS3ERR_EXIST, NFS3ERR_NOTDIR

    if not args.parents:
        await nfs.mkdir(path, args.mode)
        return
    parts = [part for part in path.split("/") if part]
    for depth in range(1, len(parts) + 1):
        here = "/" + "/".join(parts[:depth])
        try:
            await nfs.mkdir(here, args.mode)
        except NfsError as exc:
            if exc.status != NFS3ERR_EXIST:
                raise
            if (await nfs.getattr(here)).ftype is not FType3.DIR:
                raise NfsError(NFS3ERR_NOTDIR, here) from None


async def _rm(nfs: NfsClient, path: str, args: argparse.Namespace) -> None:
    if (await nfs.getattr(path)).ftype is not FType3.DIR:
        await nfs.remove(path)
        return
    if args.recursive:
        for name, entry in await nfs.listdir(path):
            inner = path.rstrip("/") + "/" + name
            if entry.ftype is FType3.DIR:
                await _rm(nfs, inner, args)
            else:
                await nfs.remove(inner)
    await nfs.rmdir(path)


async def _get(nfs: NfsClient, path: str, args: argparse.Namespace) -> None:
    from rdmashim.ulps.nfsrdma.client import NfsError
    from rdmashim.ulps.nfsrdma.nfs3_types import NFS3ERR_ISDIR

    attrs = await nfs.getattr(path)
    if attrs.ftype is FType3.DIR:
        raise NfsError(NFS3ERR_ISDIR, path)
    start = time.monotonic()
    if args.to_stdout:
        with _bar(args, f"get {path.rsplit('/', 1)[-1]}", attrs.size) as progress:
            count = await nfs.read_file(path, sys.stdout.buffer, progress)
        sys.stdout.buffer.flush()
        _summary("got", count, args.remote.text, "stdout", start, sys.stderr)
        return
    dest: Path = args.dest
    if args.into_dir:
        dest = dest / path.rsplit("/", 1)[-1]
    with dest.open("wb") as sink, _bar(args, f"get {dest.name}", attrs.size) as progress:
        count = await nfs.read_file(path, sink, progress)
    _summary("got", count, args.remote.text, str(dest), start)


async def _put(nfs: NfsClient, path: str, args: argparse.Namespace) -> None:
    from rdmashim.ulps.nfsrdma.client import NfsError

    src: Path = args.src
    try:
        if (await nfs.getattr(path)).ftype is FType3.DIR:
            path = path.rstrip("/") + "/" + src.name
    except NfsError:
        pass  # a new file: its directory must exist, which CREATE tells
    start = time.monotonic()
    with src.open("rb") as source, _bar(args, f"put {src.name}", args.size) as progress:
        count = await nfs.write_file(path, source, args.size, progress)
    _summary("put", count, str(src), args.remote.text, start)


def _summary(
    verb: str, count: int, src: str, dest: str, start: float, out: TextIO = sys.stdout
) -> None:
    seconds = time.monotonic() - start
    speed = rate(count, seconds)
    per_second = f", {speed / 1e6:.1f} MB/s" if speed is not None else ""
    print(f"{verb} {count} bytes: {src} -> {dest} in {seconds:.2f} s{per_second}", file=out)


@contextmanager
def _bar(args: argparse.Namespace, label: str, total: int) -> Iterator[Progress | None]:
    """A tqdm progress bar on stderr (none with --quiet or when stderr is no terminal).

    A terminal that reports no size (a bare pty) gets an 80x24 one rather than
    tqdm's empty bar.
    """
    if args.quiet or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm  # type: ignore[import-untyped]

    size = os.get_terminal_size(sys.stderr.fileno())
    shape = {} if size.columns and size.lines else {"ncols": 80, "nrows": 24}
    with tqdm(desc=label, total=total, unit="B", unit_scale=True, unit_divisor=1024,
              file=sys.stderr, **shape) as bar:  # fmt: skip

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield progress


__all__ = ["Remote", "add_client", "remote"]
