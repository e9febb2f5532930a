"""Helpers of the IBAL facade tests: ends (PD, CQ, QP, region) and QPs connected through the CM.

Everything runs over the AL's HCA backend (the built-in engine by default).
:func:`connect` joins two unbound :class:`IbQp` the way the CM code will: on
the AL's progress loop, a task opens a portable CM event channel on the CA's
context, resolves and listens on 127.0.0.1, binds each QP to its CM id
(``h_qp.bind(cm_id)``), connects and accepts, and keeps the channel (and so
the connection) open until the test ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
from api.support import Events

from rdmashim.cm import CMEventType, ConnParam, EventChannel
from rdmashim.providers.ibal import (
    IbAl,
    IbCa,
    IbCq,
    IbError,
    IbPd,
    IbQp,
    IbStatus,
    WaitObject,
    ib_access_t,
    ib_alloc_pd,
    ib_cq_create_t,
    ib_create_cq,
    ib_create_qp,
    ib_local_ds_t,
    ib_mr_create_t,
    ib_poll_cq,
    ib_post_recv,
    ib_qp_create_t,
    ib_recv_wr_t,
    ib_reg_mem,
    ib_send_wr_t,
    ib_wc_t,
    link,
    wc_list,
)
from rdmashim.registry import load_backend

E = CMEventType
HOST = "127.0.0.1"
WAIT = 10.0
"""Seconds any wait of these tests may take (they take milliseconds)."""
RW = ib_access_t.IB_AC_LOCAL_WRITE | ib_access_t.IB_AC_RDMA_WRITE | ib_access_t.IB_AC_RDMA_READ


def loopback_guid(al: IbAl) -> int:
    """The node GUID of the device on the loopback interface (where 127.0.0.1 routes)."""
    devices = load_backend(al.hca_backend).get_device_list()
    for dev in devices:
        if getattr(dev, "netdev", "") in ("lo", "lo0"):
            return dev.node_guid
    pytest.skip(f"no {al.hca_backend} device on the loopback interface")


class Completions:
    """A CQ's completion callbacks, counted; ``wait(n)`` waits for the n-th."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, str]] = []
        self._cond = threading.Condition()

    def __call__(self, h_cq: IbCq, cq_context: Any) -> None:
        with self._cond:
            self.calls.append((h_cq, cq_context, threading.current_thread().name))
            self._cond.notify_all()

    def wait(self, n: int, timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.calls) >= n, timeout)


@dataclass(eq=False)
class End:
    """One side: PD, a CQ (with a callback or a wait object), a QP and a 4 KiB region."""

    pd: IbPd
    cq: IbCq
    qp: IbQp
    buf: bytearray
    lkey: int
    rkey: int
    mr: Any
    comp: Completions | None = None
    wait_obj: WaitObject | None = None
    events: list[Any] = field(default_factory=list)

    @property
    def vaddr(self) -> int:
        return self.mr.vaddr


def make_end(
    ca: IbCa,
    *,
    wait_object: bool = False,
    comp_cb: Callable[[IbCq, Any], None] | None = None,
    size: int = 64,
    **create: Any,
) -> End:
    """PD, CQ (with ``comp_cb``, else a :class:`Completions`, or a wait object), unbound QP
    and a registered 4 KiB buffer on ``ca``."""
    pd = ib_alloc_pd(ca)
    comp = None if wait_object or comp_cb else Completions()
    wait_obj = WaitObject() if wait_object else None
    events: list[Any] = []
    cq = ib_create_cq(ca, ib_cq_create_t(size, comp_cb or comp, wait_obj), "cq-ctx", events.append)
    attrs = {"sq_depth": 32, "rq_depth": 32, **create}
    qp = ib_create_qp(pd, ib_qp_create_t(h_sq_cq=cq, h_rq_cq=cq, **attrs), "qp-ctx", events.append)
    buf = bytearray(4096)
    lkey, rkey, mr = ib_reg_mem(pd, ib_mr_create_t(buf, len(buf), RW))
    return End(pd, cq, qp, buf, lkey, rkey, mr, comp, wait_obj, events)


async def _keep_connected(
    ca: IbCa, client: IbQp, server: IbQp, accept: Callable[[], None] | None, *, task_status: Any
) -> None:
    async with EventChannel(contexts=[ca.context], backend=ca.al.hca_backend) as channel:
        events = Events(channel)
        listener = channel.create_id()
        listener.bind_addr((HOST, 0))
        listener.listen()
        active = channel.create_id()
        active.resolve_addr(None, (HOST, listener.local_addr[1]))
        await events.expect(active, E.ADDR_RESOLVED)
        active.resolve_route()
        await events.expect(active, E.ROUTE_RESOLVED)
        client.bind(active)
        active.connect(ConnParam())
        request = await events.request(WAIT)
        passive = request.id
        server.bind(passive)
        if accept is not None:
            accept()
        passive.accept(ConnParam())
        await events.expect(active, E.ESTABLISHED)
        await events.expect(passive, E.ESTABLISHED)
        task_status.started()
        await trio.sleep_forever()  # the AL's close ends the connection


def connect(
    ca: IbCa, client: IbQp, server: IbQp, before_accept: Callable[[], None] | None = None
) -> None:
    """Connect ``client`` to ``server`` through the CM (see the module docstring)."""
    al = ca.al

    async def start() -> None:
        assert al.nursery is not None
        with trio.fail_after(WAIT):
            await al.nursery.start(_keep_connected, ca, client, server, before_accept)

    al.run_async(start)


def ds(end: End, offset: int = 0, length: int = 64) -> ib_local_ds_t:
    """A data segment over ``[offset, offset + length)`` of the end's region."""
    return ib_local_ds_t(end.vaddr + offset, length, end.lkey)


def recv(wr_id: int, *segments: ib_local_ds_t) -> ib_recv_wr_t:
    return ib_recv_wr_t(wr_id=wr_id, ds_array=list(segments))


def send(wr_id: int, *segments: ib_local_ds_t, **fields: Any) -> ib_send_wr_t:
    return ib_send_wr_t(wr_id=wr_id, ds_array=list(segments), **fields)


def poll_n(cq: IbCq, n: int, timeout: float = WAIT) -> list[ib_wc_t]:
    """Exactly ``n`` completions from ``cq``, polled one free entry at a time."""
    out: list[ib_wc_t] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        status, free, done = ib_poll_cq(cq, wc_list(1))
        if status is IbStatus.IB_SUCCESS:
            assert free is None and done is not None
            out.append(done)
        elif time.monotonic() > deadline:
            raise AssertionError(f"{len(out)} of {n} completions after {timeout} s")
        else:
            time.sleep(0.001)
    return out


def connected_pair(ca: IbCa, server_cb: Any = None, **create: Any) -> tuple[End, End]:
    """Two ends on ``ca``, the client connected to the server (which posted 8 receives of
    64 bytes first, wr_ids 100..107; ``server_cb`` is its CQ's callback if given)."""
    client, server = make_end(ca, **create), make_end(ca, comp_cb=server_cb, **create)
    ib_post_recv(server.qp, link([recv(100 + i, ds(server, 64 * i)) for i in range(8)]))
    connect(ca, client.qp, server.qp)
    return client, server


def error_of(call: Callable[[], object]) -> IbError:
    """The :class:`IbError` ``call()`` raises (the test fails if it raises none)."""
    with pytest.raises(IbError) as info:
        call()
    return info.value


def status_of(call: Callable[[], object]) -> IbStatus:
    """The status of the :class:`IbError` ``call()`` raises."""
    return error_of(call).status
