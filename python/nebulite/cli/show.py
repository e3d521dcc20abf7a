"""``nebulite show PATH TAG [OBJECT]``: what a committed checkpoint holds: its objects
and, for each, its tensors (key path, dtype, shape, bytes) and plain values, read from
the skeleton and the index of its data files, without reading the tensors."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import NotFoundError
from . import objects, output, skeleton, store
from .command import subcommand


def add_parser(sub: Any) -> None:
    p = subcommand(sub, "show", help="show the objects, tensors and values of a checkpoint",
                   doc=__doc__, run=run, examples=["nebulite show /mnt/ckpt/run1 global_step500 model"])
    p.add_argument("tag", metavar="TAG")
    p.add_argument("object", metavar="OBJECT", nargs="?", help="only this object")
    p.add_argument("--version", help="a version of the tag other than its newest")
    p.add_argument("--json", action="store_true", help="print JSON, for scripts")


def describe(root: str, v: store.Version, only: str | None) -> dict[str, Any]:
    objs = []
    for f in v.files:
        if only is not None and f.name != only:
            continue
        tensors, values = [], []
        for key, leaf in skeleton.walk(objects.read_skeleton(root, f)):
            if isinstance(leaf, skeleton.TensorInfo):
                tensors.append({"key": key, "dtype": str(leaf.dtype).removeprefix("torch."),
                                "shape": list(leaf.shape), "bytes": leaf.nbytes})
            else:
                values.append({"key": key, "value": skeleton.plain(leaf)})
        objs.append({"name": f.name, "rank": f.rank, "file_bytes": f.size,
                     "tensors": tensors, "values": values})
    if only is not None and not objs:
        raise NotFoundError(f"checkpoint {v.tag!r} has no object {only!r} "
                            f"(it has {', '.join(v.names) or 'none'})")
    return {"tag": v.tag, "version": v.version, "seq": v.seq,
            "committed_unix_ns": v.time_unix_ns, "world_size": v.world_size, "objects": objs}


def run(args: argparse.Namespace) -> int:
    root = store.root_of(args.path)
    d = describe(root, store.find(root, args.tag, args.version), args.object)
    if args.json:
        output.print_json(d)
        return 0
    print(f"{d['tag']}  version {d['version']}  committed {output.utc(d['committed_unix_ns'])} "
          f"UTC  world size {d['world_size']}")
    for o in d["objects"]:
        rank = f" rank {o['rank']}" if d["world_size"] > 1 else ""
        total = sum(t["bytes"] for t in o["tensors"])
        print(f"\nobject {o['name']}{rank}: {len(o['tensors'])} tensors ({output.size(total)}), "
              f"{len(o['values'])} values, file {output.size(o['file_bytes'])}")
        if o["tensors"]:
            output.table(["  KEY", "DTYPE", "SHAPE", "BYTES"],
                         [["  " + (t["key"] or "(the object)"), t["dtype"],
                           "[" + ", ".join(map(str, t["shape"])) + "]", t["bytes"]]
                          for t in o["tensors"]])
        for val in o["values"]:
            text = val["value"] if isinstance(val["value"], str) and val["value"].startswith("<") \
                else repr(val["value"])
            print(f"  {val['key'] or '(the object)'} = {text[:100]}")
    return 0
