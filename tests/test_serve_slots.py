"""A thread answering from slots (``CQ.serve_in_thread(..., slots=...)``): the native
engine posts each answer from its Send slot, gives the Receive back and frees the Send
slots from their completions in C, calling Python only with a lone message; what the
answer does not take reaches ``on_completions`` with the slots' state handed back.
Over real loopback TCP, against a peer driven by trio in the same run.
"""

from __future__ import annotations

import errno
import os
import struct
from typing import Any

import pytest
import trio
from test_serve_thread import BOUND, RECVS, SIZE, _exchange

from rdmashim import Access, QPCap, SendFlags, SendWR, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.slots import LEFT, NOT_TAKEN, Slots
from rdmashim.verbs.wr import RecvBatch, RecvWR, WCArray

from pairs import Side, make_pair

SEND_SLOTS = 2 * RECVS
SQ = 4 * RECVS
SEND_BASE = 1000


class SlotEcho:
    """The served side, answering from slots: each message with its bytes reversed.
    A message starting ``N`` is not taken by the answer (``on_completions`` answers it
    the way the event loop would, from the same slots); ``L`` is left (the thread gives
    the QP back); ``X`` gets an answer longer than its slot."""

    def __init__(self, side: Side) -> None:
        self.side = side
        self.recv_mr = side.pd.reg_mr(bytearray(SIZE * RECVS), Access.LOCAL_WRITE)
        self.send_mr = side.pd.reg_mr(bytearray(SIZE * SEND_SLOTS))
        self.recvs = RecvBatch(RecvWR(i, [self.recv_mr.sge(i * SIZE, SIZE)]) for i in range(RECVS))
        side.qp.post_recv_batch(self.recvs)
        self.slots = Slots(
            recv=self.recv_mr.sge(0, SIZE), nrecv=RECVS, send=self.send_mr.sge(0, SIZE),
            nsend=SEND_SLOTS, send_base=SEND_BASE, signal_every=8, repost_every=4,
            room=SQ, free=list(range(SEND_SLOTS)), answer=self.answer,
        )  # fmt: skip
        self.in_c = 0  # answered through answer()
        self.in_python = 0  # answered by on_completions
        self.left: list[int] = []
        self.rows: list[tuple[int, WCOpcode, int]] = []  # what on_completions saw

    def _message(self, slot: int, length: int) -> bytes:
        return bytes(self.recv_mr.buf[slot * SIZE : slot * SIZE + length])

    def answer(self, slot: int, length: int, send_slot: int) -> int:
        data = self._message(slot, length)
        if data[:1] == b"N":
            return NOT_TAKEN
        if data[:1] == b"L":
            self.left.append(slot)
            return LEFT
        if data[:1] == b"X":
            return SIZE + 1
        base = send_slot * SIZE
        self.send_mr.buf[base : base + length] = data[::-1]
        self.in_c += 1
        return length

    def on_completions(self, wcs: WCArray, n: int) -> bool:
        """As the event loop does: the state is Python's here (checked whole)."""
        self.check()
        for i in range(n):
            assert wcs.status[i] == WCStatus.SUCCESS, wcs.status[i]
            self.rows.append((wcs.wr_id[i], wcs.opcode[i], wcs.byte_len[i]))
            if wcs.opcode[i] == WCOpcode.RECV:
                slot = wcs.wr_id[i]
                self._answer_in_python(slot, self._message(slot, wcs.byte_len[i]))
            else:
                self._release(wcs.wr_id[i] - SEND_BASE)
        return True

    def _answer_in_python(self, recv_slot: int, data: bytes) -> None:
        s = self.slots
        again = s.give_back(recv_slot)
        if again:
            self.side.qp.post_recv_batch(self.recvs, indices=again)
        slot, signaled = s.take_send()
        self.send_mr.buf[slot * SIZE : slot * SIZE + len(data)] = data[::-1]
        flags = SendFlags.SIGNALED if signaled else SendFlags.NONE
        sge = self.send_mr.sge(slot * SIZE, len(data))
        self.side.qp.post_send(SendWR(SEND_BASE + slot, WROpcode.SEND, [sge], flags))
        self.in_python += 1

    def _release(self, slot: int) -> None:
        self.slots.completed(slot)

    def check(self) -> None:
        """The slots' state is whole: every Send slot free or out, once; room for the
        rest of the send queue; fewer Receives waiting than a post's worth."""
        s = self.slots
        assert sorted([*s.free, *s.unacked]) == list(range(SEND_SLOTS))
        assert s.room == SQ - len(s.unacked)
        assert len(s.reposts) < s.repost_every
        assert 0 <= s.unsignaled < s.signal_every


async def _served(ctx: Any) -> tuple[Side, Any, SlotEcho]:
    cq = ctx.create_cq(4 * RECVS + SQ)
    cap = QPCap(max_send_wr=SQ, max_recv_wr=RECVS)
    served, peer = await make_pair(ctx, client_cq=cq, cap=cap)
    return peer, cq, SlotEcho(served)


async def _serve_while(cq: Any, echo: SlotEcho, work: Any, *args: Any) -> Any:
    """Serve in a thread while ``work(*args)`` runs; then take the QP back."""
    out: list[Any] = []
    with trio.fail_after(BOUND * 6):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cq.serve_in_thread, WCArray(16), echo.on_completions, echo.slots)
            out.append(await work(*args))
            nursery.cancel_scope.cancel()
    echo.check()
    return out[0]


