"""``nebulite export PATH TAG --to DIR --format torch|safetensors``: writes a committed
checkpoint's objects as files that tools without nebulite read.

- ``torch``: each object's data file as it is (it is a ``torch.save`` archive), checked
  against its manifest's CRC-32 while copied: ``DIR/<object>.pt``.
- ``safetensors``: each object's tensors in ``DIR/<object>.safetensors`` under their key
  paths (``layer.weight``), and its other values in ``DIR/<object>.json``. Nothing the
  checkpoint names is imported or run (see skeleton.py).

Objects of rank R > 0 of a multi-rank checkpoint are named ``<object>.rank<R>``."""

from __future__ import annotations

import argparse
import json
import os
import zlib
from typing import Any

import torch

from .. import _core
from ..errors import CorruptCheckpointError, NotFoundError
from . import objects, skeleton, store
from .command import subcommand
from .progress import Progress

CHUNK = 16 << 20


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "export", help="write a checkpoint as plain torch.save or safetensors files",
                   doc=__doc__, run=run,
                   examples=["nebulite export /mnt/ckpt/run1 global_step500 --to ./step500 "
                             "--format safetensors"])
    p.add_argument("tag", metavar="TAG")
    p.add_argument("--to", required=True, metavar="DIR", help="directory to write (created)")
    p.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    p.add_argument("--version", help="a version of the tag other than its newest")
    p.add_argument("--object", help="only this object")


def _stem(v: store.Version, f: store.DataFile) -> str:
    return f.name if v.world_size == 1 or f.rank == 0 else f"{f.name}.rank{f.rank}"


def _write_atomic(path: str, write: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def copy_torch(root: str, f: store.DataFile, dest: str, progress: Progress) -> None:
    src = _core.open_store_file(root, f.path)

    def write(tmp: str) -> None:
        crc, offset = 0, 0
        with open(tmp, "wb") as out:
            while offset < f.size:
                chunk = src.read(offset, min(CHUNK, f.size - offset))
                if not chunk:
                    break
                out.write(chunk)
                crc = zlib.crc32(chunk, crc)
                offset += len(chunk)
                progress.advance(len(chunk))
        if offset != f.size or crc != f.crc32:
            raise CorruptCheckpointError(
                f"{os.path.join(root, f.path)} does not match its manifest (size or CRC-32); "
                "nothing exported for it")

    _write_atomic(dest, write)


def write_safetensors(root: str, f: store.DataFile, stem: str, progress: Progress) -> list[str]:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for key, leaf in skeleton.walk(objects.read_object(root, f)):
        if isinstance(leaf, torch.Tensor):
            # one buffer per tensor: safetensors refuses views sharing a storage
            tensors[key or "tensor"] = leaf.detach().to("cpu").contiguous().clone()
        else:
            values[key] = skeleton.plain(leaf)
    written = [f"{stem}.safetensors"]
    _write_atomic(f"{stem}.safetensors",
                  lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    if values:
        def write(tmp: str) -> None:
            with open(tmp, "w") as out:
                json.dump(values, out, indent=2)
        _write_atomic(f"{stem}.json", write)
        written.append(f"{stem}.json")
    progress.advance(f.size)
    return written


def run(args: argparse.Namespace) -> int:
    root = store.root_of(args.path)
    v = store.find(root, args.tag, args.version)
    files = [f for f in v.files if args.object in (None, f.name)]
    if not files:
        raise NotFoundError(f"checkpoint {v.tag!r} has no object {args.object!r}")
    os.makedirs(args.to, exist_ok=True)
    written = []
    with Progress("export", sum(f.size for f in files)) as progress:
        for f in files:
            stem = os.path.join(args.to, _stem(v, f))
            if args.format == "torch":
                copy_torch(root, f, f"{stem}.pt", progress)
                written.append(f"{stem}.pt")
            else:
                written += write_safetensors(root, f, stem, progress)
    for w in written:
        print(f"wrote {w}")
    return 0
