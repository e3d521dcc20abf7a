"""Benchmark of the node agent against the embedded engine (same state, same disk, one run).

    .venv/bin/python benchmarks/bench_agent.py [--tiny] [--dir /tmp]

Prints: blocking time per save with the agent and embedded; load time from the memory
tier (the agent's memory, as a restarted trainer would) and from the persistent store
(page cache dropped where the machine allows); the peak resident memory of the trainer
and the agent against the state's size.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9

TRAINER = r'''
import json, os, resource, statistics, sys, time
import torch
import nebulite as nm
root, mode, tiny = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
torch.manual_seed(0)
if tiny:
    state = {"model": {f"w{i}": torch.randn(256, 256) for i in range(8)}}
else:
    from transformers import GPT2Config, GPT2LMHeadModel
    import transformers; transformers.logging.set_verbosity_error()
    model = GPT2LMHeadModel(GPT2Config())
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 50257, (1, 8)); model(input_ids=x, labels=x).loss.backward(); opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
nbytes = sum(t.numel() * t.element_size() for part in state.values()
             for t in (part.values() if "state" not in part else
                       [v for s in part["state"].values() for v in s.values() if torch.is_tensor(v)]))
rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
nm.init(root, memory_buffer_size=(256 << 20) if tiny else (4 << 30), agent=(mode == "agent"),
        agent_idle_exit=120, num_of_version_in_retention=2)
nm.api._session.engine.wait_prefaulted()
blocking = []
for i in range(4):
    t = time.perf_counter()
    ck = nm.Checkpoint(f"b{i}", len(state))
    for name, part in state.items():
        ck.save(name, part)
    blocking.append(time.perf_counter() - t)
    nm.flush_persistence()
out = {"bytes": nbytes, "blocking": statistics.median(blocking[1:]),
       "trainer_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "trainer_before": rss_before}
if mode == "agent":
    out["agent_pid"] = nm.api._session.engine.agent_pid
print("RESULT " + json.dumps(out), flush=True)
'''

LOADER = r'''
import json, sys, time
import nebulite as nm
root, mode, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
if mode == "agent":
    nm.init(root, agent=True, agent_idle_exit=120)
t = time.perf_counter()
ck = nm.get_latest_checkpoint(persist_path=None if mode == "agent" else root)
tier = ck._committed["tier"]
for n in names:
    ck.load(n)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - t, "tier": tier}), flush=True)
'''


def run(code: str, *args: str, env: dict) -> dict:
    import json
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                       text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"bench_agent: a child failed:\n{r.stderr}")
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def agent_peak(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="nebulite-agent-bench-", dir=args.dir)
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    env = dict(os.environ, NEBULITE_RUNTIME_DIR=runtime, OMP_NUM_THREADS="1")
    tiny = "1" if args.tiny else "0"
    try:
        emb = run(TRAINER, os.path.join(work, "embedded"), "embedded", tiny, env=env)
        agt = run(TRAINER, os.path.join(work, "agent"), "agent", tiny, env=env)
        apeak = agent_peak(agt["agent_pid"])
        names = "model" if args.tiny else "model,optimizer"
        tier1 = run(LOADER, os.path.join(work, "agent"), "agent", names, env=env)
        dropped = drop_caches()
        tier3 = run(LOADER, os.path.join(work, "agent"), "store", names, env=env)
        state = emb["bytes"]
        print(f"nebulite agent benchmark: state {state / GB:.3f} GB; {os.cpu_count()} CPUs; dir {work}")
        print(f"  {'figure':44s}{'value':>12s}   {'baseline':30s}{'ratio':>10s}")
        rows = [
            ("blocking per save, agent", f"{agt['blocking']:.3f} s",
             f"embedded {emb['blocking']:.3f} s", f"{agt['blocking'] / emb['blocking'] - 1:+.0%}"),
            (f"load, memory tier ({tier1['tier']})", f"{tier1['seconds']:.3f} s",
             f"persistent store {tier3['seconds']:.3f} s", f"{tier3['seconds'] / tier1['seconds']:.2f}x"),
            ("peak memory beyond the model: trainer", f"{(agt['trainer_peak'] - agt['trainer_before']) / GB:.2f} GB",
             f"state {state / GB:.2f} GB", f"{(agt['trainer_peak'] - agt['trainer_before']) / state:.2f}x"),
            ("peak memory: agent", f"{apeak / GB:.2f} GB", f"state {state / GB:.2f} GB",
             f"{apeak / state:.2f}x" if apeak else "n/a"),
        ]
        for r in rows:
            print(f"  {r[0]:44s}{r[1]:>12s}   {r[2]:30s}{r[3]:>10s}")
        print(f"  (page cache {'dropped' if dropped else 'NOT dropped (not permitted)'} before the store load;"
              " the agent pre-faults its whole memory budget once, so its peak is about that budget)")
        print(f"goal: agent hand-off adds under 10%: "
              f"{'PASS' if agt['blocking'] <= 1.10 * emb['blocking'] else 'MISS'}")
    finally:
        if "agt" in locals():
            try:
                os.kill(agt["agent_pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
