"""Loading libibverbs and librdmacm on first use, and turning C failures into errors.

Nothing is loaded at import: :func:`verbs` opens ``libibverbs.so.1`` the first
time a device is listed or opened, :func:`rdmacm` opens ``librdmacm.so.1`` only
when connection management (or an open device) needs it. A library that cannot
be loaded raises :class:`~rdmashim.verbs.errors.BackendUnavailable` naming the
packages to install. ``RDMASHIM_LIBIBVERBS`` and ``RDMASHIM_LIBRDMACM`` name
other files to load (a path or soname), e.g. a private rdma-core build.

Functions are looked up when first called, so one missing from an older
rdma-core fails only then, with :class:`~rdmashim.verbs.errors.NotSupported`.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.verbs.errors import BackendUnavailable, NotSupported, VerbsError

log = logging.getLogger(__name__)

VERBS_ENV = "RDMASHIM_LIBIBVERBS"
RDMACM_ENV = "RDMASHIM_LIBRDMACM"
VERBS_SONAME = "libibverbs.so.1"
RDMACM_SONAME = "librdmacm.so.1"
INSTALL_HINT = "install rdma-core: apt-get install libibverbs1 ibverbs-providers librdmacm1"

_loaded: dict[str, Any] = {}


def _load(name: str) -> Any:
    lib = _loaded.get(name)
    if lib is None:
        try:
            lib = ffi.dlopen(name)
        except OSError as exc:
            raise BackendUnavailable(f"could not load {name} ({INSTALL_HINT}): {exc}") from exc
        log.debug("loaded %s", name)
        _loaded[name] = lib
    return lib


def verbs() -> Any:
    """libibverbs (``RDMASHIM_LIBIBVERBS`` or ``libibverbs.so.1``), loaded once."""
    return _load(os.environ.get(VERBS_ENV) or VERBS_SONAME)


def rdmacm() -> Any:
    """librdmacm (``RDMASHIM_LIBRDMACM`` or ``librdmacm.so.1``), loaded once."""
    return _load(os.environ.get(RDMACM_ENV) or RDMACM_SONAME)


def function(lib: Any, name: str) -> Any:
    """``lib.name``, or :class:`NotSupported` if this rdma-core does not export it."""
    try:
        return getattr(lib, name)
    except AttributeError as exc:
        raise NotSupported(name, f"not exported by this rdma-core ({exc})") from exc


def last_errno(default: int = errno.EIO) -> int:
    """The errno the last C call left (``default`` if it left none)."""
    return ffi.errno or default


def check(rc: int, operation: str) -> None:
    """Raise VerbsError for a failed call: ``rc`` is an errno (or its negative), or -1 and errno."""
    if rc != 0:
        raise VerbsError(abs(rc) if rc != -1 else last_errno(), operation)


def check_ptr(ptr: Any, operation: str) -> Any:
    """Return ``ptr``, or raise VerbsError with errno if it is NULL."""
    if ptr == ffi.NULL:
        raise VerbsError(last_errno(), operation)
    return ptr


def address(ptr: Any) -> int:
    """A C pointer as an int (a key for finding the Python object that wraps it)."""
    return int(ffi.cast("uintptr_t", ptr))
