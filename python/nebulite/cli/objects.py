"""The objects of a committed version, read from their data files: skeletons (what
``show`` prints) and whole objects with their tensors (what ``export`` writes)."""

from __future__ import annotations

from typing import Any

import torch

from .. import _core
from .._config import read_threads
from . import skeleton
from .store import DataFile


def read_skeleton(root: str, f: DataFile) -> Any:
    """The object with each tensor as a skeleton.TensorInfo; no payload is read."""
    return skeleton.load(_core.StoredArchive.open(root, f.path).read("data.pkl"))


def read_object(root: str, f: DataFile) -> Any:
    """The object with its tensors (on the CPU); each record's CRC-32 is checked."""
    archive = _core.StoredArchive.open(root, f.path)
    sizes = {name: size for name, _, size, _ in archive.records()}

    def read_storage(key: str, dtype: torch.dtype) -> Any:
        record = f"data/{key}"
        buf = torch.empty(sizes[record], dtype=torch.uint8)
        archive.read_into(record, buf.data_ptr(), read_threads(root))
        return buf.untyped_storage()

    return skeleton.load(archive.read("data.pkl"), read_storage)
