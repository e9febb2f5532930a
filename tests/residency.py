"""The resident size of this process, as the soak tests read it.

Read from ``/proc/self/statm`` after a garbage collection and glibc's
``malloc_trim(0)``, so heap pages that were freed count as freed (without the
trim, glibc keeps them and the figure swings by megabytes).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource

PAGE = resource.getpagesize()
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def resident_bytes() -> int:
    """The resident size after collecting garbage and trimming the malloc heap."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE
