"""Backends by name, chosen by ``backend=`` or ``RDMASHIM_BACKEND``; the default is softiwarp.

The facade's name for the registry, which lives in the portable verbs
(:mod:`rdmashim.verbs.backend`) so that the verbs, the CM and the backends
pick a backend without reaching up into the facade. Every name here is that
module's, re-exported unchanged.
"""

from __future__ import annotations

from rdmashim.verbs.backend import (
    BACKENDS,
    DEFAULT_BACKEND,
    ENV_VAR,
    BackendInfo,
    backend_status,
    chosen_backend,
    load_backend,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "ENV_VAR",
    "BackendInfo",
    "backend_status",
    "chosen_backend",
    "load_backend",
]
