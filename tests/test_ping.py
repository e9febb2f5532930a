"""rping's protocol (rdmashim.ping): our client against our server over loopback.

The data pattern and message layout are checked against rping.c (and against
what the kernel's rping prints, in ``test_siw_interop.py``); then both roles run
in one trio loop for several sizes, counts and MPA options, with ``-V``; then
the server meets clients that break the protocol and the client meets a
server that echoes the wrong data, and each ends with a clear error.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from typing import Any

import pytest
import trio

import rdmashim
from rdmashim import Access, QPCap, QPState, RecvWR, SendFlags, SendWR, WROpcode
from rdmashim.ping import (
    INFO,
    MAX_SIZE,
    MIN_SIZE,
    PingConfig,
    PingError,
    PingResult,
    c_string,
    ping_data,
    run_client,
    run_server,
)
from rdmashim.providers.softiwarp.connection import MpaOptions, accept_qp, connect_qp, read_request

LOCAL = "127.0.0.1"
TIMEOUT = 30.0
REMOTE = Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE

# What the kernel's `rping -c -v -C 10` printed in the test bed's guest (tools/guest).
KERNEL_PING_0 = b"rdma-ping-0: ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqr"
KERNEL_PING_9 = b"rdma-ping-9: JKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyzA"


# ---------------------------------------------------------------- the format


def test_ping_data_is_rpings_pattern() -> None:
    assert ping_data(0, 64) == KERNEL_PING_0 + b"\0"
    assert ping_data(9, 64) == KERNEL_PING_9 + b"\0"
    # the first letter advances with each ping and wraps from 'z' to 'A'
    assert ping_data(57, 64)[len(b"rdma-ping-57: ")] == ord("z")
    assert ping_data(58, 64)[len(b"rdma-ping-58: ")] == ord("A")
    for ping in (0, 1, 99, 12345):
        for size in (MIN_SIZE, 64, 1000, 4099, MAX_SIZE):
            data = ping_data(ping, size)
            assert len(data) == size and data[-1] == 0 and data.count(0) == 1
            assert data.startswith(b"rdma-ping-%d: " % ping)
            assert all(65 <= b <= 122 for b in data[len(b"rdma-ping-%d: " % ping) : -1])
    # snprintf truncation when the header does not fit (rping's count is an int)
    assert ping_data(10**30, MIN_SIZE) == b"rdma-ping-100000000000000\0"


def test_sizes_are_rpings() -> None:
    assert (MIN_SIZE, MAX_SIZE) == (26, 65535)  # sizeof("2147483647") + sizeof(fmt), 64K - 1
    for bad in (MIN_SIZE - 1, MAX_SIZE + 1, 0):
        with pytest.raises(ValueError, match="Invalid size"):
            PingConfig(server=True, size=bad)
    with pytest.raises(ValueError, match="Invalid count"):
        PingConfig(server=True, count=-1)
    with pytest.raises(ValueError, match="address"):
        PingConfig(server=False)


def test_info_is_rping_rdma_info() -> None:
    # struct rping_rdma_info { __be64 buf; __be32 rkey; __be32 size; }
    assert INFO.size == 16
    assert INFO.pack(0x0102030405060708, 0x0A0B0C0D, 64) == bytes.fromhex(
        "01020304050607080a0b0c0d00000040"
    )
    assert c_string(b"abc\0def") == b"abc" and c_string(b"abc") == b"abc"


# ---------------------------------------------------------------- our client, our server


async def ping_pair(
    count: int, size: int, *, crc: bool = True, p2p: bool = False, server_crc: bool | None = None
) -> tuple[PingResult, PingResult, list[bytes], list[bytes]]:
    client_seen: list[bytes] = []
    server_seen: list[bytes] = []
    server_cfg = PingConfig(
        server=True, address=LOCAL, port=0, size=size, p2p=p2p, timeout=10,
        crc=crc if server_crc is None else server_crc,
        on_data=lambda _i, d: server_seen.append(d),
    )  # fmt: skip
    results: dict[str, PingResult] = {}

    async def serve(task_status: trio.TaskStatus[int]) -> None:
        results["server"] = await run_server(server_cfg, task_status=task_status)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve)
            client_cfg = PingConfig(
                server=False, address=LOCAL, port=port, count=count, size=size, validate=True,
                crc=crc, p2p=p2p, timeout=10, on_data=lambda _i, d: client_seen.append(d),
            )  # fmt: skip
            results["client"] = await run_client(client_cfg)
    return results["client"], results["server"], client_seen, server_seen


@pytest.mark.parametrize(
    ("count", "size", "crc", "p2p"),
    [
        (1, 64, True, False),
        (10, 64, True, False),
        (10, 64, False, False),
        (3, MIN_SIZE, True, False),
        (3, 1001, False, False),  # odd: PAD bytes
        (5, 5001, True, True),  # several TCP segments, P2P
        (2, MAX_SIZE, False, True),  # one full-size FPDU's worth and more
        (4, 300, True, True),
    ],
)
async def test_ping_our_client_our_server(count: int, size: int, crc: bool, p2p: bool) -> None:
    client, server, client_seen, server_seen = await ping_pair(count, size, crc=crc, p2p=p2p)
    assert client.pings == count and server.pings == count
    assert server.disconnected_by_peer and not client.disconnected_by_peer
    expected = [c_string(ping_data(i, size)) for i in range(count)]
    assert client_seen == expected and server_seen == expected
    assert client.negotiated is not None and server.negotiated is not None
    assert client.negotiated.crc == server.negotiated.crc == crc
    assert client.negotiated.p2p == server.negotiated.p2p == p2p


async def test_crc_is_on_when_either_side_asks() -> None:
    client, server, _, _ = await ping_pair(2, 64, crc=False, server_crc=True)
    assert client.negotiated is not None and client.negotiated.crc
    assert server.negotiated is not None and server.negotiated.crc
    client, server, _, _ = await ping_pair(2, 64, crc=True, server_crc=False)
    assert client.negotiated is not None and client.negotiated.crc
    assert server.negotiated is not None and server.negotiated.crc


# ---------------------------------------------------------------- the CLI


PING_CLI = [sys.executable, "-m", "rdmashim", "ping"]


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PING_CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_client_and_server_print_like_rping() -> None:
    server = subprocess.Popen(
        [*PING_CLI, "-s", "-a", LOCAL, "-p", "0", "-S", "100", "-v", "-d"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        port = None
        for line in server.stderr:  # -d logs "listening on 127.0.0.1:PORT"
            if "listening on" in line:
                port = line.rsplit(":", 1)[1].strip()
                break
        assert port, "server did not report its port"
        out = cli("-c", "-a", LOCAL, "-p", port, "-C", "3", "-S", "100", "-v", "-V", "--no-crc")
        assert out.returncode == 0, out.stderr
        server_out, _ = server.communicate(timeout=30)
    finally:
        server.kill()
    lines = [f"ping data: {c_string(ping_data(i, 100)).decode()}" for i in range(3)]
    assert out.stdout.splitlines() == lines
    assert server_out.splitlines() == ["server " + line for line in lines]
    assert server.returncode == 0


def test_cli_rejects_bad_arguments() -> None:
    out = cli("-c", "-a", LOCAL, "-S", "10")
    assert out.returncode == 2 and "argument -S: '10' is out of range (26 .. 65535)" in out.stderr
    out = cli("-a", LOCAL)
    assert out.returncode == 2 and "-s" in out.stderr  # one of -s / -c is required
    out = cli("-c", "-a", LOCAL, "-p", "1", "-C", "1")  # nobody listens on port 1
    assert out.returncode == 1
    assert "connecting to 127.0.0.1:1 failed: connection refused" in out.stderr


# ---------------------------------------------------------------- the server meets bad clients


class RawClient:
    """A hand-driven rping client on the verbs API (for breaking the protocol)."""

    def __init__(self, ctx: Any) -> None:
        self.pd = ctx.alloc_pd()
        self.cq = ctx.create_cq(64)
        self.qp = self.pd.create_qp(send_cq=self.cq, recv_cq=self.cq, cap=QPCap(16, 4))
        self.recv = self.pd.reg_mr(bytearray(64), Access.LOCAL_WRITE)
        self.msg = self.pd.reg_mr(bytearray(256), Access.LOCAL_WRITE)
        self.buf = self.pd.reg_mr(bytearray(ping_data(0, 64)), REMOTE)
        self.qp.post_recv(RecvWR(9, [self.recv.sge()]))

    async def connect(self, port: int) -> None:
        await connect_qp(self.qp, await trio.open_tcp_stream(LOCAL, port), options=MpaOptions())

    def send(self, payload: bytes) -> None:
        self.msg.buf[: len(payload)] = payload
        self.qp.post_send(SendWR(1, WROpcode.SEND, [self.msg.sge(0, len(payload))]))


async def serve_bad_client(script: Any, size: int = 64) -> tuple[str, RawClient]:
    """Run our server against ``script(client)``; return the server's error message."""
    config = PingConfig(server=True, address=LOCAL, port=0, size=size, timeout=5)
    failure: list[str] = []

    async def serve(task_status: trio.TaskStatus[int]) -> None:
        try:
            await run_server(config, task_status=task_status)
        except PingError as exc:
            failure.append(str(exc))

    async with rdmashim.open_device("siw_lo") as ctx:
        client = RawClient(ctx)
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve)
                await script(client, port)
            # the server closed the connection after its error
            await client.qp.wait_closed()
        assert client.qp.state is QPState.ERR
        assert failure, "the server accepted bad input"
        return failure[0], client


