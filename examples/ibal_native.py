"""An IBAL program, written as for WinOF, talking to a peer written with the portable API.

The IBAL side is what a WinOF developer writes: synchronous calls, results through
callbacks on the access layer's callback thread, linked lists of work requests and
work completions. It opens the AL and the CA the path leaves from (IBAT names it),
registers memory, makes a CQ whose completion callback polls a linked free list of
``ib_wc_t``, re-arms and polls again, and a QP; it posts its receives before it
connects with the IB CM (``ib_cm_req``; REP callback -> ``ib_cm_rtu``), sends
``--count`` messages of ``--size`` bytes as one linked chain, then an RDMA Write into
and an RDMA Read from the peer's region and a last Send, disconnects (``ib_cm_dreq``;
DREP callback) and destroys everything with destroy callbacks.

The portable side runs in a thread of its own with its own trio loop, over the
built-in engine: ``rdmashim.cm.serve`` offers its region (address, rkey, length) in
the accept's private data, checks every byte the IBAL side sent and wrote, and
answers. With ``--listen`` the roles of the connection swap: the IBAL side listens
(``ib_cm_listen``; REQ callback -> ``ib_cm_rep``) and the portable side connects with
``rdmashim.cm.open_connection`` and offers its region in its first Send (on iWARP the
active side sends first). Either way the IBAL side moves the data and the portable
side checks it::

    python3 examples/ibal_native.py                       # 127.0.0.1, a free port
    python3 examples/ibal_native.py --listen --size 64K --count 32
    RDMASHIM_IBAL_HCA=rdmacore python3 examples/ibal_native.py --host 10.0.2.15

(the last one runs the IBAL side over a kernel siw device through rdma-core).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import random
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from rdmashim import Access, RecvWR, SendWR, WCOpcode, WROpcode
from rdmashim.cliargs import Parser, host, integer, port, run_command, size
from rdmashim.cm import open_connection, serve
from rdmashim.providers.ibal import (
    IbAl,
    IbCq,
    IbStatus,
    ib_access_t,
    ib_alloc_pd,
    ib_async_event_rec_t,
    ib_close_al,
    ib_close_ca,
    ib_cm_cancel,
    ib_cm_drep,
    ib_cm_drep_rec_t,
    ib_cm_drep_t,
    ib_cm_dreq,
    ib_cm_dreq_rec_t,
    ib_cm_dreq_t,
    ib_cm_listen,
    ib_cm_listen_t,
    ib_cm_rej_rec_t,
    ib_cm_rep,
    ib_cm_rep_rec_t,
    ib_cm_rep_t,
    ib_cm_req,
    ib_cm_req_rec_t,
    ib_cm_req_t,
    ib_cm_rtu,
    ib_cm_rtu_rec_t,
    ib_cm_rtu_t,
    ib_cq_create_t,
    ib_create_cq,
    ib_create_qp,
    ib_dealloc_pd,
    ib_dereg_mr,
    ib_destroy_cq,
    ib_destroy_qp,
    ib_get_ca_guids,
    ib_local_ds_t,
    ib_mr_create_t,
    ib_open_al,
    ib_open_ca,
    ib_poll_cq,
    ib_post_recv,
    ib_post_send,
    ib_qp_create_t,
    ib_query_ca,
    ib_rearm_cq,
    ib_recv_wr_t,
    ib_reg_mem,
    ib_remote_ops_t,
    ib_send_opt_t,
    ib_send_wr_t,
    ib_sync_destroy,
    ib_wc_status_t,
    ib_wc_t,
    ib_wr_type_t,
    ibat_query_path,
    link,
    walk,
)

PROG = "ibal_native.py"
WAIT = 30.0
"""Seconds any single step may take before the example gives up."""
RDMA_CM_TCP_SERVICE = 0x0000000001060000
"""rdma_cm's service ID for the TCP port space; OR the port into it (IBAL and rdma_cm meet)."""
OFFER = struct.Struct("!QII")
"""The portable side's region for RDMA: address, rkey, length."""
REPLY_LEN = 128
IBAL_PDATA = b"IBAL here"
"""The IBAL side's private data (in its REQ, or with ``--listen`` its REP)."""
DONE = b"done"
WC_BATCH = 8
"""Entries of the IBAL side's free list of work completions."""

