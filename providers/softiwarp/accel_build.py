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
_SOURCE_DIR = os.path.relpath(_HERE) if not os.path.relpath(_HERE).startswith("..") else _HERE
"""Relative to the project root when built from there (setuptools wants relative sources)."""


HEADERS = ("_accel.h", "_engine.h")
"""The kernels' and the native engine's headers (their sources: the same names in .c)."""


def declarations() -> str:
    """The cffi declarations: the marked part of each header."""
    parts = []
    for name in HEADERS:
        with open(os.path.join(_HERE, name), encoding="ascii") as header:
            text = header.read()
        found = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.DOTALL)
        if found is None:
            raise RuntimeError(f"{name} has no cdef-begin/cdef-end section")
        parts.append(found.group(1))
    return "\n".join(parts)


ffibuilder = FFI()
ffibuilder.cdef(declarations())
ffibuilder.set_source(
    "rdmashim.providers.softiwarp._accel",
    "".join(f'#include "{name}"\n' for name in HEADERS),
    sources=[os.path.join(_SOURCE_DIR, name.replace(".h", ".c")) for name in HEADERS],
    include_dirs=[_SOURCE_DIR],
    depends=[os.path.join(_SOURCE_DIR, name) for name in HEADERS],
)
