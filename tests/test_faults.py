"""The fault matrix: the peer process killed, stopped, reset or disconnecting mid-transfer.

This process (the survivor) connects with ``cm.open_connection`` to
``fault_agent.py`` in another process (``cm.serve``), both on the built-in
engine over loopback TCP, and moves 64 MiB as 1 MiB RDMA Writes or 1 MiB
Sends, eight in flight, then a small Send that tells the agent it is done.
After 16 completions the agent is faulted:

``kill``
    SIGKILL: its kernel closes the socket (a FIN, or a RST with data unread).
``stop``
    SIGSTOP for 5 s, then SIGCONT: TCP holds the stream, nothing is lost; the
    transfer must finish and every block arrive intact.
``reset``
    SO_LINGER 0 and close on the socket under its QP: a RST.
``disconnect``
    ``rdma_disconnect`` on its connection.

For every fault but ``stop`` the survivor must get DISCONNECTED, and every
work request it posted must complete, SUCCESS or WR_FLUSH_ERR, within
:data:`BOUND` seconds of the fault; nothing may raise into the test, and no
task may be left running once the connection is closed. Linux siw is the
anchor for the bound: it moves the QP to ERROR and flushes as soon as TCP
reports the error or the close (``siw_cm_llp_state_change``, ``siw_qp_cm_drop``),
with no timer of its own after setup (its MPA timeouts, 10 s for a Reply and
5 s for a Request, only guard the handshake). On loopback TCP reports at
once, so the bound here is generous: 10 s on a shared, slow machine.

Each cell prints its row of the table in ``docs/security.md``.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel
from fault_agent import BLOCKS, PRIVATE, MiB, block

from rdmashim.cm import ConnectionRequest, open_connection, serve
from rdmashim.verbs import Access, QPCap, SendFlags, SendWR, WROpcode

import netns

pytestmark = pytest.mark.usefixtures("each_engine")  # native and Python

AGENT = Path(__file__).with_name("fault_agent.py")
BOUND = 10.0
"""Seconds from the fault to DISCONNECTED and to the last completion."""
STOP_FOR = 5.0
WINDOW = 8
"""Work requests in flight."""
FAULT_AFTER = 16
"""Completions before the fault (16 MiB moved)."""


@functools.cache
def source() -> bytearray:
    """The 64 MiB the survivor sends: block i at i MiB."""
    return bytearray(b"".join(block(i) for i in range(BLOCKS)))


def tasks() -> set[trio.lowlevel.Task]:
    """Every task of this run, system tasks too."""
    found: set[trio.lowlevel.Task] = set()
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        for nursery in task.child_nurseries:
            found.update(nursery.child_tasks)
            stack.extend(nursery.child_tasks)
    return found


@dataclass
class Cell:
    """What one cell of the matrix measured."""

    op: str
    fault: str
    side: str
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    to_event: float | None = None
    """Seconds from the fault to DISCONNECTED (None: none came)."""
    to_last: float | None = None
    """Seconds from the fault to the last completion."""
    start: float = 0.0
    seconds: float = 0.0
    """The whole transfer: connection established to last completion."""
    result: dict[str, Any] | None = None
    """The agent's check of what arrived (``stop``)."""
    agent_said: list[dict[str, Any]] = field(default_factory=list)
    qp_state: str = ""
    """The survivor's QP state once every work request completed (and the event came)."""

    def row(self) -> str:
        ms = lambda s: "-" if s is None else f"{s * 1000:.0f} ms"  # noqa: E731
        other = sum(n for k, n in self.statuses.items() if k not in ("SUCCESS", "WR_FLUSH_ERR"))
        verified = f"{self.result['blocks_ok']} MiB" if self.result else "-"
        return (
            f"| {self.fault} | {self.op} | {self.side} | {ms(self.to_event)} | "
            f"{ms(self.to_last)} | {self.statuses['SUCCESS']} | "
            f"{self.statuses['WR_FLUSH_ERR']} | {other} | {self.seconds:.1f} s | {verified} |"
        )


