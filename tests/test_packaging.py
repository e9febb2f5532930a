"""What a user installs: the sdist and the wheel built from this tree.

Both carry the LICENSE the metadata names, the wheel carries every package and
the type marker and nothing of the tests or tools, and the metadata says what
the base install needs (cffi included: the compiled accelerator imports its
backend; it ships wheels, so no compiler is needed).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_sdist_and_wheel(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (sdist,) = tmp_path.glob("rdmashim-*.tar.gz")
    (wheel,) = tmp_path.glob("rdmashim-*.whl")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "providers/softiwarp/engine.py"} <= names
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (dist_info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
        metadata = archive.read(f"{dist_info}/METADATA").decode()
    assert f"{dist_info}/licenses/LICENSE" in names
    assert {
        "rdmashim/py.typed",
        "rdmashim/cli.py",
        "rdmashim/providers/softiwarp/engine.py",
        "rdmashim/providers/rdmacore/cdefs.py",
        "rdmashim/providers/softiwarp/cm_id.py",
        "rdmashim/verbs/abc.py",
        "rdmashim/cm/abc.py",
        "rdmashim/ulps/rds/node.py",
        "rdmashim/rdstools/cli.py",
    } <= names
    assert not any(name.startswith(("tests/", "tools/", "benchmarks/")) for name in names)
    assert "License-Expression: MIT" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [line for line in requires if "extra ==" not in line]
    assert any(line.startswith("Requires-Dist: cffi") for line in base), base
    assert any("cffi" in line and 'extra == "rdmacore"' in line for line in requires), requires
