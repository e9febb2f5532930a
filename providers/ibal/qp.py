"""Queue pairs: ``ib_create_qp`` ... ``ib_destroy_qp``, and binding a QP to its connection.

In IBAL a QP exists before its connection: ``ib_create_qp``, post receives,
then ``ib_cm_req``/``ib_cm_rep`` name the QP. The portable API (like iWARP
and rdma-core) creates a connected QP on a CM id instead
(``cm_id.create_qp``). So an :class:`IbQp` starts unbound: it keeps its
attributes, its IBAL state (moved by ``ib_modify_qp``: RESET, INIT, RTR,
RTS, ERROR) and the receives posted so far (in order, up to ``rq_depth``).
The CM code calls :meth:`IbQp.bind` with the CM id; that creates the
portable QP (``.qp``) with the PD's, CQs' and SRQ's portable objects and
posts the held receives. From then on the QP's state is the portable QP's.
Sends need a bound QP in RTS (or ERROR, where they complete flushed).
"""

from __future__ import annotations

import dataclasses
import errno
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from rdmashim.providers.ibal.al import DestroyCallback
from rdmashim.providers.ibal.ca import EventCallback, EventSource, close_quietly
from rdmashim.providers.ibal.cq import IbCq
from rdmashim.providers.ibal.memory import IbPd, ib_access_t
from rdmashim.providers.ibal.srq import IbSrq
from rdmashim.providers.ibal.status import IbError, IbStatus
from rdmashim.providers.ibal.wr import (
    ib_recv_wr_t,
    ib_send_wr_t,
    post_chain,
    to_recv_wr,
    to_send_wr,
)
from rdmashim.verbs.attrs import QPCap
from rdmashim.verbs.enums import QPState, WCOpcode, WCStatus
from rdmashim.verbs.errors import VerbsError
from rdmashim.verbs.wr import WC, RecvWR

if TYPE_CHECKING:
    from rdmashim.providers.ibal.cm import CmConnection


class ib_qp_type_t(IntEnum):
    """``ib_qp_type_t``; the portable API makes reliable connected QPs only."""

    IB_QPT_RELIABLE_CONN = 0
    IB_QPT_UNRELIABLE_CONN = 1
    IB_QPT_RELIABLE_DGRM = 2
    IB_QPT_UNRELIABLE_DGRM = 3
    IB_QPT_QP0 = 4
    IB_QPT_QP1 = 5
    IB_QPT_RAW_IPV6 = 6
    IB_QPT_RAW_ETHER = 7
    IB_QPT_MAD = 8
    IB_QPT_QP0_ALIAS = 9
    IB_QPT_QP1_ALIAS = 10
    IB_QPT_UNKNOWN = 11


class ib_qp_state_t(IntEnum):
    """``ib_qp_state_t``: IBAL's ``IB_QPS_*`` values (bit flags, not verbs' numbers)."""

    IB_QPS_RESET = 0x1
    IB_QPS_INIT = 0x2
    IB_QPS_RTR = 0x4
    IB_QPS_RTS = 0x8
    IB_QPS_SQD = 0x10
    IB_QPS_SQD_DRAINING = 0x30
    IB_QPS_SQD_DRAINED = 0x50
    IB_QPS_SQERR = 0x80
    IB_QPS_ERROR = 0x100
    IB_QPS_TIME_WAIT = 0xDEAD0000


Q = ib_qp_state_t
_FROM_PORTABLE = {
    QPState.RESET: Q.IB_QPS_RESET,
    QPState.INIT: Q.IB_QPS_INIT,
    QPState.RTR: Q.IB_QPS_RTR,
    QPState.RTS: Q.IB_QPS_RTS,
    QPState.SQD: Q.IB_QPS_SQD,
    QPState.SQE: Q.IB_QPS_SQERR,
    QPState.ERR: Q.IB_QPS_ERROR,
}
_NEXT: dict[ib_qp_state_t, frozenset[ib_qp_state_t]] = {
    Q.IB_QPS_RESET: frozenset({Q.IB_QPS_INIT}),
    Q.IB_QPS_INIT: frozenset({Q.IB_QPS_INIT, Q.IB_QPS_RTR}),
    Q.IB_QPS_RTR: frozenset({Q.IB_QPS_RTS}),
    Q.IB_QPS_RTS: frozenset({Q.IB_QPS_RTS}),
    Q.IB_QPS_SQERR: frozenset({Q.IB_QPS_RTS}),
}
"""The transitions ``ib_modify_qp`` allows besides any state to RESET or ERROR."""


