"""Helpers of the IB CM tests: callbacks recorded with their thread, service IDs, polling."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ibal.support import WAIT

from rdmashim.providers.ibal import IbCq, IbStatus
from rdmashim.providers.ibal.cm_types import RDMA_CM_SERVICE_ID
from rdmashim.providers.ibal.cq import ib_poll_cq, ib_wc_t, wc_list

TCP_PS = 0x0106


def free_port() -> int:
    """A TCP port nothing listens on right now (on loopback)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def service_id(port: int) -> int:
    """rdma_cm's service ID for ``port`` in the TCP port space."""
    return RDMA_CM_SERVICE_ID | TCP_PS << 16 | port


class Recorder:
    """Callbacks by name: each call is kept with the thread it ran on; ``wait`` blocks for one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, str]] = []
        self._cond = threading.Condition()
        self.hooks: dict[str, Callable[[Any], None]] = {}

    def cb(self, name: str) -> Callable[[Any], None]:
        def record(rec: Any) -> None:
            with self._cond:
                self.calls.append((name, rec, threading.current_thread().name))
                self._cond.notify_all()
            hook = self.hooks.get(name)
            if hook is not None:
                hook(rec)

        return record

    def names(self) -> list[str]:
        with self._cond:
            return [name for name, _, _ in self.calls]

    def wait(self, name: str, timeout: float = WAIT) -> Any:
        """The record of the first call of ``name`` (waiting for it); AssertionError if none."""
        with self._cond:
            found = self._cond.wait_for(lambda: any(n == name for n, _, _ in self.calls), timeout)
            assert found, f"no {name} callback within {timeout} s (got {self.names()})"
            return next(rec for n, rec, _ in self.calls if n == name)

    def threads(self) -> set[str]:
        with self._cond:
            return {thread for _, _, thread in self.calls}


def poll_one(cq: IbCq, timeout: float = WAIT) -> ib_wc_t:
    """The CQ's next completion, polled until it comes."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status, _, done = ib_poll_cq(cq, wc_list(1))
        if status is IbStatus.IB_SUCCESS:
            assert done is not None
            return done
        time.sleep(0.005)
    raise AssertionError(f"no completion within {timeout} s")
