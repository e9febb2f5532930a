"""Test helper: two QPs of the native engine's C core (no sockets: the test carries the
bytes), with their CQs and one memory table, started, and freed afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.jobs import EngineConfig


@dataclass
class Core:
    """``a`` and ``b`` (QP numbers 1 and 2), their CQs (a's send and receive CQ, then
    b's), the memory table both use, and the protection domain they share."""

    memory: native.NativeMemory
    pd: object
    a: native.NativeQP
    b: native.NativeQP
    cqs: list[native.NativeCQ]


@contextlib.contextmanager
def two_qps(config: EngineConfig, cqe: int = 64) -> Iterator[Core]:
    """Two started native QPs; everything is closed at the end."""
    memory = native.NativeMemory()
    pd = object()
    cqs = [native.NativeCQ(cqe) for _ in range(4)]
    a = native.NativeQP(memory, pd, 1, cqs[0], cqs[1])
    b = native.NativeQP(memory, pd, 2, cqs[2], cqs[3])
    try:
        a.start(config)
        b.start(config)
        yield Core(memory, pd, a, b, cqs)
    finally:
        for q in (a, b):
            q.close()
        for cq in cqs:
            cq.close()
        memory.close()