def transition_allowed(current: ib_qp_state_t, requested: ib_qp_state_t) -> bool:
    """IBAL's rule: RESET->INIT->RTR->RTS (INIT->INIT, RTS->RTS), any->ERROR, any->RESET."""
    if requested in (Q.IB_QPS_RESET, Q.IB_QPS_ERROR):
        return True
    return requested in _NEXT.get(current, frozenset())


@dataclass(slots=True)
class ib_qp_create_t:
    """``ib_qp_create_t``: the QP's type, queue sizes, CQs, SRQ and signalling."""

    qp_type: ib_qp_type_t = ib_qp_type_t.IB_QPT_RELIABLE_CONN
    sq_depth: int = 128
    rq_depth: int = 128
    sq_sge: int = 1
    rq_sge: int = 1
    sq_max_inline: int = 0
    h_sq_cq: IbCq | None = None
    h_rq_cq: IbCq | None = None
    h_srq: IbSrq | None = None
    sq_signaled: bool = False
    """Whether every send request completes (else only those with IB_SEND_OPT_SIGNALED)."""


@dataclass(frozen=True, slots=True)
class ib_qp_attr_t:
    """``ib_qp_attr_t`` (the connected-QP fields; no address vectors, keys or PSNs).

    ``init_depth``/``resp_res`` are the RDMA Reads outstanding at the peer /
    served for the peer (ORD/IRD), ``num`` the QP number (0 until bound).
    """

    h_pd: IbPd
    qp_type: ib_qp_type_t
    access_ctrl: ib_access_t
    sq_max_inline: int
    sq_depth: int
    rq_depth: int
    sq_sge: int
    rq_sge: int
    init_depth: int
    resp_res: int
    h_sq_cq: IbCq
    h_rq_cq: IbCq
    h_srq: IbSrq | None
    sq_signaled: bool
    state: ib_qp_state_t
    num: int


@dataclass(slots=True)
class ib_qp_mod_t:
    """``ib_qp_mod_t``: the state to move to and what to set on the way (flattened).

    ``access_ctrl`` (INIT, RTR, RTS) is kept and reported; ``init_depth`` and
    ``resp_res`` are the connection's to negotiate once bound.
    """

    req_state: ib_qp_state_t
    access_ctrl: ib_access_t | None = None
    init_depth: int | None = None
    resp_res: int | None = None
    primary_port: int = 1