def _messages(count: int) -> list[bytes]:
    return [b"C" + struct.pack("<I", i) + os.urandom(i % (SIZE - 5)) for i in range(count)]


async def test_each_message_is_answered_from_a_slot_without_a_row_for_python(
    each_engine: str, ctx: Any
) -> None:
    peer, cq, echo = await _served(ctx)
    if each_engine == "python":  # (declined at once, the slots untouched)
        assert not await cq.serve_in_thread(WCArray(16), echo.on_completions, echo.slots)
        echo.check()
        return
    messages = _messages(3000)
    answers = await _serve_while(cq, echo, _exchange, peer, messages)
    assert answers == [m[::-1] for m in messages]
    assert echo.in_c == len(messages) and echo.rows == []
    # Every Send from a slot completed in C, or is still out for the event loop to free.
    assert len(echo.slots.unacked) < echo.slots.signal_every
    # The event loop has the QP and the slots back: it answers and frees as before.
    wcs = WCArray(16)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_exchange, peer, [b"N back in trio"] * 20)
            while echo.in_python < 20:
                echo.on_completions(wcs, await cq.poll_wait_into(wcs))


async def test_what_the_answer_does_not_take_reaches_python_with_the_slots(ctx: Any) -> None:
    """One message in three is not taken: ``on_completions`` gets its row (and never a
    Send's of a slot), answers it from the slots Python holds then, and the thread goes
    on from the state it left; every answer comes back, in order."""
    peer, cq, echo = await _served(ctx)
    messages = [b"N" + m if i % 3 == 0 else m for i, m in enumerate(_messages(900))]
    answers = await _serve_while(cq, echo, _exchange, peer, messages)
    assert answers == [m[::-1] for m in messages]
    assert echo.in_python == 300 and echo.in_c == 600
    assert all(opcode == WCOpcode.RECV for _, opcode, _ in echo.rows)
    assert [length for _, _, length in echo.rows] == [len(m) for m in messages[::3]]


async def test_a_message_left_for_later_gives_the_qp_back_with_its_receive(ctx: Any) -> None:
    peer, cq, echo = await _served(ctx)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_exchange, peer, [b"one", b"two", b"Later"])
            ran = await cq.serve_in_thread(WCArray(16), echo.on_completions, echo.slots)
            assert ran and echo.in_c == 2 and len(echo.left) == 1
            echo.check()
            assert echo.left[0] not in echo.slots.reposts  # (still the owner's)
            echo._answer_in_python(echo.left[0], b"Later")  # (the event loop answers it)


async def test_an_answer_longer_than_its_slot_is_refused_by_name(ctx: Any) -> None:
    peer, cq, echo = await _served(ctx)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_exchange, peer, [b"X marks it"])
            with pytest.raises(VerbsError, match="does not fit") as caught:
                await cq.serve_in_thread(WCArray(16), echo.on_completions, echo.slots)
            nursery.cancel_scope.cancel()
    assert caught.value.errno == errno.EINVAL
    echo.check()


async def test_held_slots_keep_the_rows_in_python_until_they_are_free(ctx: Any) -> None:
    """While ``slots.held`` the thread takes rows as without slots (Send completions
    included); once the owner frees what it held, the next turn answers from slots."""
    peer, cq, echo = await _served(ctx)
    echo.slots.held = 1
    sends = 0
    on_completions = echo.on_completions

    def held_for_a_while(wcs: WCArray, n: int) -> bool:
        nonlocal sends
        sends += sum(wcs.opcode[i] == WCOpcode.SEND for i in range(n))
        if sends >= 2:
            echo.slots.held = 0
        return on_completions(wcs, n)

    echo.on_completions = held_for_a_while  # type: ignore[method-assign]
    messages = [b"N" + m for m in _messages(40)] + _messages(400)
    answers = await _serve_while(cq, echo, _exchange, peer, messages)
    assert answers == [m[::-1] for m in messages]
    assert sends >= 2 and echo.in_python == 40 and echo.in_c == 400


async def test_the_peer_going_away_gives_the_slots_back_whole(ctx: Any) -> None:
    peer, cq, echo = await _served(ctx)
    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:

            async def go_away() -> None:
                await _exchange(peer, _messages(50))
                peer.qp.close()

            nursery.start_soon(go_away)
            assert await cq.serve_in_thread(WCArray(16), echo.on_completions, echo.slots)
    assert echo.in_c == 50
    echo.check()


async def test_slots_that_do_not_add_up_are_refused_before_c_uses_them(ctx: Any) -> None:
    """A Send slot both free and out would let C free it twice, past the end of its
    stack: the turn is refused, nothing posted, nothing written."""
    _, cq, echo = await _served(ctx)
    echo.slots.unacked.append(echo.slots.free[0])
    with trio.fail_after(BOUND), pytest.raises(VerbsError, match="do not add up") as caught:
        await cq.serve_in_thread(WCArray(16), echo.on_completions, echo.slots)
    assert caught.value.errno == errno.EINVAL
    assert echo.in_c == echo.in_python == 0
    assert len(echo.slots.free) == SEND_SLOTS and len(echo.slots.unacked) == 1
