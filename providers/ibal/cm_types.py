"""The IB CM's structures: what the calls take (``ib_cm_*_t``) and the callbacks get (``*_rec_t``).

Field names are IBAL's (``ib_al.h``); a pointer and its length become one
``bytes`` field (``p_req_pdata`` and ``req_length`` are ``p_req_pdata``), a
callback pointer is a Python callable or None. Each callback is registered on
the structure of the step before it, as in IBAL: ``ib_cm_req_t`` names the REP,
REJ and MRA callbacks of the active side, ``ib_cm_rep_t`` the RTU, REJ, MRA and
DREQ callbacks of the passive side, ``ib_cm_rtu_t`` the active side's DREQ
callback, ``ib_cm_dreq_t`` the DREP callback.

Service IDs map to TCP ports on an IP transport (:func:`port_of_service_id`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rdmashim.cm.types import PortSpace
from rdmashim.providers.ibal.cm_state import ib_rej_status_t
from rdmashim.providers.ibal.ibat import ib_path_rec_t
from rdmashim.providers.ibal.status import IbError, IbStatus

IB_ALL_CAS = 0
IB_ALL_PORTS = 0
IB_QPT_RELIABLE_CONN = 0
"""``ib_qp_type_t``'s RC value: the only CM service type an iWARP transport offers."""
RDMA_CM_SERVICE_ID = 0x0000000001000000
"""The rdma_cm form of a service ID: ``RDMA_CM_SERVICE_ID | port space << 16 | port``."""
DEFAULT_RESP_TIMEOUT = 20
"""``remote_resp_timeout`` when none is given: 4.096 us * 2^20, about 4.3 s per try."""
DEFAULT_CM_RETRIES = 1
DEFAULT_DEPTH = 16
"""RDMA Read depth (``resp_res``/``init_depth``) when none is given: the portable CM's."""


def port_of_service_id(svc_id: int, call: str) -> int:
    """The TCP port a service ID stands for on an IP transport: its low 16 bits.

    A service ID in rdma_cm's form (``0x0000000001000000 | ps << 16 | port``)
    must name a connected port space (TCP or IB); other service IDs map by their
    low 16 bits alone, so IDs that differ only above them share a port. Port 0
    cannot be listened on or connected to. Either refusal is IB_INVALID_SETTING.
    """
    if not 0 <= svc_id < 1 << 64:
        raise IbError(IbStatus.IB_INVALID_SETTING, call, f"service ID {svc_id:#x} is not 64-bit")
    port = svc_id & 0xFFFF
    if svc_id >> 24 == 1:
        ps = (svc_id >> 16) & 0xFF
        if ps not in (PortSpace.TCP & 0xFF, PortSpace.IB & 0xFF):
            raise IbError(
                IbStatus.IB_INVALID_SETTING,
                call,
                f"service ID {svc_id:#x} is in rdma_cm port space {ps:#x}, not a connected one",
            )
    if port == 0:
        raise IbError(
            IbStatus.IB_INVALID_SETTING,
            call,
            f"service ID {svc_id:#x} maps to TCP port 0 (its low 16 bits name the port)",
        )
    return port


# ---------------------------------------------------------------------------- callback records
@dataclass(frozen=True, slots=True)
class ib_cm_req_rec_t:
    """A connection request, given to the listen's ``pfn_cm_req_cb``.

    Answer it with ``ib_cm_rep(h_cm_req, ...)``, ``ib_cm_rej`` or ``ib_cm_mra``.
    ``primary_path`` is the path as the requester sees it (its GID is ``sgid``).
    """

    context: Any
    h_cm_req: Any
    h_cm_listen: Any
    p_req_pdata: bytes
    qp_type: int
    resp_res: int
    flow_ctrl: bool
    rnr_retry_cnt: int
    primary_path: ib_path_rec_t


@dataclass(frozen=True, slots=True)
class ib_cm_rep_rec_t:
    """The reply to ``ib_cm_req``: answer with ``ib_cm_rtu(h_cm_rep, ...)`` or ``ib_cm_rej``."""

    p_rep_pdata: bytes
    qp_type: int
    h_cm_rep: Any
    qp_context: Any
    resp_res: int
    flow_ctrl: bool


@dataclass(frozen=True, slots=True)
class ib_cm_rtu_rec_t:
    """The passive side's connection is ready to use (iWARP carries no RTU private data)."""

    p_rtu_pdata: bytes
    h_qp: Any
    qp_context: Any


@dataclass(frozen=True, slots=True)
class ib_cm_rej_rec_t:
    """The connection was rejected, refused or timed out (``rej_status`` says which)."""

    rej_status: ib_rej_status_t
    p_ari: bytes
    p_rej_pdata: bytes
    h_qp: Any
    qp_context: Any


@dataclass(frozen=True, slots=True)
class ib_cm_mra_rec_t:
    """The peer acknowledged a message it needs time to answer (never raised on iWARP)."""

    p_mra_pdata: bytes
    h_qp: Any
    qp_context: Any