# wr_ids of the IBAL side
WR_WRITE, WR_READ, WR_DONE, WR_RECV_REPLY, WR_RECV_OFFER, WR_SEND = 1, 2, 3, 10, 11, 0x100
# seeds of the data patterns; message i uses seed i
WRITE_SEED, READ_SEED = 1_000_001, 1_000_002


def pattern(length: int, seed: int) -> bytes:
    """``length`` bytes both sides can compute from ``seed``."""
    return random.Random(seed).randbytes(length)


class Failure(Exception):
    """Something the example checks went wrong; its message is the one line printed."""


# ============================================================================ the IBAL side
def reports_failure(callback: Callable[..., None]) -> Callable[..., None]:
    """A callback of :class:`IbalSide` whose exception fails the run instead of being lost."""

    @functools.wraps(callback)
    def guarded(self: IbalSide, *args: Any) -> None:
        try:
            callback(self, *args)
        except Exception as exc:  # every IbError and more: the main thread reports it
            self.fail(exc)

    return guarded


class IbalSide:
    """The IBAL program: its handles, its buffers, and what its callbacks have seen.

    The callbacks run on the AL's callback thread and record into this object under
    ``cond``; the main thread waits on it (:meth:`wait`).
    """

    def __init__(self, host: str, size: int, count: int) -> None:
        self.host, self.size, self.count = host, size, count
        self.cond = threading.Condition()
        self.failure: BaseException | None = None
        self.completions: dict[int, ib_wc_t] = {}
        self.comp_callbacks = 0
        self.events: list[str] = []  # the CM callbacks, in order (and the peer listening)
        self.destroyed: list[str] = []
        self.peer_pdata = b""
        self.wcs = [ib_wc_t() for _ in range(WC_BATCH)]  # reused, relinked at each poll
        self.h_al: IbAl | None = None
        # the IBAL side's memory: messages out, the reply (and offer) in, RDMA both ways
        self.out = bytearray(b"".join(pattern(size, i) for i in range(count)) + DONE)
        self.inbox = bytearray(2 * REPLY_LEN)
        self.rdma = bytearray(pattern(size, WRITE_SEED) + bytes(size))

    # ------------------------------------------------------------------ waiting
    def fail(self, exc: BaseException) -> None:
        """End the run with ``exc`` (from any thread; the first failure wins)."""
        with self.cond:
            self.failure = self.failure or exc
            self.cond.notify_all()

    def wait(self, what: str, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``; a failure meanwhile, or WAIT seconds, ends the run."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.failure is not None or ready(), WAIT):
                raise Failure(f"IBAL side: no {what} within {WAIT:g} s")
            if self.failure is not None:
                raise self.failure

    def wait_for_wr_ids(self, what: str, *wr_ids: int) -> None:
        self.wait(what, lambda: all(wr_id in self.completions for wr_id in wr_ids))

    def wait_for_event(self, name: str) -> None:
        self.wait(name, lambda: name in self.events)

    # ------------------------------------------------------------------ callbacks
    @reports_failure
    def on_async_event(self, rec: ib_async_event_rec_t) -> None:
        """The CA's, CQ's and QP's event callback: any event ends this run."""
        raise Failure(f"IBAL side: {rec.code.name} on the {rec.context}")

    @reports_failure
    def on_completion(self, h_cq: IbCq, cq_context: Any) -> None:
        """The CQ's completion callback: poll, re-arm, poll again (a completion that came
        between the last poll and the re-arm raised no callback)."""
        self.comp_callbacks += 1
        self.poll(h_cq)
        ib_rearm_cq(h_cq, False)
        self.poll(h_cq)

    def poll(self, h_cq: IbCq) -> None:
        while True:
            status, _, done = ib_poll_cq(h_cq, link(self.wcs))
            if status == IbStatus.IB_NOT_FOUND:
                return
            with self.cond:
                for wc in walk(done):
                    if wc.status != ib_wc_status_t.IB_WCS_SUCCESS:
                        raise Failure(f"IBAL side: work request {wc.wr_id}: {wc.status.name}")
                    # the entry goes back to the free list: keep a copy
                    self.completions[wc.wr_id] = ib_wc_t(
                        wr_id=wc.wr_id, wc_type=wc.wc_type, length=wc.length, status=wc.status
                    )
                self.cond.notify_all()

    def record(self, name: str) -> None:
        with self.cond:
            self.events.append(name)
            self.cond.notify_all()

    @reports_failure
    def on_req(self, rec: ib_cm_req_rec_t) -> None:
        """A connection request at our listen: accept it on our QP (``--listen``)."""
        self.peer_pdata = rec.p_req_pdata
        rep = ib_cm_rep_t(
            self.h_qp,
            IBAL_PDATA,
            pfn_cm_rtu_cb=self.on_rtu,
            pfn_cm_rej_cb=self.on_rej,
            pfn_cm_dreq_cb=self.on_dreq,
        )
        ib_cm_rep(rec.h_cm_req, rep)
        self.record("REQ callback")

    @reports_failure
    def on_rep(self, rec: ib_cm_rep_rec_t) -> None:
        """Our request was accepted: the REP brings the peer's offer; answer with the RTU."""
        self.peer_pdata = rec.p_rep_pdata
        ib_cm_rtu(rec.h_cm_rep, ib_cm_rtu_t(pfn_cm_dreq_cb=self.on_dreq))
        self.record("REP callback")

    @reports_failure
    def on_rtu(self, rec: ib_cm_rtu_rec_t) -> None:
        self.record("RTU callback")

    @reports_failure
    def on_rej(self, rec: ib_cm_rej_rec_t) -> None:
        why = f" ({rec.p_rej_pdata!r})" if rec.p_rej_pdata else ""
        raise Failure(f"IBAL side: connection rejected: {rec.rej_status.name}{why}")

    @reports_failure
    def on_dreq(self, rec: ib_cm_dreq_rec_t) -> None:
        """The peer disconnects: answer with the DREP."""
        ib_cm_drep(rec.h_cm_dreq, ib_cm_drep_t())
        self.record("DREQ callback")

    @reports_failure
    def on_drep(self, rec: ib_cm_drep_rec_t) -> None:
        if rec.cm_status != IbStatus.IB_SUCCESS:
            raise Failure(f"IBAL side: disconnection: {rec.cm_status.name}")
        self.record("DREP callback")

    @reports_failure
    def on_destroyed(self, context: Any) -> None:
        with self.cond:
            self.destroyed.append(context)
            self.cond.notify_all()

    # ------------------------------------------------------------------ the program
    def open(self) -> None:
        """AL, CA (the one IBAT's path leaves from), PD, memory, CQ and QP; receives posted."""
        self.h_al = h_al = ib_open_al()
        self.hca_backend = h_al.hca_backend
        self.path = ibat_query_path(None, self.host, hca_backend=h_al.hca_backend)
        if self.path.ca_guid not in ib_get_ca_guids(h_al):
            raise Failure(f"IBAL side: no {h_al.hca_backend} CA on {self.path.ifname}")
        self.h_ca = ib_open_ca(h_al, self.path.ca_guid, self.on_async_event, "CA")
        attr = ib_query_ca(self.h_ca)
        depth = self.count + 3  # the Sends, the Write, the Read and "done"
        max_msg = attr.p_port_attr[0].max_msg_size
        if depth > attr.max_wrs or self.size > max_msg:
            raise Failure(
                f"IBAL side: {self.h_ca.device_name} takes {attr.max_wrs} work "
                f"requests of at most {max_msg} bytes"
            )
        self.h_pd = ib_alloc_pd(self.h_ca)
        rw = ib_access_t.IB_AC_LOCAL_WRITE
        self.out_lkey, _, self.h_out = ib_reg_mem(
            self.h_pd, ib_mr_create_t(self.out, len(self.out), rw)
        )
        self.in_lkey, _, self.h_in = ib_reg_mem(
            self.h_pd, ib_mr_create_t(self.inbox, len(self.inbox), rw)
        )
        self.rdma_lkey, _, self.h_rdma = ib_reg_mem(
            self.h_pd, ib_mr_create_t(self.rdma, len(self.rdma), rw)
        )
        create = ib_cq_create_t(depth + 2, self.on_completion)
        self.h_cq = ib_create_cq(self.h_ca, create, "CQ", self.on_async_event)
        ib_rearm_cq(self.h_cq, False)
        self.h_qp = ib_create_qp(
            self.h_pd,
            ib_qp_create_t(sq_depth=depth, rq_depth=2, h_sq_cq=self.h_cq, h_rq_cq=self.h_cq),
            "QP",
            self.on_async_event,
        )

    def post_receives(self, offer_first: bool) -> None:
        """Before connecting, as IBAL programs must: the reply (after the offer, if asked)."""
        self.reply_slot = int(offer_first)
        wrs = [
            ib_recv_wr_t(wr_id=wr_id, ds_array=[self.inbox_ds(slot)])
            for slot, wr_id in enumerate([WR_RECV_OFFER] * offer_first + [WR_RECV_REPLY])
        ]
        ib_post_recv(self.h_qp, link(wrs))

    def inbox_ds(self, slot: int) -> ib_local_ds_t:
        return ib_local_ds_t(self.h_in.vaddr + slot * REPLY_LEN, REPLY_LEN, self.in_lkey)

    def received(self, wr_id: int, slot: int) -> bytes:
        start = slot * REPLY_LEN
        return bytes(self.inbox[start : start + self.completions[wr_id].length])

    def connect(self, port: int, pdata: bytes) -> tuple[int, int]:
        """``ib_cm_req`` to the portable server; returns its offer (address, rkey)."""
        ib_cm_req(
            ib_cm_req_t(
                RDMA_CM_TCP_SERVICE | port,
                self.h_qp,
                self.path,
                pfn_cm_rep_cb=self.on_rep,
                pfn_cm_rej_cb=self.on_rej,
                p_req_pdata=pdata,
                timeout_ms=int(WAIT * 1000),
            )
        )
        self.wait_for_event("REP callback")
        return self.offer(self.peer_pdata, "accept private data")

    def listen(self, port: int) -> None:
        """``ib_cm_listen`` on the CA at ``port``'s service ID (the REQ callback accepts)."""
        info = ib_cm_listen_t(
            RDMA_CM_TCP_SERVICE | port, ca_guid=self.h_ca.guid, pfn_cm_req_cb=self.on_req
        )
        self.h_listen = ib_cm_listen(self.h_al, info, "listen")

    def accepted(self) -> tuple[int, int]:
        """After the RTU: the portable client's first Send, its offer."""
        self.wait_for_event("RTU callback")
        self.wait_for_wr_ids("offer from the portable client", WR_RECV_OFFER)
        return self.offer(self.received(WR_RECV_OFFER, 0), "first message")

    def offer(self, data: bytes, where: str) -> tuple[int, int]:
        """The peer's region (address, rkey) from its offer, checked for size."""
        if len(data) < OFFER.size:
            raise Failure(f"IBAL side: the peer's {where} holds no region ({data!r})")
        vaddr, rkey, length = OFFER.unpack_from(data)
        if length < 2 * self.size:
            raise Failure(f"IBAL side: the peer offers {length} bytes, {2 * self.size} needed")
        return vaddr, rkey

    def transfer(self, vaddr: int, rkey: int) -> bytes:
        """The Sends as one chain, then Write, Read and "done" as another; the peer's reply."""
        size, lkey = self.size, self.out_lkey
        sends = [
            ib_send_wr_t(
                wr_id=WR_SEND + i,
                ds_array=[ib_local_ds_t(self.h_out.vaddr + i * size, size, lkey)],
                wr_type=ib_wr_type_t.WR_SEND,
                send_opt=ib_send_opt_t.IB_SEND_OPT_SIGNALED,
            )
            for i in range(self.count)
        ]
        ib_post_send(self.h_qp, link(sends))
        rdma_ds = functools.partial(ib_local_ds_t, length=size, lkey=self.rdma_lkey)
        chain = [
            ib_send_wr_t(
                wr_id=WR_WRITE,
                ds_array=[rdma_ds(self.h_rdma.vaddr)],
                wr_type=ib_wr_type_t.WR_RDMA_WRITE,
                remote_ops=ib_remote_ops_t(vaddr, rkey),
            ),
            ib_send_wr_t(
                wr_id=WR_READ,
                ds_array=[rdma_ds(self.h_rdma.vaddr + size)],
                wr_type=ib_wr_type_t.WR_RDMA_READ,
                remote_ops=ib_remote_ops_t(vaddr + size, rkey),
            ),
            ib_send_wr_t(
                wr_id=WR_DONE,
                ds_array=[ib_local_ds_t(self.h_out.vaddr + self.count * size, len(DONE), lkey)],
            ),
        ]
        ib_post_send(self.h_qp, link(chain))
        sent = [WR_SEND + i for i in range(self.count)]
        self.wait_for_wr_ids("completions of the sends", *sent, WR_WRITE, WR_READ, WR_DONE)
        if bytes(self.rdma[size:]) != pattern(size, READ_SEED):
            raise Failure("IBAL side: the RDMA Read brought other bytes than the peer's")
        self.wait_for_wr_ids("reply from the portable side", WR_RECV_REPLY)
        return self.received(WR_RECV_REPLY, self.reply_slot)

    def disconnect(self) -> None:
        """``ib_cm_dreq``; the DREP callback says the connection is over."""
        ib_cm_dreq(ib_cm_dreq_t(self.h_qp, pfn_cm_drep_cb=self.on_drep))
        self.wait_for_event("DREP callback")

    def close(self) -> None:
        """Destroy what was made, children first, with destroy callbacks; close the AL."""
        ib_destroy_qp(self.h_qp, self.on_destroyed)
        ib_destroy_cq(self.h_cq, self.on_destroyed)
        self.wait("destroy callbacks", lambda: {"QP", "CQ"} <= set(self.destroyed))
        for h_mr in (self.h_out, self.h_in, self.h_rdma):
            ib_dereg_mr(h_mr)
        ib_dealloc_pd(self.h_pd, ib_sync_destroy)
        ib_close_ca(self.h_ca, ib_sync_destroy)
        self.close_al()

    def close_al(self) -> None:
        """``ib_close_al`` (it destroys whatever is left); once."""
        if self.h_al is not None:
            h_al, self.h_al = self.h_al, None
            ib_close_al(h_al)


# ============================================================================ the portable side
@dataclass
class Checker:
    """The portable side's memory: receives for the IBAL side's messages, and the region it
    offers (the Write's target, then the Read's source)."""

    size: int
    count: int
    msgs: Any
    region: Any
    notes: Any
    """What this side sends: its offer (``--listen``) and its verdict."""

    @classmethod
    def prepare(cls, pd: Any, qp: Any, size: int, count: int) -> Checker:
        """Register and post the receives (before the connection is up)."""
        msgs = pd.reg_mr(bytearray(count * size + REPLY_LEN), Access.LOCAL_WRITE)
        rw = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
        region = pd.reg_mr(bytearray(bytes(size) + pattern(size, READ_SEED)), rw)
        qp.post_recv([RecvWR(i, [msgs.sge(i * size, size)]) for i in range(count)])
        qp.post_recv(RecvWR(count, [msgs.sge(count * size, REPLY_LEN)]))
        return cls(size, count, msgs, region, pd.reg_mr(bytearray(REPLY_LEN), Access.LOCAL_WRITE))

    def send_note(self, qp: Any, wr_id: int, note: bytes) -> None:
        self.notes.buf[: len(note)] = note
        qp.post_send(SendWR(wr_id, WROpcode.SEND, [self.notes.sge(0, len(note))]))

    def offer(self) -> bytes:
        return OFFER.pack(self.region.iova, self.region.rkey, 2 * self.size)

    async def check(self, conn: Any) -> str:
        """Wait for the messages and "done"; compare every byte; send the verdict back."""
        size, count = self.size, self.count
        received = await completions(conn.recv_cq, set(range(count + 1)), WCOpcode.RECV)
        bad = [i for i in range(count) if received[i] != size]
        bad += [
            i for i in range(count) if self.msgs.buf[i * size : (i + 1) * size] != pattern(size, i)
        ]
        if bytes(self.msgs.buf[count * size : count * size + received[count]]) != DONE:
            verdict = "bad: no 'done' last"
        elif bad:
            verdict = f"bad: messages {sorted(set(bad))} differ"
        elif bytes(self.region.buf[:size]) != pattern(size, WRITE_SEED):
            verdict = "bad: the RDMA Write placed other bytes"
        else:
            verdict = f"ok: {count} x {size} B and the Write verified"
        self.send_note(conn.qp, count + 1, verdict.encode()[:REPLY_LEN])
        await completions(conn.send_cq, {count + 1}, WCOpcode.SEND)
        return verdict


async def completions(cq: Any, wr_ids: set[int], opcode: WCOpcode) -> dict[int, int]:
    """Wait for the completions of ``wr_ids`` (of ``opcode``); their byte counts."""
    got: dict[int, int] = {}
    with trio.move_on_after(WAIT):
        while not wr_ids <= got.keys():
            for wc in await cq.poll_wait():
                wc.raise_for_status()
                if wc.opcode == opcode:
                    got[wc.wr_id] = wc.byte_len
        return got
    raise Failure(f"portable side: {len(wr_ids - got.keys())} completions missing after {WAIT:g} s")


class PortablePeer:
    """The portable side: a thread of its own running a trio loop over the built-in engine."""

    def __init__(self, ibal: IbalSide) -> None:
        self.ibal = ibal
        self.report: dict[str, Any] = {}
        self.port = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._stopping = False
        self._lock = threading.Lock()  # stop() and the loop's start do not cross
        self._thread = threading.Thread(target=self._main, name="portable-peer", daemon=True)
        self._target: Callable[[], Any] = self._serve

    def serve(self, host: str, port: int) -> int:
        """Start serving on ``host``:``port``; returns the port it listens on."""
        self.host, self.port = host, port
        self._thread.start()
        self.ibal.wait_for_event("portable server listening")
        return self.port

    def connect(self, host: str, port: int) -> None:
        """Start connecting to the IBAL side at ``host``:``port``."""
        self.host, self.port, self._target = host, port, self._connect
        self._thread.start()

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # reported by the main thread
            self.ibal.fail(exc)

    async def _run(self) -> None:
        with trio.CancelScope() as scope:
            with self._lock:
                if self._stopping:
                    return
                self._token, self._scope = trio.lowlevel.current_trio_token(), scope
            await self._target()

    async def _serve(self) -> None:
        async def handler(request: Any) -> None:
            self.report["private data"] = request.private_data
            checker = Checker.prepare(request.pd, request.qp, self.ibal.size, self.ibal.count)
            conn = await request.accept(private_data=checker.offer())
            self.report["verdict"] = await checker.check(conn)
            await conn.wait_disconnected()  # the IBAL side's DREQ
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            start = functools.partial(
                serve, handler, self.port, host=self.host, backend="softiwarp"
            )
            self.port = (await nursery.start(start))[1]
            self.ibal.record("portable server listening")

    async def _connect(self) -> None:
        size, count = self.ibal.size, self.ibal.count
        checkers: list[Checker] = []

        def prepare(conn: Any) -> None:  # may run again for a new attempt
            checkers[:] = [Checker.prepare(conn.pd, conn.qp, size, count)]

        async with open_connection(
            self.host,
            self.port,
            private_data=b"portable here",
            prepare=prepare,
            backend="softiwarp",
            connect_timeout=WAIT,
        ) as conn:
            (checker,) = checkers
            self.report["private data"] = conn.private_data
            checker.send_note(conn.qp, count + 2, checker.offer())  # the active side sends first
            self.report["verdict"] = await checker.check(conn)
        # leaving the block disconnects: the IBAL side's DREQ callback answers

    def stop(self) -> None:
        """Cancel the loop if it still runs, and wait for the thread (boundedly)."""
        with self._lock:
            self._stopping = True
            if self._token is not None and self._scope is not None:
                with contextlib.suppress(trio.RunFinishedError):  # it ended already
                    self._token.run_sync_soon(self._scope.cancel)
        if self._thread.is_alive():
            self._thread.join(WAIT)

    def join(self) -> None:
        self._thread.join(WAIT)
        if self._thread.is_alive():
            raise Failure(f"portable side: still running after {WAIT:g} s")


# ============================================================================ the run
def run(host: str, port: int, size: int, count: int, listen: bool) -> int:
    started = time.monotonic()
    ibal = IbalSide(host, size, count)
    peer = PortablePeer(ibal)
    try:
        ibal.open()
        where = f"{ibal.h_ca.device_name} ({ibal.hca_backend})"
        if listen:
            port = port or free_port(host)
            ibal.post_receives(offer_first=True)
            ibal.listen(port)
            peer.connect(host, port)
            print(f"IBAL server on {where} at {host} port {port}, portable client", flush=True)
            vaddr, rkey = ibal.accepted()
            reply = ibal.transfer(vaddr, rkey)
            ibal.wait_for_event("DREQ callback")  # the portable client leaves when it has checked
            ib_cm_cancel(ibal.h_listen, ib_sync_destroy)
            connected = f"REQ callback ({ibal.peer_pdata!r}) -> ib_cm_rep -> RTU callback"
            offered, ended = "its first Send", "the peer's DREQ -> ib_cm_drep"
        else:
            port = peer.serve(host, port)
            print(f"IBAL client on {where}, portable server at {host} port {port}", flush=True)
            ibal.post_receives(offer_first=False)
            vaddr, rkey = ibal.connect(port, IBAL_PDATA)
            reply = ibal.transfer(vaddr, rkey)
            ibal.disconnect()
            connected = "ib_cm_req -> REP callback -> ib_cm_rtu"
            offered, ended = "the REP's private data", "ib_cm_dreq -> DREP callback"
        ibal.close()
        peer.join()
        if ibal.failure is not None:
            raise ibal.failure
    finally:
        peer.stop()
        ibal.close_al()
    verdict = reply.decode(errors="replace")
    print(f"  connected: {connected}")
    print(f"  private data: IBAL sent {IBAL_PDATA!r}, the peer got {peer.report['private data']!r}")
    print(f"  the peer's region: {vaddr:#x} rkey {rkey:#x}, offered in {offered}")
    print(
        f"  sent: {count} x {size} B in one linked chain; RDMA Write, RDMA Read, 'done' in another"
    )
    print(
        f"  completions: {len(ibal.completions)} through {ibal.comp_callbacks} completion "
        "callbacks (each: ib_poll_cq, ib_rearm_cq, ib_poll_cq)"
    )
    print(f"  checked: the RDMA Read's {size} B here; the portable side says {verdict!r}")
    print(f"  closed: {ended}; destroyed QP, CQ (callbacks), PD, CA (ib_sync_destroy); AL closed")
    if not verdict.startswith("ok") or peer.report.get("verdict") != verdict:
        raise Failure(f"the portable side found a difference: {verdict}")
    role = "IBAL server <- portable client" if listen else "IBAL client -> portable server"
    print(f"OK: every byte verified ({role}) in {time.monotonic() - started:.2f} s")
    return 0


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (IBAL listens at a service ID, never port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def local_host(text: str) -> str:
    """An argparse type: an address (or name) of this host; both sides run here."""
    address = host(text)
    try:
        free_port(address)
    except OSError:
        raise argparse.ArgumentTypeError(f"{text!r} is no address of this host") from None
    return address


def parse_args() -> dict[str, Any]:
    parser = Parser(
        prog=PROG,
        description="An IBAL-native program (WinOF style) and a portable-API peer, "
        "connected over the built-in engine.",
    )
    parser.add_argument(
        "--host",
        type=local_host,
        default="127.0.0.1",
        help="local address both sides use (default 127.0.0.1)",
    )
    parser.add_argument("--port", type=port, default=0, help="TCP port (default 0: a free one)")
    parser.add_argument(
        "--size",
        type=size(1, 1 << 20),
        default=4096,
        help="bytes per message and per RDMA operation (1 .. 1M, default 4096)",
    )
    parser.add_argument(
        "--count",
        type=integer(1, 100),
        default=8,
        help="messages the IBAL side sends (1 .. 100, default 8)",
    )
    parser.add_argument(
        "--listen",
        action="store_true",
        help="the IBAL side listens (ib_cm_listen), the portable side connects",
    )
    return vars(parser.parse_args())


if __name__ == "__main__":
    # One line on bad input or a failure, status 130 on Ctrl-C (rdmashim.cliargs).
    sys.exit(run_command(PROG, lambda: run(**parse_args())))
