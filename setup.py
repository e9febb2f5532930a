"""Build script for the optional compiled accelerator; the metadata is in pyproject.toml.

The soft-iWARP engine and RDS run in pure Python. When a C compiler and the
Python headers are there, this also builds ``rdmashim.providers.softiwarp._accel``
(cffi API mode, ``providers/softiwarp/accel_build.py``: the native engine and the
Python engine's kernels) and ``rdmashim.ulps.rds._plain`` (``ulps/rds/plain_build.py``:
RDS's plain-message receive path). The extensions are optional: when one cannot be
built (no compiler, no headers, any error) the build warns and the pure-Python install
goes on. ``RDMASHIM_NO_EXTENSIONS=1`` skips them.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


def _no_extensions() -> bool:
    return os.environ.get("RDMASHIM_NO_EXTENSIONS", "") not in ("", "0")


def _warn(what: str, exc: BaseException) -> None:
    print(
        f"WARNING: {what} failed ({type(exc).__name__}: {exc}); rdmashim installs without "
        "it and runs its pure-Python code instead",
        file=sys.stderr,
    )


class OptionalBuildExt(build_ext):
    """``build_ext`` whose failures are warnings: the extensions are optional."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            _warn("building the C extensions", exc)
            self.extensions = []

    def build_extension(self, ext: object) -> None:
        try:
            super().build_extension(ext)  # type: ignore[arg-type]
        except Exception as exc:
            _warn(f"building {getattr(ext, 'name', ext)}", exc)
            self.extensions = [e for e in self.extensions if e is not ext]


setup(
    cmdclass={"build_ext": OptionalBuildExt},
    cffi_modules=[]
    if _no_extensions()
    else ["providers/softiwarp/accel_build.py:ffibuilder", "ulps/rds/plain_build.py:ffibuilder"],
)
