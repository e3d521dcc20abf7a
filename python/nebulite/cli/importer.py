"""``nebulite import PATH TAG --from DIR``: makes a directory of ``torch.save`` files
(``*.pt``, ``*.pth``, ``*.bin``, ``*.ckpt``) and ``*.safetensors`` files a committed
checkpoint TAG of the store PATH, one object per file, named by the file's name without
its extension (a safetensors file's ``<name>.json`` beside it, as ``nebulite export``
writes, adds its values to the object). torch files are read with ``weights_only=True`` unless
``--unsafe-unpickle`` is given (only for files you trust: unpickling runs code)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ..errors import InvalidArgumentError, NotFoundError
from . import store
from .command import subcommand
from .progress import Progress

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "import", help="make torch.save / safetensors files a committed checkpoint",
                   doc=__doc__, run=run,
                   examples=["nebulite import /mnt/ckpt/run1 pretrained --from ./hf-model"])
    p.add_argument("tag", metavar="TAG")
    p.add_argument("--from", dest="source", required=True, metavar="DIR")
    p.add_argument("--unsafe-unpickle", action="store_true",
                   help="read torch files with full unpickling (weights_only=False)")


def _sources(directory: str) -> list[tuple[str, str]]:
    """(object name, file) of each file to import, by name."""
    if not os.path.isdir(directory):
        raise NotFoundError(f"{directory} is not a directory")
    out = []
    for entry in sorted(os.listdir(directory)):
        name, ext = os.path.splitext(entry)
        if ext in TORCH_SUFFIXES or ext == ".safetensors":
            out.append((name, os.path.join(directory, entry)))
    names = [n for n, _ in out]
    if not out:
        raise NotFoundError(f"no torch.save or safetensors files in {directory}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"two files in {directory} make the same object name")
    return out


def _read(path: str, unsafe: bool) -> Any:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        obj: dict[str, Any] = dict(load_file(path))
        values = path[: -len(".safetensors")] + ".json"  # what `nebulite export` put beside
        if os.path.isfile(values):
            with open(values) as f:
                obj.update(json.load(f))
        return obj
    import torch

    return torch.load(path, map_location="cpu", weights_only=not unsafe, mmap=True)


def run(args: argparse.Namespace) -> int:
    import nebulite

    root = store.root_of(args.path)
    sources = _sources(args.source)
    # No retention: importing never deletes the store's other checkpoints.
    nebulite.init(persistent_storage_path=root, persistent_time_interval=0,
                  num_of_version_in_retention=0, agent=False)
    try:
        ckpt = nebulite.Checkpoint(args.tag, num_files=nebulite.COMMIT_EXPLICITLY)
        with Progress("import", sum(os.path.getsize(p) for _, p in sources)) as progress:
            for name, path in sources:
                ckpt.save(name, _read(path, args.unsafe_unpickle))
                progress.advance(os.path.getsize(path))
        if not ckpt.commit():
            raise NotFoundError(f"checkpoint {args.tag!r} could not be committed")
        nebulite.flush_persistence()
    finally:
        nebulite.shutdown()
    version = store.find(root, args.tag).version
    for name, path in sources:
        print(f"imported {path} as object {name!r}")
    print(f"committed {args.tag} ({version}) in {root}")
    return 0