class IbQp(EventSource):
    """A queue pair (``ib_qp_handle_t``): see the module docstring.

    ``qp`` is the portable QP once :meth:`bind` made it (None before), ``pd``
    the PD, ``ca`` the CA, ``create`` a copy of the creation attributes.
    """

    invalid = IbStatus.IB_INVALID_QP_HANDLE

    def __init__(
        self, pd: IbPd, create: ib_qp_create_t, qp_context: Any, pfn_qp_event_cb: EventCallback
    ) -> None:
        super().__init__(pd.al, pd, qp_context, pfn_qp_event_cb)
        self.pd = pd
        self.ca = pd.ca
        self.cm_conn: CmConnection | None = None
        """The connection that binds it (set by :mod:`.cm`; IBAL keeps it in the QP too)."""
        self.create = dataclasses.replace(create)
        self.qp: Any = None
        self.access_ctrl = ib_access_t.NONE
        self.init_depth = 0
        self.resp_res = 0
        self._state = Q.IB_QPS_RESET
        self._held: list[RecvWR] = []
        for user_of in self._queues():
            user_of.users.add(self)

    def _queues(self) -> list[Any]:
        c = self.create
        return [q for q in (c.h_sq_cq, c.h_rq_cq, c.h_srq) if q is not None]

    @property
    def state(self) -> ib_qp_state_t:
        """The IBAL state: the facade's until bound, then the portable QP's."""
        if self.qp is None:
            return self._state
        return _FROM_PORTABLE.get(QPState(self.qp.state), Q.IB_QPS_ERROR)

    # ------------------------------------------------------------------ binding
    def bind(self, cm_id: Any) -> None:
        """Create the portable QP on ``cm_id`` and post the receives held so far.

        Called by the CM code (on the progress thread, or any other: the work
        runs there). IB_INVALID_STATE if already bound, IB_INVALID_QP_STATE if
        the QP is in ERROR; errors of ``cm_id.create_qp`` as their statuses.
        """
        self.al.call("bind", self._bind, cm_id)

    def _bind(self, cm_id: Any) -> None:
        self.check("bind")
        if self.qp is not None:
            raise IbError(IbStatus.IB_INVALID_STATE, "bind", "the QP is already bound")
        if self._state is Q.IB_QPS_ERROR:
            raise IbError(IbStatus.IB_INVALID_QP_STATE, "bind", "the QP is in ERROR")
        c = self.create
        assert c.h_sq_cq is not None and c.h_rq_cq is not None
        cap = QPCap(
            max_send_wr=c.sq_depth,
            max_recv_wr=c.rq_depth,
            max_send_sge=c.sq_sge,
            max_recv_sge=c.rq_sge,
            max_inline_data=c.sq_max_inline,
        )
        qp = cm_id.create_qp(
            self.pd.pd,
            send_cq=c.h_sq_cq.cq,
            recv_cq=c.h_rq_cq.cq,
            cap=cap,
            srq=c.h_srq.srq if c.h_srq is not None else None,
            sq_sig_all=bool(c.sq_signaled),
        )
        self.qp = qp
        self.ca.register(qp, self)
        held, self._held = self._held, []
        if held:
            qp.post_recv(held)

    # ------------------------------------------------------------------ calls
    def query(self) -> ib_qp_attr_t:
        """The ``ib_query_qp`` body."""
        self.check("ib_query_qp")
        c = self.create
        assert c.h_sq_cq is not None and c.h_rq_cq is not None
        num, init_depth, resp_res = 0, self.init_depth, self.resp_res
        if self.qp is not None:
            attr = self.qp.query()
            num, init_depth, resp_res = attr.qp_num, attr.max_rd_atomic, attr.max_dest_rd_atomic
        return ib_qp_attr_t(
            h_pd=self.pd,
            qp_type=ib_qp_type_t(c.qp_type),
            access_ctrl=self.access_ctrl,
            sq_max_inline=c.sq_max_inline,
            sq_depth=c.sq_depth,
            rq_depth=c.rq_depth,
            sq_sge=c.sq_sge,
            rq_sge=c.rq_sge,
            init_depth=init_depth,
            resp_res=resp_res,
            h_sq_cq=c.h_sq_cq,
            h_rq_cq=c.h_rq_cq,
            h_srq=c.h_srq,
            sq_signaled=bool(c.sq_signaled),
            state=self.state,
            num=num,
        )

    def modify(self, mod: ib_qp_mod_t) -> None:
        """The ``ib_modify_qp`` body: IBAL's state rules (see :func:`transition_allowed`)."""
        self.check("ib_modify_qp")
        try:
            requested = ib_qp_state_t(mod.req_state)
        except ValueError:
            raise IbError(
                IbStatus.IB_INVALID_SETTING, "ib_modify_qp", f"req_state {mod.req_state:#x}"
            ) from None
        current = self.state
        if not transition_allowed(current, requested):
            raise IbError(
                IbStatus.IB_INVALID_QP_STATE,
                "ib_modify_qp",
                f"{current.name} to {requested.name}",
            )
        if self.qp is not None:
            self._modify_bound(current, requested)
        elif requested is Q.IB_QPS_ERROR:
            self._flush_held()
        elif requested is Q.IB_QPS_RESET:
            self._held.clear()
        if mod.access_ctrl is not None:
            self.access_ctrl = ib_access_t(mod.access_ctrl)
        if self.qp is None:
            self.init_depth = mod.init_depth if mod.init_depth is not None else self.init_depth
            self.resp_res = mod.resp_res if mod.resp_res is not None else self.resp_res
            self._state = requested

    def _modify_bound(self, current: ib_qp_state_t, requested: ib_qp_state_t) -> None:
        if requested is Q.IB_QPS_ERROR:
            self.qp.modify(qp_state=QPState.ERR)
        elif requested is not current:
            raise IbError(
                IbStatus.IB_UNSUPPORTED,
                "ib_modify_qp",
                f"{current.name} to {requested.name}: the connection moves a bound QP",
            )

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        cq = self.create.h_rq_cq
        if cq is not None and held:
            cq.inject([WC(w.wr_id, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV) for w in held])

    def post_recvs(self, portable: list[RecvWR]) -> None:
        """Post receives: to the portable QP, or held until :meth:`bind`."""
        if self.qp is not None:
            self.qp.post_recv(portable)
            return
        for i, wr in enumerate(portable):
            if self._state is not Q.IB_QPS_ERROR and len(self._held) >= self.create.rq_depth:
                error = VerbsError(
                    errno.ENOMEM, "ib_post_recv", f"receive queue full ({self.create.rq_depth})"
                )
                error.bad_wr = i
                raise error
            self._held.append(wr)
        if self._state is Q.IB_QPS_ERROR:
            self._flush_held()

    def post_recv_chain(self, head: ib_recv_wr_t) -> None:
        """The ``ib_post_recv`` body."""
        self.check("ib_post_recv")
        if self.create.h_srq is not None:
            raise IbError(IbStatus.IB_INVALID_PARAMETER, "ib_post_recv", "the QP uses an SRQ")
        sge = self.create.rq_sge
        post_chain(
            "ib_post_recv", head, lambda wr: to_recv_wr("ib_post_recv", wr, sge), self.post_recvs
        )

    def post_send_chain(self, head: ib_send_wr_t) -> None:
        """The ``ib_post_send`` body: IB_INVALID_QP_STATE unless bound and in RTS (or ERROR)."""
        self.check("ib_post_send")
        state = self.state
        if self.qp is None or state not in (Q.IB_QPS_RTS, Q.IB_QPS_ERROR):
            where = "unbound" if self.qp is None else state.name
            error = IbError(IbStatus.IB_INVALID_QP_STATE, "ib_post_send", f"the QP is {where}")
            error.failed_wr = head
            raise error
        sge = self.create.sq_sge
        post_chain("ib_post_send", head, lambda wr: to_send_wr(wr, sge), self.qp.post_send)

    def _close_resources(self) -> None:
        for queue in self._queues():
            queue.users.discard(self)
        if self.qp is not None:
            self.ca.unregister(self.qp)
            close_quietly(self.qp)
        self._held.clear()


