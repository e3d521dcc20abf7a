"""The README's Python examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_TIMEOUT

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[index])
    env = dict(os.environ)
    env.pop("NEBULA_PERSISTENT_STORAGE_PATH", None)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=HANG_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
