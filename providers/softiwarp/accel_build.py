"""cffi builder of the engine's compiled kernels, ``rdmashim.providers.softiwarp._accel``.

API mode (like aiohttp's, yarl's and msgpack's accelerators, but through
cffi): ``_accel.c`` (the kernels) and ``_engine.c`` (the native engine's core,
``docs/native-engine.md``) are compiled into one CPython extension with cffi's
glue, and their headers give both the C prototypes and, between their
``cdef-begin`` / ``cdef-end`` markers, the declarations cffi parses. ``setup.py`` builds it as
an optional extension (see there); ``fastpath.py`` loads it or falls back to
the pure-Python kernels.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))


HEADERS = ("_accel.h", "_engine.h")
"""The kernels' and the native engine's headers (their sources: the same names in .c)."""


def declarations(directory: str, headers: tuple[str, ...]) -> str:
    """The cffi declarations: the marked part of each header in ``directory``."""
    parts = []
    for name in headers:
        with open(os.path.join(directory, name), encoding="ascii") as header:
            text = header.read()
        found = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.DOTALL)
        if found is None:
            raise RuntimeError(f"{name} has no cdef-begin/cdef-end section")
        parts.append(found.group(1))
    return "\n".join(parts)


def builder(module: str, directory: str, headers: tuple[str, ...]) -> FFI:
    """The cffi builder of extension ``module`` from ``headers`` in ``directory`` and
    their sources (the same names in .c): the engine's here, RDS's plain-message path's
    in ``ulps/rds/plain_build.py``."""
    # Relative to the project root when built from there (setuptools wants relative sources).
    relative = os.path.relpath(directory)
    source_dir = relative if not relative.startswith("..") else directory
    ffi = FFI()
    ffi.cdef(declarations(directory, headers))
    ffi.set_source(
        module,
        "".join(f'#include "{name}"\n' for name in headers),
        sources=[os.path.join(source_dir, name.replace(".h", ".c")) for name in headers],
        include_dirs=[source_dir],
        depends=[os.path.join(source_dir, name) for name in headers],
    )
    return ffi


ffibuilder = builder("rdmashim.providers.softiwarp._accel", _HERE, HEADERS)
