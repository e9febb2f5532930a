"""A connection served from a thread of its own (``CQ.serve_in_thread``): the native
engine's thread takes completions and the callback answers there, over real loopback
TCP, against a peer driven by trio in the same run; on the Python engine it declines.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from rdmashim import Access, QPCap, SendFlags, SendWR, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.wr import RecvBatch, RecvWR, WCArray

from pairs import Side, make_pair

RECVS = 16
SIZE = 1024
BOUND = 5.0
"""Seconds within which what must happen happens (a hang fails, not waits)."""


class Echo:
    """The served side: ``RECVS`` receives of ``SIZE`` bytes; each message is answered
    with its own bytes reversed (posted from the serving thread), the receive posted
    again; after ``limit`` answers the callback gives the QP back."""

    def __init__(self, side: Side, limit: int) -> None:
        self.side = side
        self.limit = limit
        self.answered = 0
        self.threads: set[int] = set()
        self.buf = bytearray(SIZE * RECVS)
        self.mr = side.pd.reg_mr(self.buf, Access.LOCAL_WRITE)
        self.replies = side.pd.reg_mr(bytearray(SIZE * 4 * RECVS))
        self.recvs = RecvBatch(RecvWR(i, [self.mr.sge(i * SIZE, SIZE)]) for i in range(RECVS))
        side.qp.post_recv_batch(self.recvs)

    def on_completions(self, wcs: WCArray, n: int) -> bool:
        self.threads.add(threading.get_ident())
        for i in range(n):
            assert wcs.status[i] == WCStatus.SUCCESS, wcs.status[i]
            if wcs.opcode[i] != WCOpcode.RECV:
                continue
            slot = wcs.wr_id[i]
            data = bytes(self.buf[slot * SIZE : slot * SIZE + wcs.byte_len[i]])[::-1]
            self.side.qp.post_recv_batch(self.recvs, indices=[slot])
            if len(data) <= 64:
                flags = SendFlags.SIGNALED | SendFlags.INLINE
                self.side.qp.post_send(SendWR(slot, WROpcode.SEND, [data], flags))
            else:  # (from a reply slot: at most RECVS // 2 answers are unread at once)
                at = self.answered % (4 * RECVS) * SIZE
                self.replies.buf[at : at + len(data)] = data
                sge = self.replies.sge(at, len(data))
                self.side.qp.post_send(SendWR(slot, WROpcode.SEND, [sge], SendFlags.SIGNALED))
            self.answered += 1
        return self.answered < self.limit


async def _served_pair(ctx: Any) -> tuple[Side, Side, Any]:
    cq = ctx.create_cq(4 * RECVS)
    cap = QPCap(max_send_wr=4 * RECVS, max_recv_wr=RECVS, max_inline_data=64)
    served, peer = await make_pair(ctx, client_cq=cq, cap=cap)
    return served, peer, cq


async def _exchange(peer: Side, messages: list[bytes]) -> list[bytes]:
    """Send ``messages`` (at most ``RECVS // 2`` unanswered) and collect the answers."""
    mr = getattr(peer, "answers_mr", None)
    if mr is None:  # (the peer's receives: posted once)
        mr = peer.answers_mr = peer.pd.reg_mr(bytearray(SIZE * RECVS), Access.LOCAL_WRITE)  # type: ignore[attr-defined]
        for i in range(RECVS):
            peer.qp.post_recv(RecvWR(i, [mr.sge(i * SIZE, SIZE)]))
    out = peer.pd.reg_mr(bytearray(SIZE * len(messages)))
    answers: list[bytes] = []
    sent = 0
    wcs = WCArray(32)
    while len(answers) < len(messages):
        while sent < len(messages) and sent - len(answers) < RECVS // 2:
            m = messages[sent]
            out.buf[sent * SIZE : sent * SIZE + len(m)] = m
            peer.qp.post_send(SendWR(10_000 + sent, WROpcode.SEND, [out.sge(sent * SIZE, len(m))]))
            sent += 1
        n = await peer.recv_cq.poll_wait_into(wcs)
        for i in range(n):
            assert wcs.status[i] == WCStatus.SUCCESS, wcs.status[i]
            if wcs.opcode[i] == WCOpcode.RECV:
                slot = wcs.wr_id[i]
                answers.append(bytes(mr.buf[slot * SIZE : slot * SIZE + wcs.byte_len[i]]))
                peer.qp.post_recv(RecvWR(slot, [mr.sge(slot * SIZE, SIZE)]))
    return answers


async def test_a_thread_answers_each_message_and_gives_the_qp_back(
    each_engine: str, ctx: Any
) -> None:
    served, peer, cq = await _served_pair(ctx)
    echo = Echo(served, limit=400)
    messages = [struct.pack("<I", i) + os.urandom(i % 200) for i in range(400)]
    if each_engine == "python":  # (declined at once: wait the usual way)
        assert not await cq.serve_in_thread(WCArray(16), echo.on_completions)
        return
    results: list[bool] = []

    async def serve() -> None:
        results.append(await cq.serve_in_thread(WCArray(16), echo.on_completions))

    with trio.fail_after(BOUND * 4):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            answers = await _exchange(peer, messages)
    assert results == [True]
    assert answers == [m[::-1] for m in messages]
    assert echo.threads and threading.get_ident() not in echo.threads
    # The event loop has the QP back: a message now goes through poll_wait_into.
    echo.limit = 0
    wcs = WCArray(16)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_exchange, peer, [b"back in trio"])
        got = 0
        while not got:
            n = await cq.poll_wait_into(wcs)
            got = sum(wcs.opcode[i] == WCOpcode.RECV for i in range(n))
            echo.on_completions(wcs, n)


