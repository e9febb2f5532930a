"""A completion handler in C, called by the engine: an echo server with no Python per
message. ``cq.set_native_handler`` gives the native engine a C function that takes the
CQ's completions inside the engine's own calls; through the table of verbs it is given,
it sends each message back from the buffer it arrived in and posts that buffer's receive
again once the echo is sent (docs/verbs.md, "Native completion handlers"). The handler
is compiled here with cffi, as a ULP would build its own C.
Run it: ``python examples/native_handler.py`` (the built-in engine's native engine and a
C compiler; it says so and stops where either is missing).
"""

import importlib
import sys
import tempfile
from functools import partial

import trio

from rdmashim import Access, RecvWR, SendFlags, SendWR, WCOpcode, WROpcode
from rdmashim.cm import ConnectionRejected, open_connection, serve
from rdmashim.verbs import native

COUNT = 200  # messages the client sends, one at a time
SLOTS = 8  # the server's receive buffers
SLOT = 64  # bytes each

DECLARATIONS = """
typedef struct { uint64_t addr; uint32_t lkey; uint32_t echoed; uint32_t failed; } echo;
uintptr_t echo_handler(void);
"""
SOURCE = """
#include "native_handler.h" /* the ABI: rdmashim.verbs.native.INCLUDE_DIR */

typedef struct { uint64_t addr; uint32_t lkey; uint32_t echoed; uint32_t failed; } echo;

#define SLOT 64
#define SENT 1000 /* an echo's work request: SENT + its buffer */

static uint32_t handle(void *context, const rdmashim_verbs *v, void *cq, void *qp,
                       uint32_t qp_num)
{
    echo *e = context;
    rdmashim_row rows[16];
    uint32_t n;
    (void)qp_num;
    while ((n = v->poll(cq, rows, 16)) != 0) {
        for (uint32_t i = 0; i < n; i++) {
            const rdmashim_row *r = &rows[i];
            if (r->status != 0) {
                e->failed++; /* (the connection ends: Python's handler looks) */
                continue;
            }
            uint64_t slot = r->opcode == 128 ? r->wr_id : r->wr_id - SENT;
            uint64_t addr = e->addr + slot * SLOT;
            if (r->opcode == 128) { /* a message arrived: send it back from where it is */
                rdmashim_send s = {SENT + slot, addr, r->byte_len, e->lkey, 2 /* SIGNALED */};
                e->failed += v->post_send(qp, &s, 1) != 1;
            } else { /* its echo went: the buffer takes the next message */
                rdmashim_recv again = {slot, addr, SLOT, e->lkey};
                e->failed += v->post_recv(qp, &again, 1) != 1;
                e->echoed++;
            }
        }
    }
    return e->failed != 0; /* non-zero: hand the CQ on to Python's handler */
}

uintptr_t echo_handler(void) { return (uintptr_t)handle; }
"""


def build():
    """The compiled handler's module (cffi, API mode), or None and why not."""
    try:
        from cffi import FFI

        ffi = FFI()
        ffi.cdef(DECLARATIONS)
        ffi.set_source("_echo_handler", SOURCE, include_dirs=[native.INCLUDE_DIR])
        directory = tempfile.mkdtemp(prefix="rdmashim-echo-")
        ffi.compile(tmpdir=directory, verbose=False)
        sys.path.insert(0, directory)
        return importlib.import_module("_echo_handler"), ""
    except Exception as exc:  # (no compiler, no headers: the example says so)
        return None, f"cannot compile the handler: {exc}"


async def echo_server(request, module, report, reported):
    buffers = request.pd.reg_mr(bytearray(SLOTS * SLOT), Access.LOCAL_WRITE)
    context = module.ffi.new("echo *")
    context.addr, context.lkey = buffers.sge().addr, buffers.lkey
    python_runs = []  # (how many had been echoed when Python's handler ran)
    request.qp.send_cq.set_handler(lambda cq: python_runs.append((cq.poll(64), context.echoed)))
    request.qp.send_cq.req_notify()
    request.qp.post_recv([RecvWR(i, [buffers.sge(i * SLOT, SLOT)]) for i in range(SLOTS)])
    address = int(module.lib.echo_handler())
    if not request.qp.send_cq.set_native_handler(
        address, int(module.ffi.cast("uintptr_t", context)), context
    ):
        report.append("this backend calls no native handler (the Python engine?)")
        reported.set()
        await request.reject()
        return
    conn = await request.accept()
    await conn.wait_disconnected()
    while_echoing = sum(1 for _, echoed in python_runs if echoed < COUNT)
    report.append(
        f"the server's C echoed {context.echoed} messages; its Python handler ran "
        f"{while_echoing} times meanwhile ({len(python_runs) - while_echoing} when the "
        f"connection ended, for the {context.failed} receives flushed then)"
    )
    reported.set()


async def main():
    module, why = build()
    if module is None:
        raise SystemExit(why)
    report, reported = [], trio.Event()
    rejected = False
    async with trio.open_nursery() as nursery:
        server = partial(echo_server, module=module, report=report, reported=reported)
        _, port = await nursery.start(partial(serve, server, 0))
        try:
            await echo(port)
        except ConnectionRejected:
            rejected = True
        with trio.fail_after(10):
            await reported.wait()
        nursery.cancel_scope.cancel()
    if rejected:
        raise SystemExit(report[0])
    print(report[0])


async def echo(port):
    """The client: each message sent, and its echo waited for."""
    async with open_connection("localhost", port) as conn:
        landing = conn.pd.reg_mr(bytearray(SLOT), Access.LOCAL_WRITE)
        source = conn.pd.reg_mr(bytearray(SLOT), Access(0))
        for i in range(COUNT):
            message = b"message %d" % i
            source.buf[: len(message)] = message
            conn.qp.post_recv(RecvWR(i, [landing.sge()]))
            conn.qp.post_send(
                SendWR(i, WROpcode.SEND, [source.sge(0, len(message))], SendFlags.SIGNALED)
            )
            got = [await conn.cq.poll_wait(1) for _ in range(2)]  # the Send, the echo
            for (wc,) in got:
                wc.raise_for_status()
            echoed = next(wc for (wc,) in got if wc.opcode == WCOpcode.RECV)
            if bytes(landing.buf[: echoed.byte_len]) != message:
                raise SystemExit(f"echo {i} is {bytes(landing.buf[: echoed.byte_len])!r}")
        print(f"the client got {COUNT} echoes, each its message")


trio.run(main)
