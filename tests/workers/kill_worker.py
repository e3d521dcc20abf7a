"""Worker of the kill campaign (tests/kill_campaign.py): one rank of a "training" run that
trains nothing and saves checkpoints in a loop until it is killed or has saved its steps.

Usage: kill_worker.py --store S --journal-dir J [--rank R --world W --port P] [--agent]
                      [--steps K] [--flush-every F] [--tag step|last] [--async-staging]

When it starts, the run resumes from get_latest_checkpoint() and checks bit for bit that
every object of it holds the content saved at its step (see expected()). It then saves a
checkpoint for each of the K steps after the resumed one, tagged step<N> (or, with
--tag last, always "last": every save is a new version of that one tag, as Lightning's
last.ckpt): "model" (rank 0; its "step" entry is N) and "optim_rank<R>" (every rank),
with persistent_time_interval=0 and a retention of RETENTION versions,
commits each, and after every F-th step of the run calls flush_persistence() and appends N to its
journal (J/rank<R>.journal, fsync'd): a journal line is a promise that step N (or a newer
step) is committed in the store for good.

Progress lines on stdout, each flushed: "start", "ready run=<id> agent=<pid or 0>",
"resumed <N> <tier>" or "resumed none", then per step "saving N", "saved N",
"committed N", and for flushed steps "flushing N", "flushed N" (after the journal line),
finally "done". A resumed checkpoint whose content is wrong prints "CORRUPT ..." and
exits 3; one that cannot be loaded prints "LOADERR ..." and exits 3 (unless the node agent
holding it is gone: AgentLostError ends the run like any other error).

With --async-staging the objects' tensors are an optimizer's parameters and state, written
in place before each save, and saved with async_staging=True: their bytes are copied after
save() returns, and the optimizer step after commit() (a step without gradients: it changes
nothing) is the barrier that commits; "committed N" follows it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import zlib
from typing import Any

import torch

import nebulite as nm

RETENTION = 2
#: Exit status of a run that found a committed checkpoint it could not trust.
EXIT_CORRUPT = 3


def _generator(step: int, rank: int, name: str, key: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(f"{step}/{rank}/{name}/{key}".encode()) + (step << 32))
    return g


def _randn(shape: tuple[int, ...], step: int, rank: int, name: str, key: str,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=_generator(step, rank, name, key)).to(dtype)


def expected(step: int, rank: int, name: str) -> Any:
    """The object `name` of rank `rank` saved at `step`: every element depends on all three,
    so a file of another step, rank or object, or a piece of one, never passes for it."""
    if name == "model":  # about 2.4 MiB
        return {
            "embed.weight": _randn((512, 1024), step, rank, name, "embed"),            # 2 MiB
            "proj.weight": _randn((256, 512), step, rank, name, "proj", torch.bfloat16),  # 256 KiB
            "proj.bias": _randn((512,), step, rank, name, "bias"),
            "positions": torch.arange(16384, dtype=torch.int64) * (step + 1) + rank,  # 128 KiB
            "step": step,
        }
    if name == f"optim_rank{rank}":  # about 4 MiB
        return {
            "state": {0: {"exp_avg": _randn((768, 1024), step, rank, name, "m"),       # 3 MiB
                          "exp_avg_sq": _randn((256, 1024), step, rank, name, "v"),    # 1 MiB
                          "step": torch.tensor(float(step))}},
            "param_groups": [{"lr": 1e-3 / (step + 1), "betas": (0.9, 0.999), "params": [0]}],
        }
    raise KeyError(name)


def names(world: int) -> list[tuple[int, str]]:
    """(rank, name) of every object of a checkpoint of a run of `world` ranks."""
    return [(0, "model")] + [(r, f"optim_rank{r}") for r in range(world)]


def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of two saved objects (tensors: dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def step_of(tag: str) -> int:
    m = re.fullmatch(r"step(\d+)", tag)
    if not m:
        raise ValueError(f"not a tag of the kill campaign: {tag!r}")
    return int(m.group(1))


def step_of_checkpoint(ck: Any) -> int:
    """The step a committed checkpoint holds: its tag's, or for the tag "last" the one its
    model says (the whole content is then checked against that step)."""
    if ck.tag == "last":
        step = ck.load("model", map_location="cpu")["step"]
        if not isinstance(step, int):
            raise ValueError(f"the model of {ck.tag}/{ck.version} holds step {step!r}")
        return step
    return step_of(ck.tag)


def read_journal(path: str) -> list[int]:
    """Steps in a journal; a last line without its newline (a write cut short) is ignored."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")[:-1]
    return [int(x) for x in lines]


