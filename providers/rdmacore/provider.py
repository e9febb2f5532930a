"""The rdma-core backend's verbs objects, under the names every backend's provider uses.

The classes live in small modules: :mod:`.device` (devices, contexts),
:mod:`.memory` (PD, MR), :mod:`.completion` (completion channels, CQs),
:mod:`.queue_pair` (QPs, SRQs, work requests) and :mod:`.events` (async events).
"""

from rdmashim.providers.rdmacore.completion import CQ, CompChannel
from rdmashim.providers.rdmacore.device import (
    BACKEND_NAME,
    Context,
    Device,
    get_device_list,
    open_device,
    unavailable_reason,
)
from rdmashim.providers.rdmacore.memory import MR, PD
from rdmashim.providers.rdmacore.queue_pair import QP, SRQ

__all__ = [
    "BACKEND_NAME",
    "CQ",
    "MR",
    "PD",
    "QP",
    "SRQ",
    "CompChannel",
    "Context",
    "Device",
    "get_device_list",
    "open_device",
    "unavailable_reason",
]