async def follow(agent: netns.Agent, cell: Cell) -> None:
    """Collect the agent's lines (it may die at any point: then they just end)."""
    stdout = agent.process.stdout
    assert stdout is not None
    rest = b""
    while chunk := await stdout.receive_some(1 << 16):
        *lines, rest = (rest + chunk).split(b"\n")
        for line in lines:
            cell.agent_said.append(json.loads(line))


async def said(cell: Cell, key: str, seconds: float) -> dict[str, Any]:
    """The agent's first line with ``key``."""
    with trio.move_on_after(seconds):
        while True:
            for message in cell.agent_said:
                if key in message:
                    return message
            await trio.sleep(0.01)
    raise AssertionError(f"the agent said no {key!r} within {seconds} s: {cell.agent_said}")


CAP = QPCap(max_send_wr=2 * WINDOW, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)


async def run_cell(op: str, fault: str, side: str) -> Cell:
    """One cell; ``side`` is the survivor's: ``client`` (open_connection) or ``server``."""
    cell = Cell(op, fault, side)
    before = tasks()
    agents: list[netns.Agent] = []

    async def start_agent(nursery: trio.Nursery, *port: int) -> netns.Agent:
        argv = [sys.executable, str(AGENT), op, *map(str, port)]
        agent = await netns.Agent.start(f"fault-{op}-{fault}-{side}", argv)
        agents.append(agent)
        nursery.start_soon(follow, agent, cell)
        return agent

    try:
        async with trio.open_nursery() as nursery:
            if side == "client":
                agent = await start_agent(nursery)
                port = (await said(cell, "up", 30))["up"]
                async with open_connection("127.0.0.1", port, cap=CAP, cqe=4 * WINDOW) as conn:
                    await transfer(cell, agent, conn, nursery)
            else:
                done = trio.Event()

                async def handler(request: ConnectionRequest) -> None:
                    await transfer(cell, agents[0], await request.accept(), nursery)
                    done.set()

                _, port = await nursery.start(
                    lambda task_status: serve(
                        handler, 0, host="127.0.0.1", cap=CAP, cqe=4 * WINDOW,
                        task_status=task_status,
                    )
                )  # fmt: skip
                await start_agent(nursery, port)
                with trio.fail_after(60 + STOP_FOR):
                    await done.wait()
            if fault == "stop":
                cell.result = (await said(cell, "result", 30))["result"]
            nursery.cancel_scope.cancel()
    finally:
        for agent in agents:
            if fault == "stop":
                os.kill(agent.process.pid, signal.SIGCONT)  # never leave it stopped
            await agent.aclose()
    crashed = [m["crashed"] for m in cell.agent_said if "crashed" in m]
    leaked = tasks() - before
    errors = [line for c in crashed for line in c.splitlines() if "Error:" in line]
    print(cell.row(), f"(the agent crashed: {errors[-1].strip()})" if crashed else "")
    assert not leaked, f"tasks left running: {[t.name for t in leaked]}"
    return cell