def _append_journal(path: str, step: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{step}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _say(line: str) -> None:
    print(line, flush=True)


class Trained:
    """The objects of one rank as a training job holds them (--async-staging): their tensors
    are an optimizer's parameters ("model") and state (the optimizer objects), so that
    asynchronous staging copies them after save() returns; "positions" (int64) is a
    buffer, which save() copies itself. Each step writes its values into them in place."""

    def __init__(self, step: int, rank: int, world: int) -> None:
        self.objects = {n: expected(step, rank, n) for r, n in names(world) if r == rank}
        params = [t for t in self.objects.get("model", {}).values()
                  if isinstance(t, torch.Tensor) and t.is_floating_point()]
        params = params or [torch.zeros(1)]  # a rank without the model: state needs a param
        self.optimizer = torch.optim.SGD(params, lr=0.1)
        name = f"optim_rank{rank}"
        if name in self.objects:
            self.optimizer.state[params[0]] = self.objects[name]["state"][0]
        self.optimizer.step()  # the first step: asynchronous staging learns the storages

    def at(self, step: int, rank: int) -> list[tuple[str, Any]]:
        """Its objects, holding `step`'s values."""
        with torch.no_grad():
            for name, obj in self.objects.items():
                _write(obj, expected(step, rank, name))
        return list(self.objects.items())


def _write(obj: dict, new: dict) -> None:
    """`new`'s values in `obj`: tensors copied in place, the rest replaced."""
    for k, v in new.items():
        if isinstance(v, torch.Tensor):
            obj[k].copy_(v)
        elif isinstance(v, dict):
            _write(obj[k], v)
        else:
            obj[k] = v


def _resume(world: int) -> int:
    """Step after the latest checkpoint, once its content checked out."""
    latest = nm.get_latest_checkpoint()
    if latest.tag == "":
        _say("resumed none")
        return 0
    tier = latest._committed["tier"] if latest._committed else "?"
    try:
        step = step_of_checkpoint(latest)
    except nm.errors.AgentLostError:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the controller
        _say(f"LOADERR {latest.tag} {latest.version} {tier} model: {type(e).__name__}: {e}")
        sys.exit(EXIT_CORRUPT)
    for rank, name in names(world):
        try:
            got = latest.load(name, map_location="cpu")
        except nm.errors.AgentLostError:
            raise  # the agent was killed: nothing to hold against the checkpoint
        except Exception as e:  # noqa: BLE001 - reported to the controller
            _say(f"LOADERR {latest.tag} {latest.version} {tier} {name}: {type(e).__name__}: {e}")
            sys.exit(EXIT_CORRUPT)
        if not same(got, expected(step, rank, name)):
            _say(f"CORRUPT {latest.tag} {latest.version} {tier} {name}: content differs from step {step}")
            sys.exit(EXIT_CORRUPT)
    _say(f"resumed {step} {tier}")
    return step + 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", required=True)
    p.add_argument("--journal-dir", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--agent", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--flush-every", type=int, default=2, help="0: never flush")
    p.add_argument("--commit-timeout", type=float, default=10.0)
    p.add_argument("--tag", choices=("step", "last"), default="step")
    p.add_argument("--async-staging", action="store_true")
    a = p.parse_args(argv)
    _say("start")
    dist = None
    if a.world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                                world_size=a.world, timeout=datetime.timedelta(seconds=30))
    nm.init(persistent_storage_path=a.store, persistent_time_interval=0,
            num_of_version_in_retention=RETENTION, commit_timeout=a.commit_timeout,
            agent=a.agent, async_staging=a.async_staging)
    info = nm.session_info()
    _say(f"ready run={info['run_id']} agent={info['agent_pid'] or 0}")
    first = _resume(a.world)
    journal = os.path.join(a.journal_dir, f"rank{a.rank}.journal")
    trained = Trained(first, a.rank, a.world) if a.async_staging else None
    for step in range(first, first + a.steps):
        objects = trained.at(step, a.rank) if trained is not None else \
            [(n, expected(step, r, n)) for r, n in names(a.world) if r == a.rank]
        _say(f"saving {step}")
        ck = nm.Checkpoint(f"step{step}" if a.tag == "step" else "last", -2)
        for name, obj in objects:
            ck.save(name, obj)
        _say(f"saved {step}")
        if not ck.commit():
            raise RuntimeError(f"commit() of step{step} returned False")
        if trained is not None:
            trained.optimizer.step()  # the barrier: the copies land, the commit is made
        _say(f"committed {step}")
        if a.flush_every and (step - first + 1) % a.flush_every == 0:
            _say(f"flushing {step}")
            nm.flush_persistence(timeout=120)
            _append_journal(journal, step)
            _say(f"flushed {step}")
    nm.shutdown()
    if dist is not None:
        dist.destroy_process_group()
    _say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
