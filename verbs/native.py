"""Where a ULP's C finds the native completion handler ABI (``native_handler.h``, shipped
with the package): the layouts and the table of verbs a handler set with
``cq.set_native_handler`` is given (docs/verbs.md, "Native completion handlers")."""

from __future__ import annotations

from pathlib import Path

INCLUDE_DIR = str(Path(__file__).resolve().parent)
"""The directory holding ``native_handler.h`` (an include directory for the C build)."""
HEADER = "native_handler.h"
