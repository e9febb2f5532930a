"""Both sides of ``tests/test_rds_rdma_guest.py``: the kernel's RDS and our node, in guests.

::

    python3 tests/rds_rxe_agent.py kernel ROUND ME PEER      # plain python3, AF_RDS
    python3 tests/rds_rxe_agent.py ours ROUND ME PEER        # our RdsNode (rdmacore on rxe)

Each side binds its port (:data:`KERNEL_PORT` / :data:`OUR_PORT`), touches
``$JOB.ready`` and waits for the host's ``$JOB.go``; then both run ROUND and print
one JSON line with what they saw. ROUND is one of

* ``exchange-kernel-first`` / ``exchange-ours-first``: the first speaker sends
  :data:`N` messages of :data:`SIZES` (up to 1 MiB: 256 fragments), the other checks
  them and sends its own; each then pings the other's port 0 and waits for the pong.
  Who speaks first connects (the kernel's RDS connects from either address).
* ``reconnect-cut`` / ``reconnect-link``: both stream :data:`M` small messages at
  the same time; halfway our node moves its QP to the error state (``cut``), or the
  kernel side, once a quarter of ours has arrived, touches ``$JOB.link-down`` and
  the host takes guest K's bridge port down for longer than RC's retries last,
  while both go on sending (``link``; ours spreads its messages over the outage).
  Every message must arrive once, in order.
* ``congestion``: the kernel sends :data:`CONG_BURST` messages of 64 KiB to our
  socket, which reads none until it is congested (our map tells the kernel so)
  and the kernel's non-blocking ``sendto`` fails with ENOBUFS; then our socket reads
  everything and the kernel's sending resumes.
* ``rdma``: the kernel offers a region by ``RDS_GET_MR``; we RDMA-write into it and
  RDMA-read it back, each op chasing a message (:class:`RdmaOp`). Then we offer a
  region and the kernel writes into it and reads it back with ``RDS_CMSG_RDMA_ARGS``.

The kernel side imports nothing but the standard library (the guest's python3).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

KERNEL_PORT, OUR_PORT = 4000, 5000
SIZES = [0, 1, 47, 4095, 4096, 4097, 65536, 1 << 20]
N = 16
"""Messages each way in an exchange round (two of 1 MiB)."""
M = 300
"""Messages each way in a reconnect round."""
LINK_PACE = 0.1
"""Seconds between our messages in the ``link`` round: 30 s of them, past the outage."""
CONG_SIZE = 65536
CONG_BURST = 160
"""64 KiB messages the kernel sends at our unread socket: 10 MiB, past our 4 MiB rcvbuf
(its socket keeps the default send buffer, so it cannot queue them all at once)."""
BIG = 16 << 20
"""SO_SNDBUF / SO_RCVBUF the kernel socket forces (a 1 MiB message needs more than
the default's half of 208 KiB: ``rds_sk_sndbuf``)."""
WAIT = 240.0
PATTERN = bytes(range(256)) * 4100

SOL_RDS = 276
RDS_GET_MR = 2
RDS_FREE_MR = 3
RDS_CMSG_RDMA_ARGS = 1
RDS_CMSG_RDMA_DEST = 2
RDS_CMSG_RDMA_MAP = 3
RDS_CMSG_RDMA_STATUS = 4
RDS_RDMA_READWRITE = 0x0001
RDS_RDMA_NOTIFY_ME = 0x0020
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
RDMA_LEN = 256 * 1024


def body(tag: str, i: int, size: int | None = None) -> bytes:
    """Message ``i`` of side ``tag`` (its size from :data:`SIZES` unless given)."""
    n = SIZES[i % len(SIZES)] if size is None else size
    return (f"{tag}{i}:".encode() + PATTERN)[:n]


def wait_for(path: str) -> None:
    deadline = time.monotonic() + WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} from the host")
        time.sleep(0.05)


def wait_go(job: str) -> None:
    Path(job + ".ready").touch()
    wait_for(job + ".go")


def emit(**result: Any) -> None:
    print(json.dumps(result), flush=True)


def digest(messages: list[tuple[bytes, Any]]) -> list[list[Any]]:
    """What the host compares: each message's size and first 12 bytes, and its sender."""
    return [[len(d), d[:12].decode("latin-1"), list(a)] for d, a in messages]


# ---------------------------------------------------------------- the kernel's side


class Iovec(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class GetMrArgs(ctypes.Structure):
    """``struct rds_get_mr_args`` (include/uapi/linux/rds.h)."""

    _fields_ = [("vec", Iovec), ("cookie_addr", ctypes.c_uint64), ("flags", ctypes.c_uint64)]


class RdmaArgs(ctypes.Structure):
    """``struct rds_rdma_args``."""

    _fields_ = [
        ("cookie", ctypes.c_uint64),
        ("remote_vec", Iovec),
        ("local_vec_addr", ctypes.c_uint64),
        ("nr_local", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("user_token", ctypes.c_uint64),
    ]


def kernel_socket(me: str, big: bool = True) -> socket.socket:
    s = socket.socket(socket.AF_RDS, socket.SOCK_SEQPACKET, 0)
    if big:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, BIG)
        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, BIG)
    s.bind((me, KERNEL_PORT))
    return s


def kernel_recv(s: socket.socket, n: int) -> list[tuple[bytes, Any]]:
    s.settimeout(WAIT)
    return [s.recvfrom(1 << 21) for _ in range(n)]


def kernel_exchange(s: socket.socket, peer: str, first: bool) -> dict[str, Any]:
    dest = (peer, OUR_PORT)
    got: list[tuple[bytes, Any]] = []
    if not first:
        got = kernel_recv(s, N)
    for i in range(N):
        s.sendto(body("k", i), dest)
    if first:
        got = kernel_recv(s, N)
    ok = [(d, a) == (body("o", i), dest) for i, (d, a) in enumerate(got)]
    s.sendto(b"", (peer, 0))  # an RDS ping to our node
    pong = s.recvfrom(100)
    return {"got": digest(got), "got_ok": all(ok) and len(ok) == N, "pong": [pong[0].hex(),
            list(pong[1])]}  # fmt: skip


def kernel_reconnect(s: socket.socket, peer: str, job: str | None) -> dict[str, Any]:
    """Both ways at once; with ``job``, the host cuts the link halfway (see the module)."""
    dest = (peer, OUR_PORT)
    received: list[bytes] = []

    def reader() -> None:
        s.settimeout(WAIT)
        for _ in range(M):
            received.append(s.recvfrom(4096)[0])

    thread = threading.Thread(target=reader)
    thread.start()
    errors = 0
    for i in range(M):
        if job is not None and i == M // 2:
            # Once the connection is up and carries our node's messages (a cut
            # before its first session would be a peer never reached), ask for the
            # cut and go on: the rest waits in RDS's queue.
            deadline = time.monotonic() + WAIT
            while len(received) < M // 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            Path(job + ".link-down").touch()
        while True:
            try:
                s.sendto(body("k", i, 100), dest)
                break
            except OSError as exc:  # ENOBUFS while the send buffer is full
                errors += 1
                if exc.errno not in (errno.ENOBUFS, errno.EAGAIN):
                    raise
                time.sleep(0.01)
    thread.join(WAIT)
    want = [body("o", i, 100) for i in range(M)]
    return {"received": len(received), "in_order": received == want, "send_retries": errors,
            "dups": len(received) - len(set(received))}  # fmt: skip


def kernel_congestion(s: socket.socket, peer: str) -> dict[str, Any]:
    dest = (peer, OUR_PORT)
    s.setblocking(False)
    sent, enobufs, first_enobufs = 0, 0, None
    deadline = time.monotonic() + WAIT
    resumed_after = None
    while sent < CONG_BURST and time.monotonic() < deadline:
        try:
            s.sendto(body("c", sent, CONG_SIZE), dest)
            sent += 1
            if enobufs and resumed_after is None:
                resumed_after = sent
        except OSError as exc:
            if exc.errno not in (errno.ENOBUFS, errno.EAGAIN):
                raise
            if exc.errno == errno.ENOBUFS:
                enobufs += 1
                if first_enobufs is None:
                    first_enobufs = sent
                    print(f"ENOBUFS after {sent} messages", flush=True)
            time.sleep(0.02)
    return {"sent": sent, "enobufs": enobufs, "first_enobufs": first_enobufs,
            "resumed_after": resumed_after}  # fmt: skip


