"""The rdma-core backend's cdefs agree with the installed C headers.

cffi in ABI mode trusts the declarations: a wrong size or offset would read
the wrong bytes. For every struct and union the backend declares, a small C
program compiled against ``<infiniband/verbs.h>`` and ``<rdma/rdma_cma.h>``
prints ``sizeof`` and, per field, ``offsetof`` and the field's size; they must
equal cffi's. Needs gcc and the headers (Debian: ``libibverbs-dev
librdmacm-dev``); skipped with the reason otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from rdmashim.providers.rdmacore.cdefs import ffi

HEADERS = ("infiniband/verbs.h", "rdma/rdma_cma.h")


def _declared() -> list[tuple[str, str, int, int]]:
    """(C type, field, offset, size) for every field, ("struct x", "", 0, sizeof) per type."""
    _, structs, unions = ffi.list_types()
    rows: list[tuple[str, str, int, int]] = []
    for kind, names in (("struct", structs), ("union", unions)):
        for name in names:
            ctype = ffi.typeof(f"{kind} {name}")
            if ctype.fields is None:
                continue  # declared opaque (only used through pointers)
            c_name = f"{kind} {name}"
            rows.append((c_name, "", 0, ffi.sizeof(ctype)))
            for field, info in ctype.fields:
                rows.append((c_name, field, info.offset, ffi.sizeof(info.type)))
    for typedef in ("pthread_mutex_t", "pthread_cond_t"):
        rows.append((typedef, "", 0, ffi.sizeof(typedef)))
    return rows


def _c_program(rows: list[tuple[str, str, int, int]]) -> str:
    lines = [f"#include <{h}>" for h in HEADERS]
    lines += ["#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for c_name, field, _, _ in rows:
        if field:
            lines.append(
                f'    printf("%zu %zu\\n", offsetof({c_name}, {field}), '
                f"sizeof((({c_name} *)0)->{field}));"
            )
        else:
            lines.append(f'    printf("0 %zu\\n", sizeof({c_name}));')
    lines += ["    return 0;", "}"]
    return "\n".join(lines) + "\n"


def test_cdefs_match_installed_headers(tmp_path: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc not installed (apt-get install gcc)")
    missing = [h for h in HEADERS if not Path("/usr/include", h).exists()]
    if missing:
        pytest.skip(f"{', '.join(missing)} missing (apt-get install libibverbs-dev librdmacm-dev)")
    rows = _declared()
    source = tmp_path / "layout.c"
    source.write_text(_c_program(rows))
    binary = tmp_path / "layout"
    subprocess.run([gcc, "-o", str(binary), str(source)], check=True, capture_output=True)
    out = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout
    measured = [tuple(int(v) for v in line.split()) for line in out.splitlines()]
    assert len(measured) == len(rows)
    wrong = [
        f"{c_name}.{field or 'sizeof'}: cffi {off}+{size}, C {c_off}+{c_size}"
        for (c_name, field, off, size), (c_off, c_size) in zip(rows, measured, strict=True)
        if (off, size) != (c_off, c_size)
    ]
    assert not wrong, "\n".join(wrong)
    assert len(rows) > 200  # every struct of the backend is covered, not a handful
