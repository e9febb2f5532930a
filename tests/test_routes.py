"""A work request's route from ``post_send`` to the socket, and a received message's from
the socket read to its completion, enter each module of the package once, on both
engines: no module calls back up into one that called it (issue 33's layout).

The routes are traced with ``sys.setprofile`` on a real connected pair: every call made
under a QP's ``post_send`` (a first post, which takes the checks, the same request
again, a list of two) and under the driver's handling of a read (``Link._read`` on the
Python engine, ``NativeLink._took`` on the native one, which every read of the socket
goes through, the receive task's and a waiter's). A call into a module that is on the
route's stack below another module is an up-call; the module's own functions calling
each other are not.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
import trio

import rdmashim
from rdmashim import RecvWR, SendFlags, SendWR, WROpcode

from pairs import make_pair

pytestmark = pytest.mark.usefixtures("each_engine")  # native and Python

PACKAGE = "rdmashim."
SUCCESS = rdmashim.WCStatus.SUCCESS
READ_ROOTS = {("rdmashim.providers.softiwarp.driver", "_read"),
              ("rdmashim.providers.softiwarp.native_link", "_took")}  # fmt: skip
"""Where the processing of one read of the socket starts, per engine."""


async def completions(cq: Any, n: int) -> list[Any]:
    wcs: list[Any] = []
    with trio.fail_after(10):
        while len(wcs) < n:
            wcs += await cq.poll_wait(n - len(wcs))
    return wcs


class Routes:
    """Up-calls seen under the traced roots, as ``module -> ... -> module (function)``."""

    def __init__(self, is_root: Callable[[str, str], bool]) -> None:
        self.is_root = is_root
        self.stack: list[str | None] = []
        """The modules of the frames under the current root (None: not the package's)."""
        self.upcalls: list[str] = []
        self.roots = 0

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = frame.f_globals.get("__name__", "")
            ours = module.startswith(PACKAGE)
            if not self.stack:
                if not (ours and self.is_root(module, frame.f_code.co_name)):
                    return
                self.roots += 1
            chain = [m for m in self.stack if m is not None]
            if ours and chain and chain[-1] != module and module in chain:
                route = [*chain[chain.index(module) :], module]
                self.upcalls.append(" -> ".join(route) + f" ({frame.f_code.co_name})")
            self.stack.append(module if ours else None)
        elif event == "return" and self.stack:
            self.stack.pop()


@contextmanager
def traced(is_root: Callable[[str, str], bool]) -> Iterator[Routes]:
    routes = Routes(is_root)
    before = sys.getprofile()
    sys.setprofile(routes.profile)
    try:
        yield routes
    finally:
        sys.setprofile(before)


async def test_a_work_request_goes_to_the_socket_entering_each_module_once() -> None:
    async with rdmashim.open_device("siw_lo") as ctx:
        a, b = await make_pair(ctx)
        mr, rmr = a.reg(64), b.reg(64, rdmashim.Access.LOCAL_WRITE)
        b.qp.post_recv([RecvWR(i, [rmr.sge()]) for i in range(8)])
        wr = SendWR(1, WROpcode.SEND, [mr.sge()], SendFlags.SIGNALED)
        other = SendWR(2, WROpcode.SEND, [mr.sge()], SendFlags.SIGNALED)
        with traced(lambda module, name: name == "post_send") as routes:
            a.qp.post_send(wr)  # first: the checks
            a.qp.post_send(wr)  # again: the shortcut
            a.qp.post_send([wr, other])  # a list
        assert routes.roots == 3
        assert routes.upcalls == []
        assert [wc.status for wc in await completions(a.send_cq, 4)] == [SUCCESS] * 4


async def test_a_received_message_goes_to_its_completion_entering_each_module_once() -> None:
    async with rdmashim.open_device("siw_lo") as ctx:
        a, b = await make_pair(ctx)
        mr, rmr = a.reg(64), b.reg(64, rdmashim.Access.LOCAL_WRITE)
        b.qp.post_recv([RecvWR(i, [rmr.sge()]) for i in range(8)])
        wr = SendWR(1, WROpcode.SEND, [mr.sge()])
        with traced(lambda module, name: (module, name) in READ_ROOTS) as routes:
            for _ in range(4):
                a.qp.post_send(wr)
                (wc,) = await completions(b.recv_cq, 1)
                assert wc.status == SUCCESS and wc.byte_len == 64
        assert routes.roots >= 1
        assert routes.upcalls == []


def test_the_tracer_sees_an_up_call() -> None:
    """The check can fail: a module called back by one it called is reported."""
    routes = Routes(lambda module, name: name == "outer")
    frames = [("rdmashim.a", "outer"), ("rdmashim.b", "middle"), ("rdmashim.a", "back")]

    class Frame:
        def __init__(self, module: str, name: str) -> None:
            self.f_globals = {"__name__": module}
            self.f_code = type("Code", (), {"co_name": name})

    for module, name in frames:
        routes.profile(Frame(module, name), "call", None)  # type: ignore[arg-type]
    assert routes.upcalls == ["rdmashim.a -> rdmashim.b -> rdmashim.a (back)"]
