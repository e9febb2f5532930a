"""Which data-path kernels the engine runs: the compiled accelerator or the Python reference.

The pattern of aiohttp, yarl and msgpack: ``_accel`` (C through cffi, built
when a compiler was there at install time) takes the per-FPDU work of bursts
of small Sends and of runs of tagged FPDUs, and the pure-Python kernels
(:mod:`.kernels`) are the reference and the fallback. The compiled kernels are
used when they were built and cffi's backend imports, unless the environment variable
``RDMASHIM_NO_EXTENSIONS`` is set (to anything but ``0``) when this module is
first imported. Each engine takes :func:`kernels` when it is created;
:func:`use` changes that choice for engines created later (the tests run every
engine suite on both).
"""

from __future__ import annotations

import logging
import os

from rdmashim.providers.softiwarp.kernels import Kernels, PyKernels

log = logging.getLogger(__name__)

ENV_NO_EXTENSIONS = "RDMASHIM_NO_EXTENSIONS"

PYTHON: Kernels = PyKernels()
"""The reference kernels."""


def _load_compiled() -> tuple[Kernels | None, str]:
    if os.environ.get(ENV_NO_EXTENSIONS, "") not in ("", "0"):
        return None, f"{ENV_NO_EXTENSIONS} is set"
    try:
        from rdmashim.providers.softiwarp.accel import CKernels
    except ImportError as exc:
        return None, f"not built or not loadable ({exc})"
    return CKernels(), ""


COMPILED, WHY_NOT = _load_compiled()
"""The compiled kernels, or None and the reason why not."""
if COMPILED is None:
    log.debug("soft-iWARP accelerator unavailable: %s", WHY_NOT)

_current: Kernels = COMPILED or PYTHON


def kernels() -> Kernels:
    """The kernels a new engine uses."""
    return _current


def accelerated() -> bool:
    """Whether new engines run the compiled kernels."""
    return _current.accelerated


def describe() -> str:
    """One line for info output: ``yes (...)`` or ``no (why)``."""
    if _current.accelerated:
        return f"yes ({_current.name})"
    return f"no ({WHY_NOT or 'the Python kernels were chosen'})"


def use(accelerated: bool) -> Kernels:
    """Make new engines use the compiled (True) or the Python (False) kernels; returns
    the kernels chosen before. Raises RuntimeError when the compiled ones are not there."""
    global _current
    before = _current
    if accelerated and COMPILED is None:
        raise RuntimeError(f"the compiled kernels are unavailable: {WHY_NOT}")
    _current = COMPILED if accelerated and COMPILED is not None else PYTHON
    return before


def restore(previous: Kernels) -> None:
    """Undo :func:`use` (give it what :func:`use` returned)."""
    global _current
    _current = previous