def cmsg_rdma_args(cookie: int, remote_addr: int, local: ctypes.Array[ctypes.c_char],
                   write: bool, token: int) -> tuple[bytes, Iovec]:  # fmt: skip
    vec = Iovec(ctypes.addressof(local), len(local))
    args = RdmaArgs(
        cookie, Iovec(remote_addr, len(local)), ctypes.addressof(vec), 1,
        (RDS_RDMA_READWRITE if write else 0) | RDS_RDMA_NOTIFY_ME, token,
    )  # fmt: skip
    return bytes(args), vec


def kernel_rdma(s: socket.socket, peer: str) -> dict[str, Any]:
    dest = (peer, OUR_PORT)
    s.settimeout(WAIT)
    result: dict[str, Any] = {}
    # 1. Our node RDMAs into and out of a kernel region. RDS_GET_MR (setsockopt) is
    # EOPNOTSUPP on a FRWR device such as rxe (ib_frmr.c rds_ib_reg_frmr: no connection,
    # "TODO: Add FRWR support for RDS_GET_MR using proxy qp"); RDS_CMSG_RDMA_MAP maps
    # on a message's connection, and the message carries RDS_EXTHDR_RDMA_DEST.
    # RDS_CMSG_RDMA_MAP needs the connection up (EINVAL while the kernel is still
    # reconnecting after an earlier round): our node's hello brings it up first.
    result["hello"] = s.recvfrom(100)[0].decode()
    region = ctypes.create_string_buffer(b"K" * RDMA_LEN, RDMA_LEN)
    cookie = ctypes.c_uint64(0)
    args = GetMrArgs(Iovec(ctypes.addressof(region), RDMA_LEN), ctypes.addressof(cookie), 0)
    try:
        s.setsockopt(SOL_RDS, RDS_GET_MR, bytes(args))
        result["get_mr"] = "ok"
    except OSError as exc:
        result["get_mr"] = errno.errorcode.get(exc.errno, str(exc.errno))
        s.sendmsg([b"map"], [(SOL_RDS, RDS_CMSG_RDMA_MAP, bytes(args))], 0, dest)
    result["kernel_cookie"] = cookie.value
    result["kernel_region_addr"] = ctypes.addressof(region)
    s.sendto(json.dumps({"cookie": cookie.value, "addr": ctypes.addressof(region)}).encode(), dest)
    chasers = [s.recvfrom(4096)[0] for _ in range(2)]  # the messages behind our Write, Read
    result["chasers"] = [c.decode() for c in chasers]
    data, _ = s.recvfrom(4096)  # then our node says how it went
    result["our_report"] = json.loads(data)
    result["region_written"] = region.raw[:RDMA_LEN] == body("w", 0, RDMA_LEN)
    # 2. The kernel RDMAs into a region of ours (its cookie arrives in a message).
    data, _ = s.recvfrom(4096)
    offer = json.loads(data)
    local = ctypes.create_string_buffer(body("x", 0, RDMA_LEN), RDMA_LEN)
    cmsg, vec = cmsg_rdma_args(offer["cookie"], offer["addr"], local, True, 7)
    try:
        s.sendmsg([b"rdma write done"], [(SOL_RDS, RDS_CMSG_RDMA_ARGS, cmsg)], 0, dest)
        result["kernel_write_sent"] = True
    except OSError as exc:
        result["kernel_write_sent"] = False
        result["kernel_write_error"] = f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc}"
    # Our verdict, and the RDMA status notification (a recvmsg with no data), either first.
    statuses: list[list[int]] = []
    while "our_verdict" not in result or (result["kernel_write_sent"] and not statuses):
        data, ancdata, _, _ = s.recvmsg(4096, 1024)
        statuses += rdma_statuses(ancdata)
        if data:
            result["our_verdict"] = json.loads(data)
    result["kernel_write_status"] = statuses  # [[user_token, RDS_RDMA_* status]]
    # 3. The kernel RDMA-reads our region (what it wrote there) into a fresh buffer.
    back = ctypes.create_string_buffer(RDMA_LEN)
    cmsg, back_vec = cmsg_rdma_args(offer["cookie"], offer["addr"], back, False, 8)
    s.sendmsg([b"rdma read done"], [(SOL_RDS, RDS_CMSG_RDMA_ARGS, cmsg)], 0, dest)
    read_statuses: list[list[int]] = []
    while not read_statuses:  # a notification: a recvmsg with no data
        read_statuses = rdma_statuses(s.recvmsg(4096, 1024)[1])
    result["kernel_read_status"] = read_statuses
    result["kernel_read_back_ok"] = back.raw[:RDMA_LEN] == local.raw[:RDMA_LEN]
    del vec, back_vec
    return result


