"""``cq.set_native_handler``: a C function takes a CQ's completions inside the engine's
own calls, without Python (``docs/verbs.md``, "Native completion handlers").

A small handler is compiled here through cffi (the ABI as a C user declares it, not
from the engine's header) and set on the server's CQ of a real connection of the native
engine: it logs every completion, re-posts each receive through the verbs table it is
given, and asks for the CQ to be handed on when told to or when a completion failed.
The backends that call no native handler say so (False).
"""

from __future__ import annotations

import errno
import importlib
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from test_resources import BOUND, SIG, Pair, connected, drain

from rdmashim import (
    SGE,
    Access,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    VerbsError,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.cm import ConnectionRequest
from rdmashim.providers.softiwarp import native
from rdmashim.verbs import native as verbs_native

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE, reason=f"native engine unavailable: {native.WHY_NOT}"
)

DECLARATIONS = """
typedef struct { uint64_t wr_id; uint32_t status, opcode, byte_len, qp_num, wc_flags,
                 invalidated_rkey, solicited; } row;
typedef struct { uint64_t wr_id; uint64_t addr; uint32_t length; uint32_t lkey; } recv;
typedef struct { uint64_t wr_id; uint64_t addr; uint32_t length, lkey, flags, opcode;
                 uint64_t remote_addr; uint32_t rkey; } send;
typedef struct {
    row log[1024];
    uint32_t logged;
    recv table[16];
    uint32_t repost;        /* re-post each receive from table[wr_id] */
    uint32_t want_always;
    uint32_t calls;
    uint32_t reposted;
    uint32_t qp_num;
    send staged[4];         /* Sends to post when it runs next */
    uint32_t nstaged;
    uint32_t sent;          /* of those, how many post_send took */
} ctx;
uintptr_t handler_address(void);
void abi(uint64_t *out);
"""
SOURCE = """
#include "native_handler.h"
#include <stddef.h>
typedef rdmashim_row row;
typedef rdmashim_recv recv;
typedef rdmashim_send send;
typedef rdmashim_verbs verbs;
typedef struct {
    row log[1024];
    uint32_t logged;
    recv table[16];
    uint32_t repost;
    uint32_t want_always;
    uint32_t calls;
    uint32_t reposted;
    uint32_t qp_num;
    send staged[4];
    uint32_t nstaged;
    uint32_t sent;
} ctx;

void abi(uint64_t *out)
{
    out[0] = sizeof(rdmashim_row);
    out[1] = sizeof(rdmashim_recv);
    out[2] = sizeof(rdmashim_send);
    out[3] = offsetof(rdmashim_send, flags);
    out[4] = offsetof(rdmashim_verbs, post_send);
    out[5] = offsetof(rdmashim_send, opcode);
    out[6] = offsetof(rdmashim_send, remote_addr);
    out[7] = offsetof(rdmashim_send, rkey) | (uint64_t)RDMASHIM_RDMA_WRITE << 32
             | (uint64_t)RDMASHIM_RDMA_READ << 40;
}

static uint32_t handler(void *context, const verbs *v, void *cq, void *qp, uint32_t qp_num)
{
    ctx *c = context;
    row rows[8];
    uint32_t n, want = c->want_always;
    c->calls++;
    c->qp_num = qp_num;
    if (c->nstaged) {
        c->sent += v->post_send(qp, c->staged, c->nstaged);
        c->nstaged = 0;
    }
    while ((n = v->poll(cq, rows, 8)) != 0) {
        for (uint32_t i = 0; i < n; i++) {
            if (c->logged < 1024)
                c->log[c->logged++] = rows[i];
            if (rows[i].status != 0)
                want = 1;
            else if (c->repost && rows[i].opcode == 128 && rows[i].wr_id < 16
                     && v->post_recv(qp, &c->table[rows[i].wr_id], 1) == 1)
                c->reposted++;
        }
    }
    return want;
}

uintptr_t handler_address(void) { return (uintptr_t)handler; }
"""
RECVS = 4
SLOT = 64


