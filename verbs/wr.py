"""Work requests, scatter/gather elements and work completions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

from rdmashim.verbs.enums import SendFlags, WCFlags, WCOpcode, WCStatus, WROpcode
from rdmashim.verbs.errors import CompletionError


class SGE(NamedTuple):
    """One scatter/gather element: ``length`` bytes at ``addr`` in the region of ``lkey``."""

    addr: int
    length: int
    lkey: int


InlineData: TypeAlias = bytes | bytearray | memoryview
"""What an inline send's ``sg_list`` may hold besides SGEs."""


@dataclass(slots=True)
class SendWR:
    """A send queue work request (``ibv_send_wr``).

    ``sg_list`` holds SGEs, or, with ``SendFlags.INLINE``, may hold plain bytes-like
    objects whose contents are copied at post time. ``remote_addr``/``rkey`` name
    the peer's buffer for RDMA Write and Read; ``invalidate_rkey`` the STag a
    Send with Invalidate invalidates at the peer.
    """

    wr_id: int = 0
    opcode: WROpcode = WROpcode.SEND
    sg_list: Sequence[SGE | InlineData] = ()
    send_flags: SendFlags = SendFlags.SIGNALED
    remote_addr: int = 0
    rkey: int = 0
    invalidate_rkey: int = 0
    imm_data: int = 0


@dataclass(slots=True)
class RecvWR:
    """A receive queue work request (``ibv_recv_wr``)."""

    wr_id: int = 0
    sg_list: Sequence[SGE] = ()


class WC(NamedTuple):
    """A work completion (``ibv_wc``); a named tuple, so cheap to make and compare."""

    wr_id: int
    status: WCStatus
    opcode: WCOpcode
    byte_len: int = 0
    qp_num: int = 0
    wc_flags: WCFlags = WCFlags.NONE
    invalidated_rkey: int = 0
    vendor_err: int = 0
    solicited: bool = False
    """Whether the message was a Send with Solicited Event (what ``req_notify(True)`` waits for)."""
    imm_data: int = 0
    """Immediate data (host order) when ``wc_flags`` has ``WITH_IMM``; iWARP without RFC
    7306 carries none."""

    def raise_for_status(self) -> WC:
        """Return self if the work request succeeded, else raise :class:`CompletionError`."""
        if self.status != WCStatus.SUCCESS:
            raise CompletionError(self, self.status)
        return self