async def transfer(cell: Cell, agent: netns.Agent, conn: Any, nursery: trio.Nursery) -> None:
    """Move the 64 MiB, fault the agent after FAULT_AFTER completions, take every completion."""
    total = BLOCKS + 1  # the blocks, then the small Send that says done
    cell.start = time.monotonic()
    addr, rkey = PRIVATE.unpack(conn.private_data)
    mr = conn.pd.reg_mr(source(), Access.LOCAL_WRITE)
    disconnected: list[float] = []
    event = trio.Event()

    async def watch() -> None:
        await conn.wait_disconnected()
        disconnected.append(time.monotonic())
        event.set()

    nursery.start_soon(watch)

    def post(i: int) -> None:
        if i == BLOCKS:
            wr = SendWR(i, WROpcode.SEND, [mr.sge(0, 4)], SendFlags.SIGNALED)
        elif cell.op == "write":
            sge = [mr.sge(i * MiB, MiB)]
            wr = SendWR(i, WROpcode.RDMA_WRITE, sge, SendFlags.SIGNALED, addr + i * MiB, rkey)
        else:
            wr = SendWR(i, WROpcode.SEND, [mr.sge(i * MiB, MiB)], SendFlags.SIGNALED)
        conn.qp.post_send(wr)

    posted = completed = 0
    fault_at: float | None = None
    last = cell.start
    with trio.fail_after(60 + STOP_FOR):
        while completed < total:
            while posted < total and posted - completed < WINDOW:
                post(posted)
                posted += 1
            with trio.move_on_at(trio.current_time() + BOUND) as scope:
                wcs = await conn.send_cq.poll_wait(WINDOW)
            assert not scope.cancelled_caught, (
                f"{posted - completed} work requests outstanding, no completion in {BOUND} s"
            )
            for wc in wcs:
                cell.statuses[wc.status.name] += 1
            completed += len(wcs)
            last = time.monotonic()
            if fault_at is None and completed >= FAULT_AFTER:
                fault_at = await inject(cell, agent, nursery)
    cell.seconds = last - cell.start
    assert fault_at is not None
    if cell.fault != "stop":
        with trio.move_on_after(BOUND):
            await event.wait()
        if cell.fault in ("reset", "disconnect"):  # the agent says when it acted
            fault_at = (await said(cell, "did", BOUND))["t"]
        cell.to_event = disconnected[0] - fault_at if disconnected else None
        cell.to_last = last - fault_at
    cell.qp_state = conn.qp.state.name
    mr.close()


async def inject(cell: Cell, agent: netns.Agent, nursery: trio.Nursery) -> float:
    """Fault the agent; when (``time.monotonic``, the clock both processes share)."""
    pid = agent.process.pid
    now = time.monotonic()
    if cell.fault == "kill":
        os.kill(pid, signal.SIGKILL)
    elif cell.fault == "stop":
        os.kill(pid, signal.SIGSTOP)

        async def resume() -> None:
            await trio.sleep(STOP_FOR)
            os.kill(pid, signal.SIGCONT)

        nursery.start_soon(resume)
    else:
        assert agent.process.stdin is not None
        await agent.process.stdin.send_all(f"{cell.fault}\n".encode())
    return now


def check(cell: Cell) -> None:
    """A fault other than ``stop``: the event came, every work request completed in time."""
    assert sum(cell.statuses.values()) == BLOCKS + 1
    assert set(cell.statuses) <= {"SUCCESS", "WR_FLUSH_ERR"}, cell.statuses
    assert cell.to_event is not None, "no DISCONNECTED"
    assert cell.to_event < BOUND and cell.to_last is not None and cell.to_last < BOUND
    assert cell.statuses["SUCCESS"] >= FAULT_AFTER
    assert cell.qp_state == "ERR"


HEADER = (
    "| fault | op | survivor | fault to DISCONNECTED | fault to last completion | SUCCESS "
    "| WR_FLUSH_ERR | other | transfer | verified |\n|---|---|---|---|---|---|---|---|---|---|"
)


SIDES = pytest.mark.parametrize("side", ["client", "server"])
OPS = pytest.mark.parametrize("op", ["write", "send"])


@SIDES
@OPS
@pytest.mark.parametrize("fault", ["kill", "reset", "disconnect"])
async def test_peer_fault_mid_transfer(fault: str, op: str, side: str) -> None:
    print(f"\n{HEADER}")
    check(await run_cell(op, fault, side))


@SIDES
@OPS
async def test_peer_stopped_then_continued_finishes_intact(op: str, side: str) -> None:
    print(f"\n{HEADER}")
    cell = await run_cell(op, "stop", side)
    assert cell.statuses == {"SUCCESS": BLOCKS + 1}, cell.statuses
    assert cell.qp_state == "RTS"
    assert cell.result == {"blocks_ok": BLOCKS, "intact": True}
    assert cell.seconds >= STOP_FOR
    assert not [m for m in cell.agent_said if "lost" in m or "crashed" in m], cell.agent_said