def rdma_statuses(ancdata: list[tuple[int, int, bytes]]) -> list[list[int]]:
    """The RDMA status notifications (``RDS_CMSG_RDMA_STATUS``) in a recvmsg's
    ancillary data: [[user_token, RDS_RDMA_* status]]."""
    return [
        list(struct.unpack_from("=Qi", d)) for lvl, t, d in ancdata
        if lvl == SOL_RDS and t == RDS_CMSG_RDMA_STATUS
    ]  # fmt: skip


def kernel_main(round_: str, me: str, peer: str) -> None:
    job = os.environ["JOB"]
    s = kernel_socket(me, big=round_ != "congestion")
    wait_go(job)
    if round_.startswith("exchange"):
        result = kernel_exchange(s, peer, first=round_ == "exchange-kernel-first")
    elif round_.startswith("reconnect"):
        result = kernel_reconnect(s, peer, job if round_ == "reconnect-link" else None)
    elif round_ == "congestion":
        result = kernel_congestion(s, peer)
    elif round_ == "rdma":
        result = kernel_rdma(s, peer)
    else:
        raise SystemExit(f"unknown round {round_}")
    emit(side="kernel", round=round_, **result)
    s.close()


# ---------------------------------------------------------------- our side


async def ours_main(round_: str, me: str, peer: str) -> None:
    import trio

    from rdmashim.ulps.rds.node import RdsNode

    job = os.environ["JOB"]
    async with RdsNode(me) as node:
        sock = node.bind(OUR_PORT)
        await trio.to_thread.run_sync(wait_go, job)
        with trio.fail_after(WAIT):
            if round_.startswith("exchange"):
                result = await ours_exchange(sock, peer, round_ == "exchange-ours-first")
            elif round_.startswith("reconnect"):
                result = await ours_reconnect(node, sock, peer, round_)
            elif round_ == "congestion":
                result = await ours_congestion(node, sock, peer)
            elif round_ == "rdma":
                result = await ours_rdma(sock, peer)
            else:
                raise SystemExit(f"unknown round {round_}")
        (conn,) = node.connections()
        result["counters"] = {
            k: getattr(conn.counters, k)
            for k in ("sessions", "recv_messages", "send_messages", "retransmits",
                      "recv_drop_old_seq", "peer_restarts", "recv_seq_gaps",
                      "cong_updates_sent", "acks_sent", "rdma_failures", "rdma_dropped")
        }  # fmt: skip
        session = conn.session
        # The session's credits are its flow's (rdma_flow.RdmaFlow).
        flow = getattr(session, "flow", None)  # (RdmaFlow: its counters are its state's)
        result["flow_control"] = None if flow is None else bool(flow.state.flow_control)
        await trio.sleep(0.5)  # our last acks go before the node closes its connection
        emit(side="ours", round=round_, **result)


async def ours_exchange(sock: Any, peer: str, first: bool) -> dict[str, Any]:
    dest = (peer, KERNEL_PORT)
    got: list[tuple[bytes, Any]] = []
    if not first:
        got = [await sock.recvfrom() for _ in range(N)]
    for i in range(N):
        await sock.sendto(body("o", i), dest)
    if first:
        got = [await sock.recvfrom() for _ in range(N)]
    ok = [(d, a) == (body("k", i), dest) for i, (d, a) in enumerate(got)]
    await sock.sendto(b"", (peer, 0))  # the kernel answers pings on port 0
    pong = await sock.recvfrom()
    return {"got": digest(got), "got_ok": all(ok) and len(ok) == N,
            "pong": [pong[0].hex(), list(pong[1])]}  # fmt: skip


