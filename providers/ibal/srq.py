"""Shared receive queues: ``ib_create_srq`` ... ``ib_destroy_srq``.

The portable API creates an SRQ with a depth and a scatter/gather limit and
posts receives to it; it has no limit event and no resize, so
``srq_limit`` must be 0 and ``ib_modify_srq`` answers IB_UNSUPPORTED unless
the HCA's SRQ offers ``modify``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag
from typing import Any

from rdmashim.providers.ibal.al import DestroyCallback
from rdmashim.providers.ibal.ca import EventCallback, SharedQueue, close_quietly
from rdmashim.providers.ibal.memory import IbPd
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.providers.ibal.wr import ib_recv_wr_t, post_chain, to_recv_wr


class ib_srq_attr_mask_t(IntFlag):
    """``ib_srq_attr_mask_t``: which fields ``ib_modify_srq`` changes."""

    NONE = 0
    IB_SRQ_MAX_WR = 1
    IB_SRQ_LIMIT = 2


@dataclass(slots=True)
class ib_srq_attr_t:
    """``ib_srq_attr_t``: depth, scatter/gather entries, and the limit-event watermark."""

    max_wr: int
    max_sge: int = 1
    srq_limit: int = 0


class IbSrq(SharedQueue):
    """A shared receive queue (``ib_srq_handle_t``); ``srq`` is the portable SRQ."""

    invalid = IbStatus.IB_INVALID_SRQ_HANDLE

    def __init__(
        self, pd: IbPd, portable: Any, attr: ib_srq_attr_t, srq_context: Any, cb: EventCallback
    ) -> None:
        super().__init__(pd.al, pd, srq_context, cb)
        self.pd = pd
        self.srq = portable
        self.attr = ib_srq_attr_t(attr.max_wr, attr.max_sge, attr.srq_limit)
        pd.ca.register(portable, self)

    def post_recv_chain(self, head: ib_recv_wr_t) -> None:
        """The ``ib_post_srq_recv`` body."""
        self.check("ib_post_srq_recv")
        post_chain(
            "ib_post_srq_recv",
            head,
            lambda wr: to_recv_wr("ib_post_srq_recv", wr, self.attr.max_sge),
            self.srq.post_recv,
        )

    def query(self) -> ib_srq_attr_t:
        """The ``ib_query_srq`` body."""
        self.check("ib_query_srq")
        a = self.attr
        return ib_srq_attr_t(a.max_wr, a.max_sge, a.srq_limit)

    def modify(self, attr: ib_srq_attr_t, mask: ib_srq_attr_mask_t) -> None:
        """The ``ib_modify_srq`` body."""
        self.check("ib_modify_srq")
        if not mask & (ib_srq_attr_mask_t.IB_SRQ_MAX_WR | ib_srq_attr_mask_t.IB_SRQ_LIMIT):
            raise IbError(IbStatus.IB_INVALID_SETTING, "ib_modify_srq", "empty mask")
        modify = getattr(self.srq, "modify", None)
        if modify is None:
            raise IbError(IbStatus.IB_UNSUPPORTED, "ib_modify_srq", "the HCA cannot modify an SRQ")
        kwargs = {}
        if mask & ib_srq_attr_mask_t.IB_SRQ_MAX_WR:
            kwargs["max_wr"] = self.attr.max_wr = attr.max_wr
        if mask & ib_srq_attr_mask_t.IB_SRQ_LIMIT:
            kwargs["srq_limit"] = self.attr.srq_limit = attr.srq_limit
        modify(**kwargs)

    def _close_resources(self) -> None:
        self.pd.ca.unregister(self.srq)
        close_quietly(self.srq)


def ib_create_srq(
    h_pd: IbPd,
    srq_attr: ib_srq_attr_t,
    srq_context: Any = None,
    pfn_srq_event_cb: EventCallback = None,
) -> IbSrq:
    """Create an SRQ on the PD (``ib_create_srq``).

    IB_INVALID_MAX_WRS / IB_INVALID_MAX_SGE past the CA's limits;
    IB_UNSUPPORTED for a nonzero ``srq_limit`` (no limit event portably).
    """
    h_pd.check("ib_create_srq")
    return h_pd.al.call("ib_create_srq", _create_srq, h_pd, srq_attr, srq_context, pfn_srq_event_cb)


def _create_srq(pd: IbPd, attr: ib_srq_attr_t, srq_context: Any, cb: EventCallback) -> IbSrq:
    call = "ib_create_srq"
    pd.check(call)
    dev = pd.ca.context.query_device()
    if not 1 <= attr.max_wr <= dev.max_srq_wr:
        raise IbError(IbStatus.IB_INVALID_MAX_WRS, call, f"max_wr {attr.max_wr}")
    if not 0 <= attr.max_sge <= dev.max_srq_sge:
        raise IbError(IbStatus.IB_INVALID_MAX_SGE, call, f"max_sge {attr.max_sge}")
    if attr.srq_limit:
        raise IbError(IbStatus.IB_UNSUPPORTED, call, "no SRQ limit event over the portable API")
    portable = pd.pd.create_srq(attr.max_wr, attr.max_sge)
    return IbSrq(pd, portable, attr, srq_context, cb)


def ib_post_srq_recv(h_srq: IbSrq, p_recv_wr: ib_recv_wr_t) -> None:
    """Post a chain of receives to the SRQ (``ib_post_srq_recv``); IbError has ``failed_wr``."""
    h_srq.check("ib_post_srq_recv")
    h_srq.al.call("ib_post_srq_recv", h_srq.post_recv_chain, p_recv_wr)


def ib_query_srq(h_srq: IbSrq) -> ib_srq_attr_t:
    """The SRQ's attributes (``ib_query_srq``)."""
    return h_srq.al.call("ib_query_srq", h_srq.query)


def ib_modify_srq(h_srq: IbSrq, srq_attr: ib_srq_attr_t, srq_attr_mask: ib_srq_attr_mask_t) -> None:
    """Change the SRQ's depth or limit (``ib_modify_srq``) where the HCA can."""
    h_srq.al.call("ib_modify_srq", h_srq.modify, srq_attr, srq_attr_mask)


def ib_destroy_srq(h_srq: IbSrq, pfn_destroy_cb: DestroyCallback = None) -> None:
    """Destroy the SRQ (``ib_destroy_srq``); IB_RESOURCE_BUSY while QPs use it."""
    h_srq.destroy_idle("ib_destroy_srq", pfn_destroy_cb)
