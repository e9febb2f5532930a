"""The built-in soft-iWARP engine: MPA/DDP/RDMAP over TCP in pure Python.

Wire-compatible with the Linux kernel's siw driver. Layers, bottom up: pure
codecs (:mod:`.mpa`, :mod:`.ddp`, :mod:`.terminate`), MPA setup rules
(:mod:`.negotiation`), the per-QP protocol engine (:mod:`.engine`), the trio
I/O (:mod:`.driver`), the verbs objects (:mod:`.provider`), connecting a QP
over a TCP stream (:mod:`.connection`), the rdma_cm ids (:mod:`.cm_id`) and
the backend object the registry hands out (:mod:`.backend`, ``BACKEND``).
"""

from rdmashim.providers.softiwarp.backend import BACKEND
from rdmashim.providers.softiwarp.engines import open_device
from rdmashim.providers.softiwarp.provider import Device, get_device_list

__all__ = ["BACKEND", "Device", "get_device_list", "open_device"]