@dataclass(frozen=True, slots=True)
class ib_cm_dreq_rec_t:
    """The peer disconnected: answer with ``ib_cm_drep(h_cm_dreq, ...)``."""

    h_cm_dreq: Any
    p_dreq_pdata: bytes
    qp_context: Any


@dataclass(frozen=True, slots=True)
class ib_cm_drep_rec_t:
    """Our ``ib_cm_dreq`` completed (``cm_status`` IB_SUCCESS)."""

    cm_status: IbStatus
    p_drep_pdata: bytes
    h_qp: Any
    qp_context: Any


Callback = Callable[[Any], None] | None


# ---------------------------------------------------------------------------- call structures
@dataclass(slots=True)
class ib_cm_listen_t:
    """What ``ib_cm_listen`` listens for.

    ``ca_guid``/``port_guid`` direct the listen to one open CA (or port) or,
    as IB_ALL_CAS/IB_ALL_PORTS, to every CA open in the AL when the listen is
    made. A REQ matches when its private data holds ``p_compare_buffer`` at
    ``compare_offset`` (``compare_length`` bytes; 0: any REQ).
    """

    svc_id: int
    ca_guid: int = IB_ALL_CAS
    port_guid: int = IB_ALL_PORTS
    p_compare_buffer: bytes = b""
    compare_offset: int = 0
    compare_length: int = 0
    pfn_cm_req_cb: Callback = None
    qp_type: int = IB_QPT_RELIABLE_CONN
    lid: int = 0
    pkey: int = 0
    ip: str = ""
    """An extension: listen at this local IP address only ("": every address of the CA's
    interface, IBAL's per-CA listen); rdma_cm's listen on a bound address uses it."""


@dataclass(slots=True)
class ib_cm_req_t:
    """A connection request (``ib_cm_req``).

    The REP is awaited ``(max_cm_retries + 1) * 4.096 us * 2^remote_resp_timeout``
    (``timeout_ms`` instead when set), and the same bound applies to reaching the
    peer at all; then the REJ callback reports IB_REJ_TIMEOUT.
    """

    svc_id: int
    h_qp: Any
    p_primary_path: ib_path_rec_t | None
    pfn_cm_rep_cb: Callback = None
    pfn_cm_rej_cb: Callback = None
    pfn_cm_mra_cb: Callback = None
    p_req_pdata: bytes = b""
    qp_type: int = IB_QPT_RELIABLE_CONN
    max_cm_retries: int = DEFAULT_CM_RETRIES
    resp_res: int = DEFAULT_DEPTH
    init_depth: int = DEFAULT_DEPTH
    remote_resp_timeout: int = DEFAULT_RESP_TIMEOUT
    local_resp_timeout: int = DEFAULT_RESP_TIMEOUT
    flow_ctrl: bool = False
    rnr_nak_timeout: int = 0
    rnr_retry_cnt: int = 7
    retry_cnt: int = 7
    timeout_ms: int = 0
    flags: int = 0
    pkey: int = 0


@dataclass(slots=True)
class ib_cm_rep_t:
    """The passive side's acceptance (``ib_cm_rep``); its callbacks serve the connection."""

    h_qp: Any
    p_rep_pdata: bytes = b""
    pfn_cm_rtu_cb: Callback = None
    pfn_cm_rej_cb: Callback = None
    pfn_cm_mra_cb: Callback = None
    pfn_cm_dreq_cb: Callback = None
    qp_type: int = IB_QPT_RELIABLE_CONN
    init_depth: int = DEFAULT_DEPTH
    flow_ctrl: bool = False
    rnr_nak_timeout: int = 0
    rnr_retry_cnt: int = 7
    flags: int = 0


@dataclass(slots=True)
class ib_cm_rtu_t:
    """The active side's ready-to-use (``ib_cm_rtu``): its DREQ callback."""

    p_rtu_pdata: bytes = b""
    pfn_cm_dreq_cb: Callback = None


@dataclass(slots=True)
class ib_cm_rej_t:
    """A rejection (``ib_cm_rej``)."""

    rej_status: ib_rej_status_t = ib_rej_status_t.IB_REJ_USER_DEFINED
    p_ari: bytes = b""
    p_rej_pdata: bytes = b""


@dataclass(slots=True)
class ib_cm_mra_t:
    """A message-received acknowledgement (``ib_cm_mra``)."""

    svc_timeout: int = 0
    p_mra_pdata: bytes = b""


@dataclass(slots=True)
class ib_cm_dreq_t:
    """A disconnection request (``ib_cm_dreq``) for ``h_qp``'s connection."""

    h_qp: Any
    p_dreq_pdata: bytes = b""
    pfn_cm_drep_cb: Callback = None
    qp_type: int = IB_QPT_RELIABLE_CONN
    flags: int = 0


@dataclass(slots=True)
class ib_cm_drep_t:
    """The answer to the peer's disconnection (``ib_cm_drep``)."""

    p_drep_pdata: bytes = b""