@pytest.fixture(scope="module")
def handler_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The compiled handler (cffi, API mode; the engine's own build needs a compiler
    too, so where it is built, this is)."""
    from cffi import FFI

    directory = tmp_path_factory.mktemp("native_handler")
    ffi = FFI()
    ffi.cdef(DECLARATIONS)
    ffi.set_source("_test_native_handler", SOURCE, include_dirs=[verbs_native.INCLUDE_DIR])
    ffi.compile(tmpdir=str(directory), verbose=False)
    sys.path.insert(0, str(directory))
    try:
        yield importlib.import_module("_test_native_handler")
    finally:
        sys.path.remove(str(directory))


@pytest.fixture(autouse=True)
def native_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMASHIM_ENGINE", "native")


class Hooked:
    """The server's side: its receive buffers, the handler's context, what Python saw."""

    def __init__(
        self, module: Any, request: ConnectionRequest, *, repost: bool, solicited: bool
    ) -> None:
        self.ffi, self.lib = module.ffi, module.lib
        self.ctx = self.ffi.new("ctx *")
        self.mr = request.pd.reg_mr(bytearray(SLOT * RECVS), Access.LOCAL_WRITE)
        for i in range(RECVS):
            sge = self.mr.sge(i * SLOT, SLOT)
            self.ctx.table[i] = (i, sge.addr, sge.length, sge.lkey)
        self.ctx.repost = repost
        self.solicited = solicited
        self.handled: list[int] = []
        self.cq = request.qp.recv_cq
        assert request.qp.send_cq is self.cq
        self.cq.set_handler(self._python)
        self.cq.req_notify(solicited)
        request.qp.post_recv([RecvWR(i, [self.mr.sge(i * SLOT, SLOT)]) for i in range(RECVS)])
        address = int(self.lib.handler_address())
        assert self.cq.set_native_handler(address, int(self.ffi.cast("uintptr_t", self.ctx)), self)

    def _python(self, cq: Any) -> None:
        self.handled.append(len(cq.poll(64)))
        cq.req_notify(self.solicited)

    def log(self) -> list[tuple[int, int, int, int]]:
        c = self.ctx
        return [
            (c.log[i].wr_id, c.log[i].status, c.log[i].opcode, c.log[i].byte_len)
            for i in range(c.logged)
        ]


@asynccontextmanager
async def hooked_pair(
    module: Any, *, repost: bool = True, solicited: bool = False
) -> AsyncIterator[tuple[Pair, Hooked]]:
    made: list[Hooked] = []

    def prepare(request: ConnectionRequest) -> Hooked:
        made.append(Hooked(module, request, repost=repost, solicited=solicited))
        return made[0]

    async with connected(prepare=prepare, cap=QPCap(max_send_wr=64, max_recv_wr=RECVS)) as pair:
        yield pair, made[0]


async def send(pair: Pair, payloads: list[bytes]) -> None:
    """Send each payload from the client, signaled, and wait for their completions."""
    client = pair.client
    for i, payload in enumerate(payloads):
        mr = client.pd.reg_mr(payload, Access(0))
        client.qp.post_send(SendWR(i, WROpcode.SEND, [mr.sge()], SIG))
        with trio.fail_after(BOUND):
            (wc,) = await client.cq.poll_wait(1)
        assert wc.status == WCStatus.SUCCESS, wc
        mr.close()


async def until(check: Any) -> None:
    with trio.fail_after(BOUND):
        while not check():  # noqa: ASYNC110 - C fills the context; no event tells this
            await trio.sleep(0.001)


async def test_the_handler_takes_every_completion_and_reposts_without_python(
    handler_module: Any,
) -> None:
    """More messages than receives posted: the handler re-posts each through its table,
    so all arrive in order (the bytes in the buffer it named), and Python's handler never
    runs nor finds a completion to poll."""
    async with hooked_pair(handler_module) as (pair, hooked):
        payloads = [bytes([i]) * (i + 1) for i in range(3 * RECVS)]
        for k, payload in enumerate(payloads):
            await send(pair, [payload])
            await until(lambda k=k: hooked.ctx.logged == k + 1)
            slot = k % RECVS
            assert hooked.mr.buf[slot * SLOT : slot * SLOT + len(payload)] == payload
        assert hooked.log() == [
            (k % RECVS, 0, int(WCOpcode.RECV), len(p)) for k, p in enumerate(payloads)
        ]
        assert hooked.ctx.reposted == len(payloads)
        assert hooked.ctx.qp_num == pair.server.qp.qp_num
        assert hooked.handled == [] and len(hooked.cq) == 0 and hooked.cq.poll(8) == []


async def test_asking_hands_the_cq_to_the_python_handler(handler_module: Any) -> None:
    """A handler that asks (non-zero) has the CQ handed on as a reported completion: the
    Python handler, armed even for solicited completions only, runs (and finds nothing:
    the rows, of an unsolicited Send, were the native handler's)."""
    async with hooked_pair(handler_module, solicited=True) as (pair, hooked):
        hooked.ctx.want_always = 1
        await send(pair, [b"ask"])
        await until(lambda: hooked.handled)
        assert hooked.handled == [0] and hooked.ctx.logged == 1


async def test_failed_completions_reach_python_through_the_ask(handler_module: Any) -> None:
    """The connection ends: the flushed receives are the handler's rows, which fail, so it
    asks; Python's handler runs."""
    async with hooked_pair(handler_module, repost=False) as (pair, hooked):
        pair.server.qp.modify(qp_state=QPState.ERR)
        await until(lambda: hooked.handled)
        statuses = {row[1] for row in hooked.log()}
        assert statuses == {int(WCStatus.WR_FLUSH_ERR)}
        assert hooked.ctx.logged == RECVS


async def test_removed_or_closed_it_is_not_called_again(handler_module: Any) -> None:
    """Removed (0), completions go to Python again; on a closed CQ it is never called."""
    async with hooked_pair(handler_module) as (pair, hooked):
        await send(pair, [b"one"])
        await until(lambda: hooked.ctx.logged == 1)
        assert hooked.cq.set_native_handler(0, 0)
        await send(pair, [b"two"])
        await until(lambda: hooked.handled)
        assert hooked.handled == [1] and hooked.ctx.calls == 1
    async with hooked_pair(handler_module) as (pair, hooked):
        calls = hooked.ctx.calls
        hooked.cq.close()
        pair.server.qp.modify(qp_state=QPState.ERR)  # (flushes into the closed CQ's ring)
        await trio.sleep(0.05)
        assert hooked.ctx.calls == calls


def stage(
    hooked: Hooked, wr_id: int, sge: Any, flags: SendFlags, rdma: tuple[int, int, int] = (0, 0, 0)
) -> None:
    """Have the handler post this Send (or with ``rdma`` = (opcode, remote address, R_Key)
    an RDMA operation) when it runs next."""
    entry = (wr_id, sge.addr, sge.length, sge.lkey, int(flags), *rdma)
    hooked.ctx.staged[hooked.ctx.nstaged] = entry
    hooked.ctx.nstaged += 1


async def test_a_run_posts_what_the_handler_staged_and_writes_it(handler_module: Any) -> None:
    """``qp.run_native_handler()`` runs the handler now, with nothing to poll: the Sends it
    posts through its table go out in the same call (one inline: its bytes were copied
    when posted), and the signaled one's completion is the handler's own, in a later run."""
    async with hooked_pair(handler_module) as (pair, hooked):
        client = pair.client
        landing = client.pd.reg_mr(bytearray(2 * SLOT), Access.LOCAL_WRITE)
        client.qp.post_recv([RecvWR(i, [landing.sge(i * SLOT, SLOT)]) for i in range(2)])
        source = pair.server.pd.reg_mr(bytearray(b"first" + b"." * 59 + b"second"), Access(0))
        stage(hooked, 7, source.sge(0, 5), SendFlags.INLINE)
        stage(hooked, 8, source.sge(64, 6), SendFlags.SIGNALED | SendFlags.SOLICITED)
        calls = hooked.ctx.calls
        assert pair.server.qp.run_native_handler() is True
        assert hooked.ctx.calls > calls and hooked.ctx.sent == 2
        source.buf[0:5] = b"XXXXX"  # (the inline one's bytes are the engine's already)
        wcs = await drain(client.cq, 2)
        assert [(wc.status, wc.byte_len) for wc in wcs] == [(WCStatus.SUCCESS, n) for n in (5, 6)]
        assert bytes(landing.buf[0:5]) == b"first"
        assert bytes(landing.buf[SLOT : SLOT + 6]) == b"second"
        await until(lambda: (8, 0, int(WCOpcode.SEND)) in [row[:3] for row in hooked.log()])
        assert hooked.handled == []


def run_from_c(qp: Any) -> int:
    """Call the QP's native runner as a ULP's C does (its function on its context)."""
    runner = qp.native_runner()
    assert runner is not None
    function = native.ffi.cast("uint32_t (*)(void *)", runner[0])
    return int(function(native.ffi.cast("void *", runner[1])))


async def test_a_runner_called_from_c_posts_and_writes_what_the_handler_staged(
    handler_module: Any,
) -> None:
    """``qp.native_runner()``'s function does what ``run_native_handler()`` does, with no
    Python: the Sends the handler staged go out in the call, and a signaled one's
    completion is the handler's own, with nothing for Python (0). Once the QP is closed it
    says Python must look (1) and touches nothing."""
    async with hooked_pair(handler_module) as (pair, hooked):
        client = pair.client
        landing = client.pd.reg_mr(bytearray(2 * SLOT), Access.LOCAL_WRITE)
        client.qp.post_recv([RecvWR(i, [landing.sge(i * SLOT, SLOT)]) for i in range(2)])
        source = pair.server.pd.reg_mr(bytearray(b"from C"), Access(0))
        stage(hooked, 7, source.sge(0, 4), SendFlags.INLINE)
        assert run_from_c(pair.server.qp) == 0 and hooked.ctx.sent == 1
        (wc,) = await drain(client.cq, 1)
        assert (wc.status, bytes(landing.buf[:4])) == (WCStatus.SUCCESS, b"from")
        stage(hooked, 8, source.sge(0, 6), SendFlags.SIGNALED)
        assert run_from_c(pair.server.qp) == 0 and hooked.ctx.sent == 2
        (wc,) = await drain(client.cq, 1)
        assert (wc.status, bytes(landing.buf[SLOT : SLOT + 6])) == (WCStatus.SUCCESS, b"from C")
        await until(lambda: (8, 0, int(WCOpcode.SEND)) in [row[:3] for row in hooked.log()])
        qp = pair.server.qp
        runner = qp.native_runner()
        qp.close()
        assert runner == qp.native_runner() and run_from_c(qp) == 1
        assert hooked.ctx.sent == 2


async def test_a_handler_posts_an_rdma_write_before_its_send(handler_module: Any) -> None:
    """The table's ``post_send`` takes an RDMA Write (``opcode`` 1) of one local buffer
    into the peer's region: its bytes are in place when the Send after it arrives. An
    opcode the table does not know is not taken, and nothing after it either."""
    async with hooked_pair(handler_module) as (pair, hooked):
        client = pair.client
        target = client.pd.reg_mr(bytearray(32), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        landing = client.pd.reg_mr(bytearray(SLOT), Access.LOCAL_WRITE)
        client.qp.post_recv([RecvWR(1, [landing.sge()])])
        source = pair.server.pd.reg_mr(bytearray(b"written by C" + b"done"), Access(0))
        write = (int(native.lib.RS_HOOK_RDMA_WRITE), target.sge().addr + 4, target.rkey)
        stage(hooked, 5, source.sge(0, 12), SendFlags(0), write)
        stage(hooked, 6, source.sge(12, 4), SendFlags.SIGNALED)
        assert pair.server.qp.run_native_handler() is True and hooked.ctx.sent == 2
        (wc,) = await drain(client.cq, 1)
        assert (wc.status, bytes(landing.buf[:4])) == (WCStatus.SUCCESS, b"done")
        assert bytes(target.buf[4:16]) == b"written by C"
        stage(hooked, 7, source.sge(0, 4), SendFlags.SIGNALED, (3, 0, 0))
        stage(hooked, 8, source.sge(0, 4), SendFlags.SIGNALED)
        assert pair.server.qp.run_native_handler() is True and hooked.ctx.sent == 2
        assert pair.server.qp.query().qp_state is QPState.RTS


async def test_a_send_naming_memory_it_may_not_use_fails_as_any_post(handler_module: Any) -> None:
    """An inline Send naming no region is refused when posted (none taken); one whose
    bytes are read when framed fails then: the QP leaves RTS, the handler finds the failed
    completion and asks, and Python's handler runs."""
    async with hooked_pair(handler_module, repost=False) as (pair, hooked):
        source = pair.server.pd.reg_mr(bytearray(64), Access(0))
        bad = SGE(source.sge().addr, 8, source.lkey ^ 0x5A5A00)
        stage(hooked, 1, bad, SendFlags.INLINE | SendFlags.SIGNALED)
        assert pair.server.qp.run_native_handler() is True
        assert hooked.ctx.sent == 0 and pair.server.qp.query().qp_state is QPState.RTS
        stage(hooked, 2, bad, SendFlags.SIGNALED)
        assert pair.server.qp.run_native_handler() is True
        assert hooked.ctx.sent == 1
        await until(lambda: hooked.handled)
        assert (2, int(WCStatus.LOC_PROT_ERR), int(WCOpcode.SEND)) in [r[:3] for r in hooked.log()]


async def test_misuse_is_einval_and_other_engines_have_none(
    handler_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with hooked_pair(handler_module) as (_pair, hooked):
        with pytest.raises(VerbsError) as info:
            hooked.cq.set_native_handler(-1, 0)
        assert info.value.errno == errno.EINVAL
        assert pair_qp_runs_none(_pair.client.qp)  # (no handler on the client's CQ)
    monkeypatch.setenv("RDMASHIM_ENGINE", "python")
    async with connected() as pair:
        assert pair.client.cq.set_native_handler(1, 1) is False
        assert pair_qp_runs_none(pair.client.qp) and pair.client.qp.native_runner() is None


def pair_qp_runs_none(qp: Any) -> bool:
    return qp.run_native_handler() is False


def test_the_engine_header_keeps_the_documented_abi(handler_module: Any) -> None:
    """The engine's rs_wc, rs_hook_recv, rs_hook_send and rs_hook_verbs are the layouts
    the docs give a C user and ``native_handler.h`` (which the handler above includes)
    declares."""
    ffi = native.ffi
    out = handler_module.ffi.new("uint64_t[8]")
    handler_module.lib.abi(out)
    assert list(out) == [
        ffi.sizeof("rs_wc"), ffi.sizeof("rs_hook_recv"), ffi.sizeof("rs_hook_send"),
        ffi.offsetof("rs_hook_send", "flags"), ffi.offsetof("rs_hook_verbs", "post_send"),
        ffi.offsetof("rs_hook_send", "opcode"), ffi.offsetof("rs_hook_send", "remote_addr"),
        ffi.offsetof("rs_hook_send", "rkey")
        | native.lib.RS_HOOK_RDMA_WRITE << 32 | native.lib.RS_HOOK_RDMA_READ << 40,
    ]  # fmt: skip
    assert ffi.sizeof("rs_hook_recv") == 24
    assert ffi.offsetof("rs_hook_recv", "addr") == 8
    assert ffi.offsetof("rs_hook_recv", "lkey") == 20
    assert ffi.offsetof("rs_hook_verbs", "post_recv") == ffi.sizeof("void *")
    assert ffi.offsetof("rs_hook_verbs", "post_send") == 2 * ffi.sizeof("void *")
    assert ffi.sizeof("rs_hook_send") == 48
    assert ffi.offsetof("rs_hook_send", "flags") == 24
    assert ffi.offsetof("rs_hook_send", "opcode") == 28
    assert ffi.offsetof("rs_hook_send", "remote_addr") == 32
    assert ffi.offsetof("rs_hook_send", "rkey") == 40
    assert native.lib.RS_HOOK_SEND == 0  # (a zero-initialised entry is a Send)


def test_the_example_echo_server_works_in_c() -> None:
    """``examples/native_handler.py`` as a user runs it: its C handler echoes every
    message, and Python's handler runs only when the connection ends."""
    example = Path(__file__).resolve().parent.parent / "examples" / "native_handler.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "the client got 200 echoes, each its message" in done.stdout, done.stdout
    assert "echoed 200 messages; its Python handler ran 0 times meanwhile" in done.stdout
