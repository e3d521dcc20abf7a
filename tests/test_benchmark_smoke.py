"""The benchmark runs end to end in its tiny configuration, so that it cannot rot.
(It asserts that the program works and reports its figures, never a timing.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_save_tiny(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_save.py"), "--tiny", "--reps", "1",
         "--dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "torch.save+fsync" in result.stdout and "goals:" in result.stdout
    data = json.loads(out.read_text())
    assert data["state_bytes"] > 0
    assert data["nebulite"]["blocking_s"] and data["torch_save_fsync_s"]
    # the bench cleans up after itself
    assert not any(p.name.startswith("nebulite-bench-") for p in tmp_path.iterdir())


def test_bench_agent_tiny(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_agent.py"), "--tiny", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "blocking per save, agent" in result.stdout and "load, memory tier (memory)" in result.stdout