async def test_server_rejects_short_message() -> None:
    async def script(client: RawClient, port: int) -> None:
        await client.connect(port)
        client.send(b"\1" * 12)

    error, _ = await serve_bad_client(script)
    assert error == "Received bogus data, size 12"  # rping's words


async def test_server_rejects_long_message() -> None:
    async def script(client: RawClient, port: int) -> None:
        await client.connect(port)
        client.send(b"\1" * 100)  # longer than the 16-byte receive: LOC_LEN_ERR + Terminate

    error, client = await serve_bad_client(script)
    assert "cq completion failed" in error and "LOC_LEN_ERR" in error
    assert client.qp.remote_terminate is not None


async def test_server_rejects_buffer_larger_than_its_size() -> None:
    async def script(client: RawClient, port: int) -> None:
        await client.connect(port)
        client.send(INFO.pack(client.buf.addr, client.buf.rkey, 65))

    error, _ = await serve_bad_client(script, size=64)
    assert error == "the client's buffer has 65 bytes, more than ours (64, -S)"


async def test_server_reports_bad_rkey() -> None:
    async def script(client: RawClient, port: int) -> None:
        await client.connect(port)
        client.send(INFO.pack(client.buf.addr, client.buf.rkey ^ 0x100, 64))

    error, _ = await serve_bad_client(script)
    assert "connection terminated" in error or "REM_ACCESS_ERR" in error, error


