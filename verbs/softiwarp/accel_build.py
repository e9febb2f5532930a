"""cffi builder of the engine's compiled kernels, ``rdmashim.verbs.softiwarp._accel``.

API mode (like aiohttp's, yarl's and msgpack's accelerators, but through
cffi): ``_accel.c`` is compiled into a CPython extension with cffi's glue, and
``_accel.h`` gives both the C prototypes and, between its ``cdef-begin`` /
``cdef-end`` markers, the declarations cffi parses. ``setup.py`` builds it as
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


def declarations() -> str:
    """The cffi declarations: the marked part of ``_accel.h``."""
    with open(os.path.join(_HERE, "_accel.h"), encoding="ascii") as header:
        text = header.read()
    found = re.search(r"/\* cdef-begin \*/(.*)/\* cdef-end \*/", text, re.DOTALL)
    if found is None:
        raise RuntimeError("_accel.h has no cdef-begin/cdef-end section")
    return found.group(1)


ffibuilder = FFI()
ffibuilder.cdef(declarations())
ffibuilder.set_source(
    "rdmashim.verbs.softiwarp._accel",
    '#include "_accel.h"',
    sources=[os.path.join(_SOURCE_DIR, "_accel.c")],
    include_dirs=[_SOURCE_DIR],
    depends=[os.path.join(_SOURCE_DIR, "_accel.h")],
)