async def ours_reconnect(node: Any, sock: Any, peer: str, round_: str) -> dict[str, Any]:
    import trio

    dest = (peer, KERNEL_PORT)
    received: list[bytes] = []

    async def reader() -> None:
        for _ in range(M):
            received.append((await sock.recvfrom())[0])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        for i in range(M):
            if round_ == "reconnect-cut" and i == M // 2:
                (conn,) = node.connections()
                while conn.session is None or conn.session.lost:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # a session lost to a connect race: the next
                conn.session.cut()
            await sock.sendto(body("o", i, 100), dest)
            if round_ == "reconnect-link":
                await trio.sleep(LINK_PACE)  # in flight all through the outage
            elif i % 10 == 0:
                await trio.sleep(0.01)  # spread the messages over the break
    want = [body("k", i, 100) for i in range(M)]
    return {"received": len(received), "in_order": received == want,
            "dups": len(received) - len(set(received))}  # fmt: skip


async def ours_congestion(node: Any, sock: Any, peer: str) -> dict[str, Any]:
    import trio

    while not node.congestion.test(OUR_PORT):  # noqa: ASYNC110 - polled, unread on purpose
        await trio.sleep(0.05)
    congested_at = sock.queued_bytes
    await trio.sleep(5)  # the kernel keeps trying (ENOBUFS) meanwhile
    held = len(sock.received)
    got = [await sock.recvfrom() for _ in range(CONG_BURST)]
    ok = [d == body("c", i, CONG_SIZE) for i, (d, _) in enumerate(got)]
    return {"congested_at": congested_at, "held_while_congested": held,
            "all_in_order": all(ok) and len(ok) == CONG_BURST}  # fmt: skip


async def ours_rdma(sock: Any, peer: str) -> dict[str, Any]:
    from rdmashim.ulps.rds.rdma import RdmaOp

    dest = (peer, KERNEL_PORT)
    result: dict[str, Any] = {}
    await sock.sendto(b"hello", dest)
    data, _ = await sock.recvfrom()
    if data == b"map":  # the message that mapped the kernel's region (RDS_CMSG_RDMA_MAP)
        data, _ = await sock.recvfrom()
    offer = json.loads(data)
    # The kernel's cookie: R_Key low, page offset high. Its region's address is the
    # kernel's business (an FRMR's iova is a DMA address); the cookie alone is what
    # an RDS peer gets, so we use it as Linux's rds_cmsg_rdma_args does.
    cookie = offer["cookie"]
    write = RdmaOp.write_to(cookie, body("w", 0, RDMA_LEN))
    await sock.sendto(b"written", dest, rdma=write)
    result["write_status"] = str(await write.wait())
    back = bytearray(RDMA_LEN)
    read = RdmaOp.read_into(cookie, back)
    await sock.sendto(b"read", dest, rdma=read)
    result["read_status"] = str(await read.wait())
    result["read_back_ok"] = bytes(back) == body("w", 0, RDMA_LEN)
    result["read_back_head"] = bytes(back[:8]).hex()
    await sock.sendto(json.dumps(result).encode(), dest)
    # Now our region, for the kernel to write into.
    region = bytearray(RDMA_LEN)
    our_cookie = sock.get_mr(region)
    # R_Key as the kernel's cookie and the region's address as its remote_vec.addr: the
    # kernel adds the two (rdma.c rds_cmsg_rdma_args), and our cookie may be wider than
    # its 64 bits (an address above the R_Key where the device ignores the iova).
    offer = {"cookie": our_cookie & 0xFFFFFFFF, "addr": our_cookie >> 32}
    await sock.sendto(json.dumps(offer).encode(), dest)
    data, _ = await sock.recvfrom()
    verdict = {"message": data.decode(errors="replace"),
               "region_written": bytes(region) == body("x", 0, RDMA_LEN),
               "region_head": bytes(region[:8]).hex(), "our_cookie": our_cookie}  # fmt: skip
    await sock.sendto(json.dumps(verdict).encode(), dest)
    result["kernel_wrote"] = verdict
    # The kernel reads the region back; its message comes behind the Read.
    result["kernel_read_message"] = (await sock.recvfrom())[0].decode(errors="replace")
    return result


def main() -> None:
    side, round_, me, peer = sys.argv[1:5]
    if side == "kernel":
        kernel_main(round_, me, peer)
    else:
        import logging

        import trio

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        trio.run(ours_main, round_, me, peer)


if __name__ == "__main__":
    main()
