#!/usr/bin/env python3
"""What a zero-copy NFS READ would save the server on this machine, measured.

An NFS/RDMA server answers a 1 MiB READ with an RDMA Write: the file's bytes framed
as FPDUs (16 bytes in front: MPA's length and a tagged DDP header; up to 65,516
bytes of payload; 4 behind: the CRC field). Today the server reads the bytes into a
buffer (``pread``: a copy out of the page cache) and the engine writes header,
payload and trailer with one ``sendmsg`` (a copy into the socket). A zero-copy READ
would hand the socket the page cache's pages instead. This script sends the same
MiBs of a cached file over loopback TCP to a receiver process three ways:

- ``copy``: ``preadv`` into a buffer, then ``sendmsg`` of every FPDU's three parts
  (today's copies);
- ``sendfile``: per FPDU, the header with ``MSG_MORE``, the payload by
  ``os.sendfile`` from the file, the trailer with ``MSG_MORE`` (no copy in user
  space; possible only with MPA's CRC off, since the CRC reads every byte);
- ``splice``: the headers written into a pipe and the payload spliced into it from
  the file, the pipe spliced into the socket about every half MiB.

and prints, per method, the sender's CPU per MiB (user and system, from
``getrusage``; on loopback the system time includes the receiving TCP's work up to
the receiver's socket) and the MiB/s, medians of ``--repeat`` rounds run
alternated. ``--check`` makes the receiver parse the FPDUs and compare every
payload with the file (slower: for tests, not figures).

Usage::

    python benchmarks/zero_copy.py [--mib 1024] [--repeat 3] [--check]
"""

from __future__ import annotations

import argparse
import fcntl
import os
import resource
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable

MIB = 1 << 20
FILE_MIB = 64
"""The file's size: small enough to stay in the page cache, read round and round."""
HEADER = 16
TRAILER = 4
PAYLOAD = (65536 - HEADER - TRAILER) & ~3
"""An FPDU's payload at most, as the engine sends them (``ddp.max_payload``)."""
METHODS = ("copy", "sendfile", "splice")

Sender = Callable[[socket.socket, int, int], None]


def _chunks(offset: int) -> list[tuple[bytes, int, int]]:
    """The FPDUs of the MiB at ``offset``: (header, file offset, payload length)."""
    out = []
    for at in range(0, MIB, PAYLOAD):
        length = min(PAYLOAD, MIB - at)
        out.append((struct.pack(">HH12x", HEADER - 2 + length, at // PAYLOAD), offset + at, length))
    return out


def _send_all(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    while parts:
        n = sock.sendmsg(parts)
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if n:
            parts[0] = memoryview(parts[0])[n:]


def copy_sender(fd: int) -> Sender:
    view = memoryview(bytearray(MIB))
    trailer = bytes(TRAILER)

    def send(sock: socket.socket, offset: int, _: int) -> None:
        os.preadv(fd, [view], offset)
        parts: list[bytes | memoryview] = []
        for header, at, length in _chunks(offset):
            start = at - offset
            parts += [header, view[start : start + length], trailer]
        _send_all(sock, parts)

    return send


def sendfile_sender(fd: int) -> Sender:
    trailer = bytes(TRAILER)

    def send(sock: socket.socket, offset: int, out: int) -> None:
        for header, at, length in _chunks(offset):
            sock.send(header, socket.MSG_MORE)
            while length:
                n = os.sendfile(out, fd, at, length)
                at, length = at + n, length - n
            sock.send(trailer, socket.MSG_MORE)

    return send


def splice_sender(fd: int) -> Sender:
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, MIB)
    trailer = bytes(TRAILER)

    def drain(out: int, held: int) -> None:
        while held:
            held -= os.splice(read_end, out, held)

    def send(sock: socket.socket, offset: int, out: int) -> None:
        held = 0
        for header, at, length in _chunks(offset):
            held += os.write(write_end, header)
            while length:
                n = os.splice(fd, write_end, length, offset_src=at)
                at, length, held = at + n, length - n, held + n
            held += os.write(write_end, trailer)
            if held > MIB // 2:
                drain(out, held)
                held = 0
        drain(out, held)

    return send


def receive(sock: socket.socket, fd: int | None) -> int:
    """Read until EOF; with ``fd``, parse the FPDUs and hold each payload to the file."""
    if fd is None:
        view = memoryview(bytearray(256 * 1024))
        total = 0
        while n := sock.recv_into(view):
            total += n
        return total
    stream = sock.makefile("rb")
    total = 0
    offset = 0
    while header := stream.read(HEADER):
        ulpdu, index = struct.unpack_from(">HH", header)
        payload = stream.read(ulpdu + 2 - HEADER)
        trailer = stream.read(TRAILER)
        at = offset + index * PAYLOAD
        if payload != os.pread(fd, len(payload), at) or trailer != bytes(TRAILER):
            print(f"FPDU {index} of the MiB at {offset}: wrong bytes", file=sys.stderr)
            return -1
        total += HEADER + len(payload) + TRAILER
        if at + len(payload) == offset + MIB:
            offset = (offset + MIB) % (FILE_MIB * MIB)
    return total


def run(method: str, path: str, mib: int, check: bool) -> tuple[float, float]:
    """Send ``mib`` MiB by ``method`` to a receiver process: (sender CPU s a MiB, MiB/s)."""
    fd = os.open(path, os.O_RDONLY)
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    pid = os.fork()
    if pid == 0:  # the receiver: its exit status says whether every byte came right
        code = 1
        try:
            listener.close()
            conn = socket.create_connection(address)
            got = receive(conn, fd if check else None)
            code = 0 if got == mib * (MIB + len(_chunks(0)) * (HEADER + TRAILER)) else 1
        finally:
            os._exit(code)
    sock, _ = listener.accept()
    listener.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send = {"copy": copy_sender, "sendfile": sendfile_sender, "splice": splice_sender}[method](fd)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        for i in range(mib):
            send(sock, (i % FILE_MIB) * MIB, sock.fileno())
    except (BrokenPipeError, ConnectionResetError):
        pass  # (the receiver stopped at a wrong byte: its exit status says so)
    elapsed, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    sock.close()
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{method}: the receiver did not get every byte framed as sent")
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return cpu / mib, mib / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB sent by each method a round")
    parser.add_argument("--repeat", type=int, default=3, help="rounds, methods alternated")
    parser.add_argument("--check", action="store_true", help="the receiver checks every byte")
    args = parser.parse_args()
    if args.mib < 1 or args.repeat < 1:
        parser.error("--mib and --repeat must be at least 1")
    with tempfile.NamedTemporaryFile(prefix="zero-copy-") as f:
        f.write(os.urandom(FILE_MIB * MIB))
        f.flush()
        with open(f.name, "rb") as cached:  # (into the page cache before any round)
            while cached.read(MIB):
                pass
        samples: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
        for _ in range(args.repeat):
            for method in METHODS:
                samples[method].append(run(method, f.name, args.mib, args.check))
    print(f"{args.mib} MiB a method a round, {args.repeat} rounds alternated; medians")
    print(f"{'method':<10} {'sender CPU us/MiB':>18} {'MiB/s':>8} {'CPU vs copy':>12}")
    base = statistics.median(cpu for cpu, _ in samples["copy"])
    for method in METHODS:
        cpu = statistics.median(c for c, _ in samples[method])
        rate = statistics.median(r for _, r in samples[method])
        print(f"{method:<10} {cpu * 1e6:>18.0f} {rate:>8.0f} {cpu / base:>12.3f}")


if __name__ == "__main__":
    main()
