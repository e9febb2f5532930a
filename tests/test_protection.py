"""The protection matrix through the public API, over real loopback TCP connections.

Each cell is an RDMA Write or an RDMA Read aimed at a target region that the
responder registered between guard bytes: a wrong rkey, the rkey of another
PD, a deregistered or invalidated region, missing remote rights, one byte past
either end, length 0, exactly the region (and, refused before it leaves, a
remote range that wraps at 2^64).
Each checks the requester's completion status, both QPs' states, the
Terminate code, the target bytes and the guard bytes around them (and, for a
Read, the requester's sink). ``MATRIX`` is the table in docs/security.md.
"""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio

from rdmashim import Access, QPState, RecvWR, SendFlags, SendWR, VerbsError, WCStatus, WROpcode

from pairs import Side, make_pair, settle

pytestmark = pytest.mark.usefixtures("each_engine")  # native and Python

SIZE = 4096
GUARD = 64
PATTERN = bytes((i * 131 + 7) & 0xFF for i in range(SIZE + 2 * GUARD))
RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
OK = WCStatus.SUCCESS
ACC = WCStatus.REM_ACCESS_ERR
T_STAG, T_BOUNDS, T_ASSOC = (
    "DDP/TAGGED/INVALID_STAG",
    "DDP/TAGGED/BASE_BOUNDS",
    ("DDP/TAGGED/STAG_NOT_ASSOC"),
)
R_STAG, R_BOUNDS, R_ASSOC, R_RIGHTS = (
    "RDMAP/REMOTE_PROTECTION/INVALID_STAG",
    "RDMAP/REMOTE_PROTECTION/BASE_BOUNDS",
    "RDMAP/REMOTE_PROTECTION/STAG_NOT_ASSOC",
    "RDMAP/REMOTE_PROTECTION/ACCESS_RIGHTS",
)

MATRIX: dict[str, dict[str, tuple[WCStatus, str | None]]] = {
    # cell: {op: (requester's WC status, Terminate code or None for no error)}
    "wrong rkey (key bits)": {"write": (OK, T_STAG), "read": (ACC, R_STAG)},
    "wrong rkey (index bits)": {"write": (OK, T_STAG), "read": (ACC, R_STAG)},
    "rkey of another PD": {"write": (OK, T_ASSOC), "read": (ACC, R_ASSOC)},
    "deregistered MR": {"write": (OK, T_STAG), "read": (ACC, R_STAG)},
    "no REMOTE_WRITE / REMOTE_READ": {"write": (OK, T_STAG), "read": (ACC, R_RIGHTS)},
    "one byte past the end": {"write": (OK, T_BOUNDS), "read": (ACC, R_BOUNDS)},
    "one byte before the start": {"write": (OK, T_BOUNDS), "read": (ACC, R_BOUNDS)},
    "length 0": {"write": (OK, None), "read": (OK, None)},
    "length 0, wrong rkey": {"write": (OK, None), "read": (OK, None)},
    "exactly the region": {"write": (OK, None), "read": (OK, None)},
    "last byte of the region": {"write": (OK, None), "read": (OK, None)},
    "invalidated by Send with Invalidate": {"write": (OK, T_STAG), "read": (ACC, R_STAG)},
}


async def _target(server: Side, cell: str, op: str) -> tuple[bytearray, Any]:
    """The guarded target region for ``cell``: (arena, MR)."""
    arena = bytearray(PATTERN)
    view = memoryview(arena)[GUARD : GUARD + SIZE]
    if cell == "rkey of another PD":
        return arena, server.ctx.alloc_pd().reg_mr(view, RW)
    if cell == "no REMOTE_WRITE / REMOTE_READ":
        missing = Access.REMOTE_WRITE if op == "write" else Access.REMOTE_READ
        return arena, server.pd.reg_mr(view, RW & ~missing)
    return arena, server.pd.reg_mr(view, RW)


async def _aim(client: Side, server: Side, cell: str, mr: Any) -> tuple[int, int, int]:
    """(rkey, remote address, length) the requester uses for ``cell``."""
    rkey, addr, length = mr.rkey, mr.iova, 16
    if cell == "wrong rkey (key bits)":
        rkey ^= 0x01
    elif cell == "wrong rkey (index bits)":
        rkey ^= 0x100
    elif cell == "deregistered MR":
        mr.close()
    elif cell == "one byte past the end":
        addr += SIZE - length + 1
    elif cell == "one byte before the start":
        addr -= 1
    elif cell == "length 0":
        length = 0
    elif cell == "length 0, wrong rkey":
        rkey, length = rkey ^ 0x01, 0
    elif cell == "exactly the region":
        length = SIZE
    elif cell == "last byte of the region":
        addr, length = addr + SIZE - 1, 1
    elif cell == "invalidated by Send with Invalidate":
        rbuf = server.reg(16)
        server.qp.post_recv(RecvWR(5, [rbuf.sge()]))
        client.qp.post_send(
            SendWR(5, WROpcode.SEND_WITH_INV, [], SendFlags.SIGNALED, invalidate_rkey=rkey)
        )
        with trio.fail_after(10):
            (wc,) = await server.recv_cq.poll_wait(1)
        assert wc.status == WCStatus.SUCCESS and wc.invalidated_rkey == rkey
        (wc,) = await client.send_cq.poll_wait(1)
        assert wc.status == WCStatus.SUCCESS
    return rkey, addr, length