async def test_server_reports_sink_too_small() -> None:
    async def script(client: RawClient, port: int) -> None:
        await client.connect(port)
        client.send(INFO.pack(client.buf.addr, client.buf.rkey, 64))
        with trio.fail_after(10):
            wcs: list[Any] = []
            while not any(wc.wr_id == 9 for wc in wcs):  # the go-ahead
                wcs += await client.cq.poll_wait()
        client.send(INFO.pack(client.buf.addr, client.buf.rkey, 10))

    error, _ = await serve_bad_client(script)
    assert error == "the client's sink has 10 bytes; the data needs 64"


async def test_server_drops_non_mpa_bytes_and_keeps_listening() -> None:
    """As with rping over the kernel's rdma_cm: garbage never becomes a connection request."""
    server = PingConfig(server=True, address=LOCAL, port=0, timeout=5)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(run_server_task, server)
            stream = await trio.open_tcp_stream(LOCAL, port)
            await stream.send_all(b"GET / HTTP/1.0\r\n\r\n")
            assert await stream.receive_some() == b""  # closed by the server's listener
            await stream.aclose()
            client = PingConfig(server=False, address=LOCAL, port=port, count=2, validate=True)
            result = await run_client(client)  # the server still serves a real client
            assert result.pings == 2


async def run_server_task(
    config: PingConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    await run_server(config, task_status=task_status)


async def test_server_times_out_on_silent_client() -> None:
    async def script(client: RawClient, port: int) -> None:
        await client.connect(port)  # then say nothing: the server gives up after its timeout

    error, _ = await serve_bad_client(script)
    assert error.startswith("no answer from the peer in 5 s"), error


# ---------------------------------------------------------------- the client meets a bad server


async def bad_server(
    corrupt: bool, hang_up: bool, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """An rping server that echoes wrong data (``corrupt``) or leaves at once (``hang_up``)."""
    async with rdmashim.open_device("siw_lo") as ctx:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(64)
        qp = pd.create_qp(send_cq=cq, recv_cq=cq, cap=QPCap(16, 4))
        recv = pd.reg_mr(bytearray(16), Access.LOCAL_WRITE)
        data = pd.reg_mr(bytearray(64), REMOTE)
        zero = pd.reg_mr(bytearray(16))
        qp.post_recv(RecvWR(1, [recv.sge()]))
        (listener,) = await trio.open_tcp_listeners(0, host=LOCAL)
        task_status.started(listener.socket.getsockname()[1])
        stream = await listener.accept()
        await accept_qp(qp, stream, await read_request(stream))
        await listener.aclose()

        async def next_recv() -> tuple[int, int, int]:
            while True:
                for wc in await cq.poll_wait():
                    wc.raise_for_status()
                    if wc.opcode.name == "RECV":
                        qp.post_recv(RecvWR(1, [recv.sge()]))
                        return struct.unpack("!QII", recv.buf)

        if not hang_up:
            addr, rkey, size = await next_recv()
            qp.post_send(SendWR(2, WROpcode.RDMA_READ, [data.sge(0, size)], SendFlags.SIGNALED,
                                addr, rkey))  # fmt: skip
            qp.post_send(SendWR(3, WROpcode.SEND, [zero.sge()]))
            addr, rkey, size = await next_recv()
            await trio.sleep(0.1)  # the Read has landed (it was answered before the Send)
            if corrupt:
                data.buf[20] ^= 1
            qp.post_send(SendWR(4, WROpcode.RDMA_WRITE, [data.sge()], SendFlags.SIGNALED,
                                addr, rkey))  # fmt: skip
            qp.post_send(SendWR(5, WROpcode.SEND, [zero.sge()]))
            with trio.move_on_after(5):
                await qp.wait_closed()  # the client hangs up after its error
        qp.modify(qp_state=QPState.ERR)
        await qp.wait_closed()


@pytest.mark.parametrize(("corrupt", "hang_up", "message"), [
    (True, False, "data mismatch! (ping 0, first difference at byte 20)"),
    (False, True, "server disconnected after 0 of 3 pings"),
])  # fmt: skip
async def test_client_detects_bad_server(corrupt: bool, hang_up: bool, message: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(bad_server, corrupt, hang_up)
            config = PingConfig(
                server=False, address=LOCAL, port=port, count=3, validate=True, timeout=5
            )
            with pytest.raises(PingError) as info:
                await run_client(config)
    assert str(info.value).startswith(message), info.value


async def test_client_without_validation_does_not_compare() -> None:
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(bad_server, True, False)
            config = PingConfig(server=False, address=LOCAL, port=port, count=1, timeout=5)
            result = await run_client(config)
    assert result.pings == 1  # the bad data goes unnoticed, as in rping without -V
