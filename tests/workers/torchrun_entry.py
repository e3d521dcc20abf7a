"""Entry point for ranks launched by torchrun: runs dist_worker.run_dist and writes the
rank's result to a JSON file (torchrun interleaves the ranks' output)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_worker  # noqa: E402

if __name__ == "__main__":
    store, out_dir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # run_dist opens its own tcp:// process group; torchrun's agent does not host that store.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    result = dist_worker.run_dist(store, rank, world, int(os.environ["TEST_PG_PORT"]), 2, 0)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
