"""Worker for tests/test_crash.py: a "training loop" saving checkpoints until killed.

Usage: crash_worker.py STORE FIRST_STEP LAST_STEP FLUSH_EVERY

Saves tags step<FIRST>..step<LAST> (interval 0, retention 3), each with two objects
("model", "optim") whose tensors are derived from the step (see expected()), commits
each and flushes every FLUSH_EVERY steps (0: never, except once at the end). Prints
progress lines "ready", "saved N", "committed N", "flushed N", "done".

NEBULITE_TEST_KILL="<point>:<step>" makes the process SIGKILL itself at step <step>:
point is one of after_save (both objects saved, before commit), after_commit
(commit() returned, persistence in progress) or after_flush (flush_persistence() returned).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import nebulite as nm

RETENTION = 3


def expected(step: int) -> dict[str, dict]:
    """The objects saved at `step` (about 1 MiB and 2 MiB of tensors)."""
    return {
        "model": {
            "w": torch.full((256, 1024), float(step), dtype=torch.float32),
            "b": torch.arange(1024, dtype=torch.float32) + step,
            "step": step,
        },
        "optim": {
            "m": torch.full((512, 1024), -float(step), dtype=torch.float32),
            "count": torch.arange(4096, dtype=torch.int64) * (step + 1),
            "lr": 0.1 / (step + 1),
        },
    }


def main() -> None:
    store, first, last, flush_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    kill = os.environ.get("NEBULITE_TEST_KILL", "")
    kill_point, kill_step = (kill.split(":")[0], int(kill.split(":")[1])) if kill else ("", -1)

    def maybe_die(point: str, step: int) -> None:
        if point == kill_point and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)

    nm.init(persistent_storage_path=store, persistent_time_interval=0,
            num_of_version_in_retention=RETENTION, commit_timeout=30)
    print("ready", flush=True)
    for step in range(first, last + 1):
        ck = nm.Checkpoint(f"step{step}", -2)
        for name, obj in expected(step).items():
            ck.save(name, obj)
        print(f"saved {step}", flush=True)
        maybe_die("after_save", step)
        assert ck.commit() is True
        print(f"committed {step}", flush=True)
        maybe_die("after_commit", step)
        if flush_every and (step - first + 1) % flush_every == 0:
            nm.flush_persistence(timeout=60)
            print(f"flushed {step}", flush=True)
            maybe_die("after_flush", step)
    nm.flush_persistence(timeout=60)
    print(f"flushed {last}", flush=True)
    nm.shutdown()
    print("done", flush=True)


if __name__ == "__main__":
    main()
