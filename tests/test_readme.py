"""The README's example is examples/echo.py, and it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_is_examples_echo() -> None:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\nimport trio") + len("```python\n")
    block = readme[start : readme.index("```", start)]
    assert block in (ROOT / "examples" / "echo.py").read_text()


def test_examples_echo_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "echo.py")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["server said b'welcome'", "echoed b'hello, iWARP'"]
