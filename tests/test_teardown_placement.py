"""No byte reaches a region after its ``close()`` returns, whatever the peer had started.

A raw iWARP peer (real TCP, our own codecs) starts a message into a region of a
``serve`` handler, the handler closes that region in the middle, and the peer sends
the rest: a Send's second segment, the second half of a Write's payload (large enough
for direct placement), the Response to a Read whose sink was closed. The bytes after
the close must not land (the arena around and under the region is checked), the work
request completes LOC_PROT_ERR, the peer gets a Terminate, the handler's calls return
cleanly, and the server serves the next client. And the handler of the issue: a
too-long Send after a good one, then the handler closes its regions (``BufferError``
before this was fixed) and the server goes on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio

from rdmashim import Access, RecvWR, SendFlags, SendWR, WCStatus, WROpcode
from rdmashim.cm import open_connection, serve
from rdmashim.providers.softiwarp import ddp, mpa
from rdmashim.providers.softiwarp.ddp import QN, Opcode

SLOT = 48 * 1024
FILL = 0x5A
TIMEOUT = 10

pytestmark = pytest.mark.parametrize("kernels", ["native", "compiled", "python"], indirect=True)


@pytest.fixture
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The native engine, or the Python one with its compiled or its Python kernels."""
    from rdmashim.providers.softiwarp import engines, fastpath, native

    if request.param == "native":
        if not native.AVAILABLE:
            pytest.skip(f"native engine unavailable: {native.WHY_NOT}")
        monkeypatch.setenv(engines.ENV_ENGINE, "native")
        yield
        return
    if request.param == "compiled" and fastpath.COMPILED is None:
        pytest.skip(f"compiled kernels unavailable: {fastpath.WHY_NOT}")
    monkeypatch.setenv(engines.ENV_ENGINE, "python")
    before = fastpath.use(request.param == "compiled")
    yield
    fastpath.restore(before)


class Peer:
    """A raw iWARP active side: MPA Request, then FPDUs framed by hand (CRC on)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.received = bytearray()

    @classmethod
    async def connect(cls, port: int) -> Peer:
        peer = cls(await trio.open_tcp_stream("127.0.0.1", port))
        frame = mpa.StartFrame(reply=False, crc=True, ird=4, ord=4, private_data=b"raw")
        await peer.stream.send_all(mpa.encode_start_frame(frame))
        while (parsed := mpa.parse_start_frame(peer.received, reply=True)) is None:
            peer.received += await peer.stream.receive_some(4096)
        del peer.received[: parsed[1]]
        assert not parsed[0].reject
        return peer

    async def send(self, header: bytes, payload: bytes = b"", cut: int | None = None) -> None:
        """One FPDU; with ``cut``, only its first ``cut`` bytes."""
        data = b"".join(bytes(b) for b in ddp.encode_fpdu(header, [payload], crc=True))
        await self.stream.send_all(data[:cut])

    async def rest(self, header: bytes, payload: bytes, cut: int) -> None:
        data = b"".join(bytes(b) for b in ddp.encode_fpdu(header, [payload], crc=True))
        await self.stream.send_all(data[cut:])

    async def terminate(self) -> ddp.Terminate:
        """Read until the server's Terminate has come (the FPDUs before it skipped)."""
        with trio.fail_after(TIMEOUT):
            while True:
                while len(self.received) >= 2:
                    size = int.from_bytes(self.received[:2], "big") + 2
                    size += -size & 3
                    if len(self.received) < size + 4:
                        break
                    fpdu = bytes(self.received[: size + 4])
                    del self.received[: size + 4]
                    if fpdu[3] & 0x0F == Opcode.TERMINATE:
                        return ddp.parse_terminate(fpdu[ddp.UNTAGGED_HDR_LEN :])
                chunk = await self.stream.receive_some(65536)
                assert chunk, "closed without a Terminate"
                self.received += chunk


async def placed(arena: bytearray, at: int, value: int) -> None:
    """Wait until the engine has placed ``value`` at ``arena[at]`` (nothing signals it)."""
    with trio.fail_after(TIMEOUT):
        while arena[at] != value:  # noqa: ASYNC110 (placement has no event to wait on)
            await trio.sleep(0.001)


Scenario = Callable[[Peer, dict[str, Any], bytearray], Awaitable[None]]


