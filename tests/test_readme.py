"""The README's Python examples run as written."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_TIMEOUT
from object_stores import start_moto

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
    with contextlib.ExitStack() as stack:
        buckets = set(re.findall(r"s3://([a-z0-9.-]+)/", BLOCKS[index]))
        if buckets:  # an S3 example: a real S3 endpoint (moto) with its buckets
            emu = stack.enter_context(contextlib.closing(_Stopping(start_moto())))
            for bucket in buckets:
                emu.make_bucket(bucket)
            env.update(emu.env)
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=HANG_TIMEOUT,
        )
    assert result.returncode == 0, result.stderr


class _Stopping:
    """An emulator that closing() stops, with a way to make more buckets."""

    def __init__(self, emu) -> None:
        self.emu = emu
        self.env = emu.env

    def make_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.emu.endpoint, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                     region_name="us-east-1").create_bucket(Bucket=name)

    def close(self) -> None:
        self.emu.stop()
