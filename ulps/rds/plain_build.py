"""cffi builder of RDS's plain-message receive path, ``rdmashim.ulps.rds._plain``.

API mode, built as the engine's extension is (``providers/softiwarp/accel_build.py``,
whose :func:`builder` this uses): ``_plain.c`` with its header's marked declarations.
``setup.py`` builds it as an optional extension; :mod:`.plain` loads it or leaves RDS on
its Python path.
"""

from __future__ import annotations

import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_ACCEL_BUILD = os.path.join(_HERE, "..", "..", "providers", "softiwarp", "accel_build.py")


def _engine_build() -> object:
    """The engine's build script, loaded from its file (at build time the package is not
    installed, so it cannot be imported by name)."""
    spec = importlib.util.spec_from_file_location("_rdmashim_accel_build", _ACCEL_BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ffibuilder = _engine_build().builder(  # type: ignore[attr-defined]
    "rdmashim.ulps.rds._plain", _HERE, ("_plain.h",)
)
