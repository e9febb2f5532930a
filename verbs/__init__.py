"""The portable verbs API: enums, work requests, completions, attributes and errors.

Backends (``rdmashim.verbs.softiwarp``, ...) provide the objects (context, PD,
MR, CQ, QP, SRQ) with the same methods; applications reach them through
:func:`rdmashim.open_device`.
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
from rdmashim.verbs.errors import BackendUnavailable, CompletionError, NotSupported, VerbsError
from rdmashim.verbs.events import AsyncEvent, AsyncEventType
from rdmashim.verbs.wr import SGE, WC, RecvWR, SendWR

__all__ = [
    "SGE",
    "WC",
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
    "QPAttr",
    "QPCap",
    "QPState",
    "QPType",
    "RecvWR",
    "SendFlags",
    "SendWR",
    "Transport",
    "VerbsError",
    "WCFlags",
    "WCOpcode",
    "WCStatus",
    "WROpcode",
]
