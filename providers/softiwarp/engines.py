"""Which engine a device runs: the one place the choice is made.

The built-in transport has two engines behind one set of verbs objects: the native
one (``_engine.c``, :mod:`.native_provider`), and the pure-Python one
(:mod:`.engine`, :mod:`.provider`), its readable reference and fallback. The choice
is made once per device, when it is opened, from the environment at that moment:

- ``RDMASHIM_ENGINE=python`` or ``RDMASHIM_ENGINE=native`` asks for one;
- ``RDMASHIM_NO_EXTENSIONS`` (anything but ``0``) means Python, as it turns off the
  compiled kernels (:mod:`.fastpath`);
- otherwise the default, :data:`DEFAULT`.

Asking for the native engine where it is not built raises ``BackendUnavailable``
naming why. ``rdmashim devinfo`` and every benchmark header show what
:func:`describe` says.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from rdmashim.providers.softiwarp import native
from rdmashim.providers.softiwarp.provider import Context, find_device
from rdmashim.verbs.errors import BackendUnavailable
from rdmashim.verbs.tasks import service_nursery

ENV_ENGINE = "RDMASHIM_ENGINE"
ENGINES = ("native", "python")
DEFAULT = "native"
"""The engine when nothing asks for one (where it is not built: Python, saying why)."""


def chosen() -> tuple[str, str]:
    """The engine a device opened now runs, and why."""
    asked = os.environ.get(ENV_ENGINE, "").strip().lower()
    if asked and asked not in ENGINES:
        raise ValueError(f"{ENV_ENGINE}={asked!r}: say one of {', '.join(ENGINES)}")
    if os.environ.get("RDMASHIM_NO_EXTENSIONS", "") not in ("", "0"):
        if asked == "native":
            raise BackendUnavailable(
                f"{ENV_ENGINE}=native, but RDMASHIM_NO_EXTENSIONS turns compiled code off"
            )
        return "python", "RDMASHIM_NO_EXTENSIONS is set"
    if asked == "native" and not native.AVAILABLE:
        raise BackendUnavailable(f"the native engine is not built here: {native.WHY_NOT}")
    if asked:
        return asked, f"{ENV_ENGINE}={asked}"
    if DEFAULT == "native" and not native.AVAILABLE:
        return "python", f"the native engine is not built here ({native.WHY_NOT})"
    return DEFAULT, "the default"


def describe() -> str:
    """One line for info output and benchmark headers: ``native (why)`` or ``python (why)``."""
    try:
        name, why = chosen()
    except (ValueError, BackendUnavailable) as exc:
        return f"none ({exc})"
    return f"{name} ({why})"


@asynccontextmanager
async def open_device(name: str | None = None) -> AsyncIterator[Context]:
    """Open a device with the engine :func:`chosen` says; its QPs make progress in a
    nursery that lives as long as it."""
    device = find_device(name)
    engine, _ = chosen()
    async with service_nursery() as nursery:
        if engine == "native":
            from rdmashim.providers.softiwarp.native_provider import NativeContext

            ctx: Context = NativeContext(device, nursery)
        else:
            ctx = Context(device, nursery)
        try:
            yield ctx
        finally:
            ctx.close()


__all__ = ["DEFAULT", "ENGINES", "ENV_ENGINE", "chosen", "describe", "open_device"]
