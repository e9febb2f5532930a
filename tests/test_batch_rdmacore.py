"""rdma-core's batch posting without a device: a batch's C chain, what a post hands the
provider (a function standing in for ``ibv_post_send``) and how a refusal comes back."""

from __future__ import annotations

import errno
from typing import Any

import pytest

from rdmashim import SGE, RecvBatch, RecvWR, SendBatch, SendFlags, SendWR, VerbsError, WROpcode
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.queue_pair import WRChain, _post_batch, _recv_chain, _send_chain


class Provider:
    """Takes a chain as ``ibv_post_*`` would: walks ``next``, refusing ``refuse`` wr_ids."""

    def __init__(self, refuse: int | None = None) -> None:
        self.refuse = refuse
        self.posted: list[list[tuple[int, ...]]] = []

    def __call__(self, handle: Any, head: Any, bad: Any) -> int:
        taken = []
        wr = head + 0  # the array as a pointer, as C receives it
        while wr != ffi.NULL:
            if wr.wr_id == self.refuse:
                bad[0] = wr
                self.posted.append(taken)
                return errno.ENOMEM
            sges = tuple((wr.sg_list[j].addr, wr.sg_list[j].length) for j in range(wr.num_sge))
            taken.append((wr.wr_id, *sges))
            wr = wr.next
        self.posted.append(taken)
        return 0


def post(batch: Any, provider: Provider, kind: str = "send", **select: Any) -> None:
    factory = _send_chain if kind == "send" else _recv_chain
    chains = batch.prepared(WRChain, factory)
    entries = batch.select("post", select.get("count"), select.get("indices"))
    bad = ffi.new(f"struct ibv_{kind}_wr **")
    _post_batch(chains, provider, None, bad, "post", entries, select.get("refusal"))


def test_count_indices_and_changes() -> None:
    batch = RecvBatch(RecvWR(i, [SGE(100 * i, 10, 1)]) for i in range(4))
    p = Provider()
    post(batch, p, "recv")
    post(batch, p, "recv", count=2)
    post(batch, p, "recv", indices=[3, 0, 3])
    batch.set(1, wr_id=11, sg_list=[SGE(5, 6, 1), SGE(7, 8, 1)])
    post(batch, p, "recv")  # the chain is whole again after the shortened post
    assert p.posted == [
        [(0, (0, 10)), (1, (100, 10)), (2, (200, 10)), (3, (300, 10))],
        [(0, (0, 10)), (1, (100, 10))],
        [(3, (300, 10)), (0, (0, 10)), (3, (300, 10))],
        [(0, (0, 10)), (11, (5, 6), (7, 8)), (2, (200, 10)), (3, (300, 10))],
    ]


def test_refusals_name_their_position() -> None:
    batch = SendBatch(SendWR(i, WROpcode.SEND, [SGE(i, 1, 1)]) for i in range(5))
    with pytest.raises(VerbsError) as info:
        post(batch, Provider(refuse=3), indices=[4, 3, 1])
    assert (info.value.errno, info.value.bad_wr) == (errno.ENOMEM, 1)
    # Raw bytes without INLINE cannot be encoded: the entries before it go.
    batch.set(2, sg_list=[b"raw"])
    p = Provider()
    with pytest.raises(VerbsError) as info:
        post(batch, p)
    assert (info.value.errno, info.value.bad_wr) == (errno.EINVAL, 2)
    assert [w[0] for w in p.posted[0]] == [0, 1]
    # With INLINE they point at the bytes, which the provider copies when posting.
    batch.set(2, send_flags=SendFlags.INLINE)
    p = Provider()
    post(batch, p, count=3)
    assert p.posted[0][2][1][1] == 3
    # A device without immediate data refuses the first such entry, after the ones before.
    batch.set(1, opcode=WROpcode.SEND_WITH_IMM)
    p = Provider()
    with pytest.raises(VerbsError) as info:
        post(batch, p, refusal=lambda i: VerbsError(errno.EOPNOTSUPP, "post", f"{i}"))
    assert (info.value.errno, info.value.bad_wr) == (errno.EOPNOTSUPP, 1)
    assert [w[0] for w in p.posted[0]] == [0]
