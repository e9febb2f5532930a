"""An RDS node on the backend ``ibal`` and one on ``softiwarp`` exchange messages both ways."""

from __future__ import annotations

import pytest
import trio

from rdmashim.ulps.rds.node import RdsNode

A, B = "127.0.0.1", "127.0.0.2"


async def test_ibal_and_softiwarp_nodes_talk_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RDMASHIM_BACKEND", "ibal")  # each node's channel takes it when it starts
    async with RdsNode(A, 0) as on_ibal:
        monkeypatch.setenv("RDMASHIM_BACKEND", "softiwarp")
        async with RdsNode(B, on_ibal.port) as on_siw:
            sa, sb = on_ibal.bind(4000), on_siw.bind(5000)
            with trio.fail_after(20):
                for i in range(20):
                    await sa.sendto(b"to siw %d" % i, (B, 5000))
                    await sb.sendto(b"to ibal %d" % i, (A, 4000))
                for i in range(20):
                    assert (await sb.recvfrom()) == (b"to siw %d" % i, (A, 4000))
                    assert (await sa.recvfrom()) == (b"to ibal %d" % i, (B, 5000))
            backends = {
                conn.session.qp.context.backend
                for node in (on_ibal, on_siw)
                for conn in node.connections()
                if conn.session is not None
            }
            assert backends == {"ibal", "softiwarp"}