async def run_cell(ctx: Any, cell: str, op: str) -> dict[str, Any]:
    """Run one cell; what the requester, both QPs and the memory show afterwards."""
    client, server = await make_pair(ctx)
    arena, mr = await _target(server, cell, op)
    rkey, addr, length = await _aim(client, server, cell, mr)
    source = client.reg(bytes((i * 7 + 1) & 0xFF for i in range(SIZE)))
    sink_bytes = b"\xee" * SIZE
    sink = client.reg(sink_bytes)
    sges = [] if not length else [(source if op == "write" else sink).sge(0, length)]
    opcode = WROpcode.RDMA_WRITE if op == "write" else WROpcode.RDMA_READ
    client.qp.post_send(SendWR(1, opcode, sges, SendFlags.SIGNALED, addr, rkey))
    with trio.fail_after(10):
        (wc,) = await client.send_cq.poll_wait(1)
    expected_code = MATRIX[cell][op][1]
    if expected_code is None and op == "write":
        await settle(client, mr)  # the Write is placed before we look at the target
    if expected_code is not None:
        with trio.fail_after(10):
            await client.qp.wait_closed()
            await server.qp.wait_closed()
    code = server.qp.error.code if expected_code is not None else None
    if code is not None:
        assert client.qp.remote_terminate == code
    offset = addr - mr.iova
    return {
        "status": wc.status,
        "requester": client.qp.state,
        "responder": server.qp.state,
        "code": str(code) if code is not None else None,
        "guards": arena[:GUARD] == PATTERN[:GUARD] and arena[-GUARD:] == PATTERN[-GUARD:],
        "target": bytes(arena[GUARD : GUARD + SIZE]),
        "sink": bytes(sink.buf),
        "placed": (offset, length),
        "source": bytes(source.buf),
    }


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("cell", list(MATRIX))
async def test_protection_matrix(ctx: Any, cell: str, op: str) -> None:
    result = await run_cell(ctx, cell, op)
    status, code = MATRIX[cell][op]
    assert (result["status"], result["code"]) == (status, code), result["status"]
    state = QPState.RTS if code is None else QPState.ERR
    assert result["requester"] == result["responder"] == state
    assert result["guards"], "a guard byte around the target changed"
    pristine = PATTERN[GUARD : GUARD + SIZE]
    offset, length = result["placed"]
    if op == "write" and code is None:
        expected = bytearray(pristine)
        expected[offset : offset + length] = result["source"][:length]
        assert result["target"] == bytes(expected)
    else:
        assert result["target"] == pristine, "the target changed"
    if op == "read":
        expected_sink = bytearray(b"\xee" * SIZE)
        if code is None:
            expected_sink[:length] = pristine[offset : offset + length]
        assert result["sink"] == bytes(expected_sink)


@pytest.mark.parametrize("op", [WROpcode.RDMA_WRITE, WROpcode.RDMA_READ])
async def test_a_remote_range_past_2_64_is_refused_when_posted(ctx: Any, op: WROpcode) -> None:
    client, server = await make_pair(ctx)
    arena = bytearray(PATTERN)
    mr = server.pd.reg_mr(memoryview(arena)[GUARD : GUARD + SIZE], RW, iova=(1 << 64) - SIZE)
    local = client.reg(SIZE)
    wrap = SendWR(1, op, [local.sge(0, 16)], SendFlags.SIGNALED, (1 << 64) - 8, mr.rkey)
    fits = SendWR(2, op, [local.sge(0, 8)], SendFlags.SIGNALED, (1 << 64) - 8, mr.rkey)
    with pytest.raises(VerbsError) as info:
        client.qp.post_send([fits, wrap])
    assert info.value.errno == errno.EINVAL and info.value.bad_wr == 1
    with trio.fail_after(10):
        (wc,) = await client.send_cq.poll_wait(1)
    assert (wc.wr_id, wc.status) == (2, WCStatus.SUCCESS)  # the one before it went out
    await settle(client, mr)
    assert client.qp.state == server.qp.state == QPState.RTS
    assert arena[:GUARD] == PATTERN[:GUARD] and arena[-GUARD:] == PATTERN[-GUARD:]
