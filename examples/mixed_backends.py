"""One connection, two backends: a server on one, a client on the other, in one trio loop.

On a host with an RDMA device (e.g. Linux siw: ``modprobe siw rdma_ucm; rdma link add
siw0 type siw netdev eth0``) each pairing of the built-in engine and rdma-core runs
Send/Recv both ways with private data, an RDMA Write into the server's region, an
RDMA Read from it, and a rejected connection::

    python3 examples/mixed_backends.py 10.0.2.15          # the device's interface address
    python3 examples/mixed_backends.py 10.0.2.15 softiwarp rdmacore   # one pairing
    python3 examples/mixed_backends.py 127.0.0.1 softiwarp softiwarp  # no device needed
"""

import struct
import sys
import time

import trio

from rdmashim import Access, RecvWR, SendWR, WCOpcode, WROpcode
from rdmashim.cliargs import Parser, backend, host, run_command
from rdmashim.cm import ConnectionRejected, open_connection, serve

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
N = 64 * 1024


def pattern(n, seed):
    return bytes((i * 7 + seed) & 0xFF for i in range(n))


async def drain(cq, n):
    wcs = []
    with trio.fail_after(20):
        while len(wcs) < n:
            wcs += await cq.poll_wait(n - len(wcs))
    return [wc.raise_for_status() for wc in wcs]


async def run_pair(host, server_backend, client_backend):
    report = {}
    done = trio.Event()

    async def handler(request):
        if request.private_data == b"please reject":
            await request.reject(b"no thanks")
            return
        msgs = request.pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
        region = request.pd.reg_mr(bytearray(2 * N), RW)
        region.buf[N:] = pattern(N, 5)
        request.qp.post_recv([RecvWR(1, [msgs.sge(0, 128)]), RecvWR(2, [msgs.sge(128, 128)])])
        conn = await request.accept(private_data=b"welcome from " + server_backend.encode())
        report["server got"] = request.private_data
        (hello,) = await drain(conn.recv_cq, 1)
        report["server received"] = bytes(msgs.buf[: hello.byte_len])
        msgs.buf[128:144] = struct.pack("!QII", region.iova, region.rkey, N)
        conn.qp.post_send(SendWR(10, WROpcode.SEND, [msgs.sge(128, 16)]))
        await drain(conn.recv_cq, 2)  # our send, the client's "done"
        report["write ok"] = bytes(region.buf[:N]) == pattern(N, 9)
        done.set()
        await conn.wait_disconnected()

    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(
            lambda task_status: serve(
                handler, 0, host=host, backend=server_backend, task_status=task_status
            )
        )
        started = time.monotonic()
        hello = b"hello from " + client_backend.encode()
        async with open_connection(host, port, private_data=hello, backend=client_backend) as conn:
            report["client got"] = conn.private_data
            msgs = conn.pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
            local = conn.pd.reg_mr(bytearray(2 * N), RW)
            local.buf[:N] = pattern(N, 9)
            conn.qp.post_recv(RecvWR(20, [msgs.sge(128, 128)]))
            msgs.buf[:5] = b"hello"
            conn.qp.post_send(SendWR(21, WROpcode.SEND, [msgs.sge(0, 5)]))  # active side first
            reply = next(wc for wc in await drain(conn.recv_cq, 2) if wc.opcode == WCOpcode.RECV)
            addr, rkey, _ = struct.unpack("!QII", bytes(msgs.buf[128 : 128 + reply.byte_len]))
            conn.qp.post_send(
                [
                    SendWR(22, WROpcode.RDMA_WRITE, [local.sge(0, N)], remote_addr=addr, rkey=rkey),
                    SendWR(
                        23, WROpcode.RDMA_READ, [local.sge(N, N)], remote_addr=addr + N, rkey=rkey
                    ),
                ]
            )
            await drain(conn.recv_cq, 2)
            report["read ok"] = bytes(local.buf[N:]) == pattern(N, 5)
            msgs.buf[:4] = b"done"
            conn.qp.post_send(SendWR(24, WROpcode.SEND, [msgs.sge(0, 4)]))
            await drain(conn.recv_cq, 1)
            with trio.fail_after(20):
                await done.wait()
        report["seconds"] = round(time.monotonic() - started, 2)
        try:
            async with open_connection(
                host, port, private_data=b"please reject", backend=client_backend
            ):
                report["reject"] = "not rejected"
        except ConnectionRejected as exc:
            report["reject"] = f"rejected with {exc.private_data!r}"
        nursery.cancel_scope.cancel()
    return report


async def main(host, pairs):
    failed = 0
    for server, client in pairs:
        print(f"== server {server} <- client {client} on {host}", flush=True)
        report = await run_pair(host, server, client)
        for key, value in report.items():
            print(f"   {key}: {value}")
        ok = report["write ok"] and report["read ok"] and report["server received"] == b"hello"
        ok = ok and report["reject"].startswith("rejected")
        print("   PASS" if ok else "   FAIL", flush=True)
        failed += not ok
    return failed


def parse_args():
    parser = Parser(
        prog="mixed_backends.py",
        description="One connection per pairing of the built-in engine and rdma-core.",
    )
    parser.add_argument("host", type=host, help="the RDMA device's interface address")
    parser.add_argument("server", nargs="?", type=backend, help="server backend (one pairing)")
    parser.add_argument("client", nargs="?", type=backend, help="client backend")
    args = parser.parse_args()
    if (args.server is None) != (args.client is None):
        parser.error("give both backends of a pairing, or neither")
    if args.server:
        return args.host, [(args.server, args.client)]
    return args.host, [
        ("rdmacore", "rdmacore"),
        ("softiwarp", "rdmacore"),
        ("rdmacore", "softiwarp"),
    ]


if __name__ == "__main__":
    # One line on bad input or a failure, status 130 on Ctrl-C (rdmashim.cliargs).
    sys.exit(run_command("mixed_backends.py", lambda: 1 if trio.run(main, *parse_args()) else 0))