async def test_cancelling_the_waiting_task_takes_the_qp_back_at_once(ctx: Any) -> None:
    served, peer, cq = await _served_pair(ctx)
    echo = Echo(served, limit=10)
    start = trio.current_time()
    with trio.move_on_after(0.2) as scope:
        ran = await cq.serve_in_thread(WCArray(16), echo.on_completions)
        pytest.fail(f"returned {ran} with nothing received")
    assert scope.cancelled_caught and trio.current_time() - start < BOUND
    # The receive task reads the socket again: the peer's message completes here.
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_exchange, peer, [b"after"])
            wcs = WCArray(16)
            while True:
                n = await cq.poll_wait_into(wcs)
                echo.on_completions(wcs, n)
                if any(wcs.opcode[i] == WCOpcode.RECV for i in range(n)):
                    break


async def test_the_peer_going_away_gives_the_qp_back_with_its_flushes(ctx: Any) -> None:
    served, peer, cq = await _served_pair(ctx)
    echo = Echo(served, limit=1000)
    wcs = WCArray(64)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:

            async def go_away() -> None:
                await _exchange(peer, [b"one", b"two"])
                peer.qp.close()

            nursery.start_soon(go_away)
            assert await cq.serve_in_thread(wcs, echo.on_completions)
    assert echo.answered == 2
    statuses: list[WCStatus] = []
    with trio.fail_after(BOUND):
        while len(statuses) < RECVS:
            n = await cq.poll_wait_into(wcs)
            statuses += [wcs.status[i] for i in range(n) if wcs.opcode[i] == WCOpcode.RECV]
    assert set(statuses) == {WCStatus.WR_FLUSH_ERR}


async def test_registrations_on_the_device_meanwhile_leave_every_byte_right(ctx: Any) -> None:
    """The event loop registers and deregisters regions on the same device (its memory
    table, which the thread's engine looks up for every placement) while the thread
    serves 1,500 messages of up to 1 KiB."""
    served, peer, cq = await _served_pair(ctx)
    echo = Echo(served, limit=1500)
    other = ctx.alloc_pd()
    messages = [os.urandom(1 + i % SIZE) for i in range(1500)]
    done = trio.Event()

    async def churn() -> None:
        count = 0
        while not done.is_set():
            regions = [other.reg_mr(bytearray(4096), Access.LOCAL_WRITE) for _ in range(40)]
            for region in regions:
                region.close()
            count += 1
            await trio.lowlevel.checkpoint()
        assert count > 10

    with trio.fail_after(BOUND * 6):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(churn)
            nursery.start_soon(cq.serve_in_thread, WCArray(16), echo.on_completions)
            answers = await _exchange(peer, messages)
            done.set()
    assert answers == [m[::-1] for m in messages]


async def test_a_reply_larger_than_the_socket_takes_goes_out_whole(ctx: Any) -> None:
    """A 4 MiB Send posted from the thread fills the socket: C keeps the rest and the
    thread's wait writes it as the peer reads."""
    served, peer, cq = await _served_pair(ctx)
    big = os.urandom(4 << 20)
    sink = peer.pd.reg_mr(bytearray(len(big)), Access.LOCAL_WRITE)
    peer.qp.post_recv(RecvWR(1, [sink.sge(0, len(big))]))
    buf = served.pd.reg_mr(bytearray(SIZE), Access.LOCAL_WRITE)
    served.qp.post_recv(RecvWR(0, [buf.sge(0, SIZE)]))
    source = served.pd.reg_mr(bytearray(big))
    sends = 0

    def on_completions(wcs: WCArray, n: int) -> bool:
        nonlocal sends
        for i in range(n):
            if wcs.opcode[i] == WCOpcode.RECV:
                served.qp.post_send(
                    SendWR(7, WROpcode.SEND, [source.sge(0, len(big))], SendFlags.SIGNALED)
                )
            elif wcs.opcode[i] == WCOpcode.SEND:
                assert wcs.status[i] == WCStatus.SUCCESS
                sends += 1
        return not sends

    with trio.fail_after(BOUND * 2):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cq.serve_in_thread, WCArray(4), on_completions)
            await trio.sleep(0.05)  # (the thread serves before the request comes)
            peer.qp.post_send(SendWR(2, WROpcode.SEND, [b"go"], SendFlags.INLINE))
            wcs = WCArray(4)
            got = None
            while got is None:
                n = await peer.recv_cq.poll_wait_into(wcs)
                for i in range(n):
                    if wcs.opcode[i] == WCOpcode.RECV:
                        assert wcs.status[i] == WCStatus.SUCCESS
                        got = wcs.byte_len[i]
    assert got == len(big) and bytes(sink.buf) == big and sends == 1


@pytest.mark.parametrize("args", [[], ["--slots"]], ids=["callback", "slots"])
def test_the_example_serves_from_a_thread_where_it_can(each_engine: str, args: list[str]) -> None:
    """``examples/thread_server.py``, as a user runs it, on each engine: answering in
    its callback, and from slots."""
    example = Path(__file__).resolve().parents[1] / "examples" / "thread_server.py"
    out = subprocess.run(
        [sys.executable, str(example), *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    where = "a thread of its own" if each_engine == "native" else "trio"
    assert sorted(out.stdout.splitlines()) == [
        "client: 2000 replies, each its request upper-cased",
        f"server: answered 2000 requests in {where}",
    ]
