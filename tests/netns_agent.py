"""Runs one side of a multi-host CM test inside a host's network namespace.

Started by ``netns.Host.start`` as ``ip netns exec NETNS python netns_agent.py
SCENARIO KWARGS-JSON``. It writes JSON lines to stdout: progress messages
(``{"port": ...}``), then ``{"result": {...}}``, or ``{"error": traceback}``.
Events are reported by name, status, private data (hex) and the seconds since
the call that caused them; an event that does not come in time is reported as
``NONE``, so the test's assertion names what was missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import traceback
from typing import Any

import trio

from rdmashim import Access, QPCap, RecvWR, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.cm import CMEventType, ConnParam, EventChannel

E = CMEventType
SIG = SendFlags.SIGNALED
WAIT = 10.0
"""Seconds any single event or completion may take."""
BLOCK = 64 * 1024
"""Bytes the client writes and reads back: many FPDUs on a 1500-byte MTU link."""
MR_INFO = struct.Struct("!QI")
"""The server's accept private data starts with its buffer's address and rkey."""


def emit(**message: Any) -> None:
    print(json.dumps(message), flush=True)


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(event: Any, since: float) -> dict[str, Any]:
    return {
        "event": event.event.name,
        "status": event.status,
        "private_data": event.private_data.hex(),
        "detail": event.detail,
        "on": repr(event.id),
        "elapsed": round(trio.current_time() - since, 3),
    }


async def wait_event(channel: EventChannel, seconds: float = WAIT) -> Any:
    """The next event (acknowledged), or None if none comes within ``seconds``."""
    with trio.move_on_after(seconds):
        event = await channel.get_event()
        event.ack()
        return event
    return None


async def next_event(channel: EventChannel, since: float, seconds: float = WAIT) -> dict:
    """The next event, described; NONE if none comes within ``seconds``."""
    event = await wait_event(channel, seconds)
    if event is None:
        return {"event": "NONE", "status": 0, "private_data": "", "detail": f"none in {seconds} s"}
    return describe(event, since)


async def events_until(channel: EventChannel, wanted: set[str], since: float) -> list[dict]:
    """Events until all of ``wanted`` were seen (or a wait ran out: then NONE is last)."""
    seen: list[dict] = []
    while not wanted <= {e["event"] for e in seen}:
        seen.append(await next_event(channel, since))
        if seen[-1]["event"] == "NONE":
            break
    return seen


def addr(sockaddr: Any) -> list[Any] | None:
    return list(sockaddr) if sockaddr is not None else None


async def completions(cq: Any, count: int) -> list[Any]:
    done: list[Any] = []
    with trio.fail_after(WAIT):
        while len(done) < count:
            done += await cq.poll_wait(count - len(done))
    bad = [wc for wc in done if wc.status != WCStatus.SUCCESS]
    if bad:
        raise RuntimeError(f"failed completions: {bad}")
    return done


class Endpoint:
    """PD, CQs, QP and a few receive slots for one CM id."""

    SLOTS = 4
    SLOT = 256

    def __init__(self, cm_id: Any) -> None:
        ctx = cm_id.context
        self.pd = ctx.alloc_pd()
        self.send_cq, self.recv_cq = ctx.create_cq(64), ctx.create_cq(64)
        self.qp = cm_id.create_qp(
            self.pd, send_cq=self.send_cq, recv_cq=self.recv_cq, cap=QPCap(max_recv_wr=16)
        )
        self.inbox = self.pd.reg_mr(bytearray(self.SLOTS * self.SLOT), Access.LOCAL_WRITE)
        self.qp.post_recv(
            [RecvWR(i, [self.inbox.sge(i * self.SLOT, self.SLOT)]) for i in range(self.SLOTS)]
        )

    async def receive(self, count: int) -> list[str]:
        """The next ``count`` Sends received, as text."""
        wcs = await completions(self.recv_cq, count)
        start = [wc.wr_id * self.SLOT for wc in wcs]
        return [
            bytes(self.inbox.buf[s : s + wc.byte_len]).decode()
            for s, wc in zip(start, wcs, strict=True)
        ]

    async def send(self, text: str) -> None:
        message = self.pd.reg_mr(bytearray(text.encode()))
        self.qp.post_send(SendWR(1, WROpcode.SEND, [message.sge()], SIG))
        await completions(self.send_cq, 1)


# ---------------------------------------------------------------------- scenarios
async def resolve(dst: list[Any], src: list[Any] | None = None) -> dict[str, Any]:
    """resolve_addr then resolve_route: the events, the chosen device and addresses."""
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        start = trio.current_time()
        cm_id.resolve_addr(tuple(src) if src else None, tuple(dst))
        out: dict[str, Any] = {"addr": await next_event(channel, start)}
        if out["addr"]["event"] == "ADDR_RESOLVED":
            out["device"] = cm_id.context.device.name
            out["local_addr"] = addr(cm_id.local_addr)
            out["peer_addr"] = addr(cm_id.peer_addr)
            cm_id.resolve_route()
            out["route"] = await next_event(channel, start)
        return out


async def route_error(dst: list[Any], ifname: str) -> dict[str, Any]:
    """resolve_addr, take ``ifname`` down in this host, then resolve_route."""
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        start = trio.current_time()
        cm_id.resolve_addr(None, tuple(dst))
        out: dict[str, Any] = {"addr": await next_event(channel, start)}
        out["device"] = cm_id.context.device.name if cm_id.context else None
        with trio.fail_after(WAIT):
            await trio.run_process(["ip", "link", "set", ifname, "down"])
        operstate = await trio.Path("/sys/class/net", ifname, "operstate").read_text()
        out["operstate"] = operstate.strip()
        start = trio.current_time()
        cm_id.resolve_route()
        out["route"] = await next_event(channel, start)
        return out


async def serve(
    bind: str = "0.0.0.0",
    action: str = "accept",
    private_data: str = "",
    disconnect: bool = False,
) -> dict[str, Any]:
    """Listen, report the port, take one request and accept or reject it.

    Accepting: the accept private data is MR_INFO of a BLOCK-sized buffer the
    client writes and reads, then ``private_data``; two Sends are expected
    ("hello ..." and "done"). With ``disconnect`` this side then disconnects;
    either way the events until DISCONNECTED and TIMEWAIT_EXIT are reported,
    and the buffer's digest. Rejecting: the agent lingers until stdin closes,
    so the rejection goes out before the channel is torn down. Stdin closing
    before any request comes means the client gave up: the agent reports NONE.
    """
    async with EventChannel() as channel:
        listener = channel.create_id()
        listener.bind_addr((bind, 0))
        listener.listen()
        emit(port=listener.local_addr[1])
        start = trio.current_time()
        event = await request_or_release(channel)
        if event is None or event.event != E.CONNECT_REQUEST:
            return {"request": describe(event, start) if event else {"event": "NONE"}}
        child = event.id
        out: dict[str, Any] = {"request": describe(event, start)}
        out["device"] = child.context.device.name
        out["local_addr"] = addr(child.local_addr)
        out["peer_addr"] = addr(child.peer_addr)
        if action == "reject":
            child.reject(private_data.encode())
            await linger()
            return out
        end = Endpoint(child)
        access = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
        block = end.pd.reg_mr(bytearray(BLOCK), access)
        info = MR_INFO.pack(block.addr, block.rkey)
        child.accept(ConnParam(private_data=info + private_data.encode()))
        out["established"] = await next_event(channel, start)
        if out["established"]["event"] != "ESTABLISHED":
            return out
        out["received"] = await end.receive(2)
        start = trio.current_time()
        if disconnect:
            child.disconnect()
        out["after"] = await events_until(channel, {"DISCONNECTED", "TIMEWAIT_EXIT"}, start)
        out["block_sha256"] = sha(block.buf)
        return out


async def connect(
    dst: list[Any],
    name: str,
    private_data: str = "",
    connect_timeout: float | None = None,
    disconnect: bool = True,
) -> dict[str, Any]:
    """Resolve, connect, and when established: Send, Write BLOCK, Read it back, Send "done".

    With ``disconnect`` this side disconnects afterwards; either way the events
    until DISCONNECTED and TIMEWAIT_EXIT are reported.
    """
    async with EventChannel() as channel:
        cm_id = channel.create_id()
        if connect_timeout is not None:
            cm_id.connect_timeout = connect_timeout
        start = trio.current_time()
        cm_id.resolve_addr(None, tuple(dst))
        out: dict[str, Any] = {"addr": await next_event(channel, start)}
        if out["addr"]["event"] != "ADDR_RESOLVED":
            return out
        out["device"] = cm_id.context.device.name
        cm_id.resolve_route()
        out["route"] = await next_event(channel, start)
        if out["route"]["event"] != "ROUTE_RESOLVED":
            return out
        end = Endpoint(cm_id)
        start = trio.current_time()
        cm_id.connect(ConnParam(private_data=private_data.encode()))
        limit = cm_id.connect_timeout + WAIT
        out["connect"] = event = await next_event(channel, start, seconds=limit)
        out["local_addr"] = addr(cm_id.local_addr)
        out["peer_addr"] = addr(cm_id.peer_addr)
        if event["event"] != "ESTABLISHED":
            return out
        remote, rkey = MR_INFO.unpack_from(bytes.fromhex(event["private_data"]))
        pattern = bytes((i * 131 + len(name) + ord(name[0])) & 0xFF for i in range(BLOCK))
        source = end.pd.reg_mr(bytearray(pattern))
        back = end.pd.reg_mr(bytearray(BLOCK), Access.LOCAL_WRITE)
        hello = end.pd.reg_mr(bytearray(f"hello from {name}".encode()))
        end.qp.post_send(
            [
                SendWR(1, WROpcode.SEND, [hello.sge()], SIG),
                SendWR(2, WROpcode.RDMA_WRITE, [source.sge()], SIG, remote, rkey),
                SendWR(3, WROpcode.RDMA_READ, [back.sge()], SIG, remote, rkey),
            ]
        )
        wcs = await completions(end.send_cq, 3)
        out["opcodes"] = [wc.opcode.name for wc in wcs]
        out["written_sha256"] = sha(pattern)
        out["read_sha256"] = sha(back.buf)
        await end.send("done")
        start = trio.current_time()
        if disconnect:
            cm_id.disconnect()
        out["after"] = await events_until(channel, {"DISCONNECTED", "TIMEWAIT_EXIT"}, start)
        return out


async def request_or_release(channel: EventChannel) -> Any:
    """The first event, unless the test closes our stdin first (its client gave up)."""
    event = None
    async with trio.open_nursery() as nursery:

        async def released() -> None:
            await linger()
            nursery.cancel_scope.cancel()

        nursery.start_soon(released)
        event = await wait_event(channel, 3 * WAIT)
        nursery.cancel_scope.cancel()
    return event


async def linger(seconds: float = 30) -> None:
    """Wait until the test closes our stdin (or ``seconds`` pass)."""
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    with trio.move_on_after(seconds):
        while await stdin.receive_some(4096):
            pass
    await stdin.aclose()


SCENARIOS = {f.__name__: f for f in (resolve, route_error, serve, connect)}


def main() -> None:
    scenario, kwargs = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = trio.run(lambda: SCENARIOS[scenario](**kwargs))
    except BaseException:
        emit(error=traceback.format_exc())
        sys.exit(1)
    emit(result=result)


if __name__ == "__main__":
    main()
