"""One load, in a fresh process (as a restarted trainer would load): ``python -m suite.loader '<json>'``.

Kinds:
- ``torch.load``: ``torch.load(path, map_location="cpu")`` (weights_only, torch's default);
- ``dcp.load``: ``torch.distributed.checkpoint.load`` into a state dict of empty tensors of the
  right shapes, made from the checkpoint's own metadata (DCP loads in place);
- ``nebulite-store``: ``get_latest_checkpoint(persist_path=root)`` (which verifies the CRC of
  the newest checkpoint's files) and ``load()`` of every object, without a memory tier;
- ``nebulite-agent``: ``init()`` attaching to the node agent, ``get_latest_checkpoint()`` and
  ``load()`` of every object from the agent's memory.
Timed from the call to the last byte in this process's tensors; imports are not counted.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from typing import Any

import torch

from . import workloads
from .link import Link


def load_torch(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    obj = torch.load(spec["path"], map_location="cpu")
    return {"seconds": time.perf_counter() - t0, "bytes": workloads.state_bytes(obj)}


def load_dcp(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    warnings.filterwarnings("ignore", module=r"torch\.distributed")
    md = dcp.FileSystemReader(spec["path"]).read_metadata()
    target: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            target[fqn] = torch.empty(m.size, dtype=m.properties.dtype)
        else:
            target[fqn] = None  # a pickled value: DCP puts it in place
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=spec["path"])
    return {"seconds": time.perf_counter() - t0, "bytes": workloads.state_bytes(target)}


def load_nebulite(spec: dict[str, Any], agent: bool) -> dict[str, Any]:
    import nebulite as nm

    nm.get_latest_checkpoint  # noqa: B018 - imports the API now (nebulite imports it lazily), untimed
    if agent:
        nm.init(spec["root"], agent=True, agent_idle_exit=900)
    t0 = time.perf_counter()
    ck = nm.get_latest_checkpoint(persist_path=None if agent else spec["root"])
    t1 = time.perf_counter()
    loaded = {n: ck.load(n) for n in ck.list_names()}
    t2 = time.perf_counter()
    tier = nm.list_checkpoints(persist_path=None if agent else spec["root"])[0]["tier"]
    out = {"seconds": t2 - t0, "find_s": t1 - t0, "load_s": t2 - t1, "tier": tier,
           "bytes": workloads.state_bytes(loaded)}
    if agent:
        nm.shutdown()
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    kind = spec["kind"]
    if kind == "torch.load":
        out = load_torch(spec)
    elif kind == "dcp.load":
        out = load_dcp(spec)
    elif kind in ("nebulite-store", "nebulite-agent"):
        out = load_nebulite(spec, agent=kind == "nebulite-agent")
    else:
        raise SystemExit(f"unknown load kind {kind!r}")
    Link().result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
