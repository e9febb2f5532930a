"""The portable verbs API: enums, work requests, completions, attributes and errors.

Backends (``rdmashim.providers.softiwarp``, ...) provide the objects (context, PD,
MR, CQ, QP, SRQ) that :mod:`rdmashim.verbs.abc` describes; applications reach
them through :func:`rdmashim.open_device`, the registry through each backend's
:class:`~rdmashim.verbs.backend.Backend`.
"""

from rdmashim.verbs.attrs import DeviceAttr, PortAttr, QPAttr, QPCap
from rdmashim.verbs.enums import (
    Access,
    AtomicCap,
    Mtu,
    NodeType,
    PortState,
    QPState,
    QPType,
    SendFlags,
    Transport,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from rdmashim.verbs.errors import (
    BackendUnavailable,
    CompletionError,
    NotSupported,
    ProtocolViolation,
    VerbsError,
)
from rdmashim.verbs.events import AsyncEvent, AsyncEventType
from rdmashim.verbs.wr import SGE, WC, WC_ROW, RecvBatch, RecvWR, SendBatch, SendWR, WCArray

__all__ = [
    "SGE",
    "WC",
    "WC_ROW",
    "Access",
    "AsyncEvent",
    "AsyncEventType",
    "AtomicCap",
    "BackendUnavailable",
    "CompletionError",
    "DeviceAttr",
    "Mtu",
    "NodeType",
    "NotSupported",
    "PortAttr",
    "PortState",
    "ProtocolViolation",
    "QPAttr",
    "QPCap",
    "QPState",
    "QPType",
    "RecvBatch",
    "RecvWR",
    "SendBatch",
    "SendFlags",
    "SendWR",
    "Transport",
    "VerbsError",
    "WCArray",
    "WCFlags",
    "WCOpcode",
    "WCStatus",
    "WROpcode",
]