def _check_create(pd: IbPd, create: ib_qp_create_t) -> None:
    call = "ib_create_qp"
    pd.check(call)
    if create.qp_type != ib_qp_type_t.IB_QPT_RELIABLE_CONN:
        raise IbError(IbStatus.IB_UNSUPPORTED, call, "reliable connected QPs only")
    for cq in (create.h_sq_cq, create.h_rq_cq):
        if cq is None or cq.destroyed or cq.ca is not pd.ca:
            raise IbError(IbStatus.IB_INVALID_CQ_HANDLE, call, "a CQ of the PD's CA is needed")
    srq = create.h_srq
    if srq is not None and (srq.destroyed or srq.pd is not pd):
        raise IbError(IbStatus.IB_INVALID_SRQ_HANDLE, call, "the SRQ must be of the same PD")
    dev = pd.ca.context.query_device()
    if not (1 <= create.sq_depth <= dev.max_qp_wr and 0 <= create.rq_depth <= dev.max_qp_wr):
        raise IbError(IbStatus.IB_INVALID_MAX_WRS, call, f"depths past {dev.max_qp_wr}")
    if not (0 <= create.sq_sge <= dev.max_sge and 0 <= create.rq_sge <= dev.max_sge):
        raise IbError(IbStatus.IB_INVALID_MAX_SGE, call, f"SGEs past {dev.max_sge}")
    if not 0 <= create.sq_max_inline <= dev.max_inline_data:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, f"inline past {dev.max_inline_data}")


def ib_create_qp(
    h_pd: IbPd,
    create: ib_qp_create_t,
    qp_context: Any = None,
    pfn_qp_event_cb: EventCallback = None,
) -> IbQp:
    """Create a QP on the PD (``ib_create_qp``), unbound and in RESET (module docstring)."""
    h_pd.check("ib_create_qp")
    return h_pd.al.call("ib_create_qp", _create_qp, h_pd, create, qp_context, pfn_qp_event_cb)


def _create_qp(
    pd: IbPd, create: ib_qp_create_t, qp_context: Any, pfn_qp_event_cb: EventCallback
) -> IbQp:
    _check_create(pd, create)
    return IbQp(pd, create, qp_context, pfn_qp_event_cb)


def ib_query_qp(h_qp: IbQp) -> ib_qp_attr_t:
    """The QP's attributes and state (``ib_query_qp``)."""
    return h_qp.al.call("ib_query_qp", h_qp.query)


def ib_modify_qp(h_qp: IbQp, mod: ib_qp_mod_t) -> None:
    """Move the QP to ``mod.req_state`` (``ib_modify_qp``); IB_INVALID_QP_STATE if not allowed."""
    h_qp.al.call("ib_modify_qp", h_qp.modify, mod)


def ib_post_send(h_qp: IbQp, p_send_wr: ib_send_wr_t) -> None:
    """Post a chain of send requests (``ib_post_send``); a refusal's IbError has ``failed_wr``."""
    h_qp.check("ib_post_send")
    h_qp.al.call("ib_post_send", h_qp.post_send_chain, p_send_wr)


def ib_post_recv(h_qp: IbQp, p_recv_wr: ib_recv_wr_t) -> None:
    """Post a chain of receive requests (``ib_post_recv``); held until the QP is bound."""
    h_qp.check("ib_post_recv")
    h_qp.al.call("ib_post_recv", h_qp.post_recv_chain, p_recv_wr)


def ib_destroy_qp(h_qp: IbQp, pfn_destroy_cb: DestroyCallback = None) -> None:
    """Destroy the QP (``ib_destroy_qp``): its outstanding work is flushed."""
    h_qp.destroy("ib_destroy_qp", pfn_destroy_cb)