async def run(scenario: Scenario, *, sink: bool = False) -> tuple[list[Any], bytearray]:
    """Serve one raw peer running ``scenario`` and then a well-behaved client; the
    completions the handler saw and its arena (after it closed every region)."""
    arena = bytearray([FILL]) * (3 * SLOT)
    shared: dict[str, Any] = {"wcs": [], "ready": trio.Event(), "closed": trio.Event()}
    served = trio.Event()

    async def handler(request: Any) -> None:
        if request.private_data != b"raw":  # the well-behaved client after the peer
            mr = request.pd.reg_mr(bytearray(16))
            request.qp.post_recv(RecvWR(1, [mr.sge()]))
            conn = await request.accept()
            wc = (await conn.recv_cq.poll_wait(1))[0]
            assert (wc.status, bytes(mr.buf[:4])) == (WCStatus.SUCCESS, b"next")
            served.set()
            await conn.wait_disconnected()
            mr.close()
            return
        view = memoryview(arena)
        rights = Access.LOCAL_WRITE | Access.REMOTE_WRITE
        mrs = [request.pd.reg_mr(view[i * SLOT : (i + 1) * SLOT], rights) for i in range(3)]
        view.release()
        request.qp.post_recv([RecvWR(i, [mr.sge()]) for i, mr in enumerate(mrs)])
        conn = await request.accept()
        shared["mrs"] = mrs
        if sink:  # a Read from the peer into mrs[2]; the peer never answers in time
            conn.qp.post_send(
                SendWR(9, WROpcode.RDMA_READ, [mrs[2].sge()], SendFlags.SIGNALED, 0x1000, 0x77)
            )
        shared["ready"].set()
        await shared["closed"].wait()
        with trio.move_on_after(TIMEOUT):
            while not any(wc.status is not WCStatus.SUCCESS for wc in shared["wcs"]):
                shared["wcs"] += await conn.recv_cq.poll_wait() + conn.send_cq.poll()
        shared["wcs"] += conn.send_cq.poll()
        await conn.wait_disconnected()
        for mr in mrs:
            mr.close()  # again: idempotent, and returns cleanly after the fault
        arena.extend(b"x")  # no view of the arena is left: it may move
        del arena[-1:]

    with trio.fail_after(3 * TIMEOUT):
        async with trio.open_nursery() as nursery:
            _, port = await nursery.start(serve, handler, 0)
            peer = await Peer.connect(port)
            await shared["ready"].wait()
            await scenario(peer, shared, arena)
            await peer.stream.aclose()
            async with open_connection("127.0.0.1", port, private_data=b"next") as conn:
                mr = conn.pd.reg_mr(bytearray(b"next"))
                conn.qp.post_send(SendWR(1, WROpcode.SEND, [mr.sge()]))
                await served.wait()
            nursery.cancel_scope.cancel()
    return shared["wcs"], arena


async def close_region(shared: dict[str, Any], index: int) -> None:
    shared["mrs"][index].close()
    shared["closed"].set()


async def test_a_send_whose_region_is_closed_between_its_segments(kernels: Any) -> None:
    async def scenario(peer: Peer, shared: dict[str, Any], arena: bytearray) -> None:
        first = ddp.encode_untagged(Opcode.SEND, False, QN.SEND, 1, 0, 1000)
        await peer.send(first, b"\x01" * 1000)
        await placed(arena, 999, 1)
        await close_region(shared, 0)
        second = ddp.encode_untagged(Opcode.SEND, True, QN.SEND, 1, 1000, 1000)
        await peer.send(second, b"\x02" * 1000)
        assert (await peer.terminate()).code is not None

    wcs, arena = await run(scenario)
    assert (wcs[0].wr_id, wcs[0].status) == (0, WCStatus.LOC_PROT_ERR)
    assert {w.status for w in wcs[1:]} <= {WCStatus.WR_FLUSH_ERR}
    assert arena[:1000] == b"\x01" * 1000
    assert arena[1000:] == bytes([FILL]) * (len(arena) - 1000)


async def test_a_write_whose_region_is_closed_in_the_middle_of_its_payload(kernels: Any) -> None:
    size = 40000  # direct placement: the payload goes straight into the region

    async def scenario(peer: Peer, shared: dict[str, Any], arena: bytearray) -> None:
        mr = shared["mrs"][1]
        header = ddp.encode_tagged(Opcode.WRITE, True, mr.rkey, mr.addr, size)
        payload = b"\x03" * size
        await peer.send(header, payload, cut=ddp.TAGGED_HDR_LEN + size // 2)
        await placed(arena, SLOT + size // 2 - 1, 3)
        await close_region(shared, 1)
        await peer.rest(header, payload, ddp.TAGGED_HDR_LEN + size // 2)
        assert (await peer.terminate()).code is not None

    _, arena = await run(scenario)
    assert arena[SLOT : SLOT + size // 2] == b"\x03" * (size // 2)
    assert arena[SLOT + size // 2 :] == bytes([FILL]) * (len(arena) - SLOT - size // 2)


async def test_a_read_whose_sink_is_closed_before_its_response(kernels: Any) -> None:
    async def scenario(peer: Peer, shared: dict[str, Any], arena: bytearray) -> None:
        mr = shared["mrs"][2]
        await close_region(shared, 2)
        header = ddp.encode_tagged(Opcode.READ_RESPONSE, True, mr.lkey, mr.addr, 4096)
        await peer.send(header, b"\x04" * 4096)
        assert (await peer.terminate()).code is not None

    wcs, arena = await run(scenario, sink=True)
    assert (9, WCStatus.LOC_PROT_ERR) in [(w.wr_id, w.status) for w in wcs]
    assert arena == bytes([FILL]) * len(arena)


async def test_the_users_handler_survives_a_too_long_send_and_closes_its_regions(
    kernels: Any,
) -> None:
    """The shape of the report: a good Send, then one longer than the receive."""

    async def scenario(peer: Peer, shared: dict[str, Any], arena: bytearray) -> None:
        await peer.send(ddp.encode_untagged(Opcode.SEND, True, QN.SEND, 1, 0, 10), b"\x05" * 10)
        await peer.send(
            ddp.encode_untagged(Opcode.SEND, True, QN.SEND, 2, 0, SLOT + 4), b"\x06" * (SLOT + 4)
        )
        assert (await peer.terminate()).code is not None
        shared["closed"].set()

    wcs, arena = await run(scenario)
    assert [(w.wr_id, w.status) for w in wcs][:2] == [
        (0, WCStatus.SUCCESS),
        (1, WCStatus.LOC_LEN_ERR),
    ]
    assert arena[:10] == b"\x05" * 10
    assert arena[SLOT:] == bytes([FILL]) * (2 * SLOT)
