"""Run ``mypy --strict`` on the installed package layout, naming the repository's files.

setuptools' ``package-dir`` installs the folders ``verbs/``, ``providers/``, ``cm/`` and
``ulps/`` as ``rdmashim.verbs``, ``rdmashim.cm`` and ``rdmashim.ulps``, which
mypy cannot follow in an editable install. This tool builds that layout from
symbolic links in a temporary directory (``rdmashim/*`` linked file by file,
``rdmashim/verbs`` -> ``verbs/`` and so on), runs ``mypy -p rdmashim`` there
with the settings of ``[tool.mypy]`` in pyproject.toml, and rewrites the paths
in its report to the repository's own, so an editor can jump to them.

Usage::

    python tools/typecheck.py [extra mypy arguments]

The exit status is mypy's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("verbs", "providers", "cm", "ulps")
"""Folders installed under the ``rdmashim`` namespace (pyproject's package-dir)."""


def build_tree(root: Path) -> Path:
    """Link the installed layout of ``rdmashim`` under ``root``; returns the package dir."""
    package = root / "rdmashim"
    package.mkdir()
    for entry in (REPO / "rdmashim").iterdir():
        if entry.suffix in (".py", ".typed") or (entry / "__init__.py").is_file():
            (package / entry.name).symlink_to(entry)  # modules, py.typed, subpackages
    for name in SUBPACKAGES:
        (package / name).symlink_to(REPO / name, target_is_directory=True)
    return package


def real_path(line: str) -> str:
    """A mypy report line with the linked path replaced by the repository's path."""
    for name in SUBPACKAGES:
        prefix = f"rdmashim/{name}/"
        if line.startswith(prefix):
            return name + "/" + line[len(prefix) :]
    return line


def main(argv: list[str]) -> int:
    """Type-check the package; print mypy's report with repository paths."""
    with tempfile.TemporaryDirectory(prefix="rdmashim-typecheck-") as tmp:
        build_tree(Path(tmp))
        command = [
            sys.executable, "-m", "mypy",
            "--config-file", str(REPO / "pyproject.toml"),
            "--cache-dir", str(REPO / ".mypy_cache"),
            "-p", "rdmashim", *argv,
        ]  # fmt: skip
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        print(real_path(line))
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
