"""nebulite benchmark suite: nebulite against its peers and the machine's limits, one run.

    make bench                                          # every workload and the training run
    python benchmarks/bench_suite.py --quick            # syn-256m and gpt2-124m, 2 reps, short training
    python benchmarks/bench_suite.py --workloads syn-1g,gpt2-124m --reps 5 --dir /mnt/nvme
    python benchmarks/bench_suite.py --smoke            # tiny states, seconds (the smoke test)

For each workload (a state dict saved by every candidate, same bytes, same disk): blocking
time per save, time until committed, load time (cold page cache and memory tier), peak
memory beyond the model; the resume workload (several ranks, each process resuming its own
shard, against DCP); then a training run with a checkpoint every N steps. Printed as a table
with every target's measured ratio, and written to benchmarks/results/ as JSON and a PNG
plot. benchmarks/README.md explains each figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from suite import pagecache, report, workloads  # noqa: E402
from suite.agents import stop_agents  # noqa: E402
from suite.link import ENV as LINK_ENV  # noqa: E402
from suite.link import PREFIX  # noqa: E402
from suite.monitor import PeakSampler, tree_pss  # noqa: E402

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30

#: The resume workload's name in --workloads (its ranks are run by run_resume, not run_workload).
RESUME = "resume"


class WorkerFailed(RuntimeError):
    pass


class Runner:
    """Runs suite.worker / suite.loader processes and answers their memory marks."""

    def __init__(self, env: dict[str, str], log_dir: str, verbose: bool) -> None:
        self.env = env
        self.log_dir = log_dir
        self.verbose = verbose
        self.count = 0

    def run(self, module: str, spec: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        self.count += 1
        name = spec.get("family") or spec.get("kind") or module
        log_path = os.path.join(self.log_dir, f"{self.count:02d}-{name.replace(' ', '_')}.log")
        env = dict(self.env, **(extra_env or {}))
        with open(log_path, "w") as log:
            p = subprocess.Popen([sys.executable, "-m", f"suite.{module}", json.dumps(spec)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                 bufsize=1, env=env)
            result: dict[str, Any] | None = None
            baselines: dict[str, int] = {}
            samplers: dict[str, PeakSampler] = {}
            memory: dict[str, Any] = {}
            assert p.stdin is not None
            for msg in self._messages(p, log):
                op = msg["op"]
                if op == "baseline":
                    baselines[msg["key"]] = tree_pss(p.pid)[0]
                    self._reply(p)
                elif op == "monitor":
                    key = msg["key"]
                    if msg["on"]:
                        samplers[key] = PeakSampler(p.pid).start()
                    else:
                        s = samplers.pop(key)
                        peak = s.stop()
                        memory[key] = {"baseline": baselines.get(key, 0), "peak": peak,
                                       "peak_by_process": {("worker" if pid == p.pid else f"pid {pid}"): v
                                                           for pid, v in s.peak_by_pid.items()},
                                       "samples": s.samples}
                    self._reply(p)
                elif op == "progress":
                    print(msg["text"], flush=True)
                elif op == "result":
                    result = msg["data"]
            for s in samplers.values():
                s.stop()
            rc = p.wait()
        if rc != 0 or result is None:
            with open(log_path) as f:
                tail = f.read()[-3000:]
            raise WorkerFailed(f"{module} {name} failed (exit {rc}); log {log_path}:\n{tail}")
        if memory:
            result["memory"] = memory
        return result

    def run_ranks(self, module: str, specs: list[dict[str, Any]],
                  extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Runs one process per spec, all at once (the ranks of one job), and returns their
        results in the order of `specs`. When one fails, the others are stopped: they would
        wait for it in a collective until their timeout."""
        self.count += 1
        env = dict(self.env, **(extra_env or {}))
        procs: list[subprocess.Popen] = []
        logs: list[tuple[str, Any]] = []
        results: list[dict[str, Any] | None] = [None] * len(specs)
        threads: list[threading.Thread] = []

        def pump(i: int, p: subprocess.Popen, log: Any) -> None:
            for msg in self._messages(p, log):
                if msg["op"] == "progress":
                    print(msg["text"], flush=True)
                elif msg["op"] == "result":
                    results[i] = msg["data"]

        try:
            for i, spec in enumerate(specs):
                name = f"{module}-{spec.get('role', '')}-rank{spec.get('rank', i)}"
                log_path = os.path.join(self.log_dir, f"{self.count:02d}-{name}.log")
                log = open(log_path, "w")  # noqa: SIM115 - closed below, after its process
                logs.append((log_path, log))
                p = subprocess.Popen([sys.executable, "-m", f"suite.{module}", json.dumps(spec)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                     text=True, bufsize=1, env=env)
                procs.append(p)
                t = threading.Thread(target=pump, args=(i, p, log), daemon=True)
                t.start()
                threads.append(t)
            while True:
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                    break
                time.sleep(0.1)
        finally:
            for p in procs:  # only if one failed (or this process is interrupted)
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            for t in threads:
                t.join()
            for _, log in logs:
                log.close()
        failed = [i for i, (p, r) in enumerate(zip(procs, results)) if p.returncode != 0 or r is None]
        if failed:
            # The first to fail is the one that exited on its own (the others were stopped).
            i = min(failed, key=lambda i: (procs[i].returncode in (-signal.SIGTERM, -signal.SIGKILL), i))
            with open(logs[i][0]) as f:
                tail = f.read()[-3000:]
            raise WorkerFailed(f"{module} rank {i} of {len(specs)} failed (exit {procs[i].returncode}); "
                               f"log {logs[i][0]}:\n{tail}")
        return [r for r in results if r is not None]

    def _messages(self, p: subprocess.Popen, log: Any) -> Iterator[dict[str, Any]]:
        """The requests a worker writes to stdout; its other output goes to its log."""
        assert p.stdout is not None
        for line in p.stdout:
            if not line.startswith(PREFIX):
                log.write(line)
                if self.verbose:
                    print(line, end="", file=sys.stderr)
                continue
            yield json.loads(line[len(PREFIX):])

    @staticmethod
    def _reply(p: subprocess.Popen) -> None:
        assert p.stdin is not None
        p.stdin.write("ok\n")
        p.stdin.flush()


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def estimated_bytes(name: str) -> int:
    w = workloads.get(name)
    if w.kind == "synthetic":
        return w.target_bytes
    d, L, V = w.n_embd, w.n_layer, w.vocab_size
    params = V * d + w.n_positions * d + L * (12 * d * d + 13 * d) + 2 * d
    return params * 12  # float32 parameters and two float32 moments


def machine(bench_dir: str) -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    fs = "?"
    best = ""
    real = os.path.realpath(bench_dir)
    for part in psutil.disk_partitions(all=True):
        if (real == part.mountpoint or real.startswith(part.mountpoint.rstrip("/") + "/")) \
                and len(part.mountpoint) > len(best):
            best, fs = part.mountpoint, f"{part.fstype} ({part.device} on {part.mountpoint})"
    import torch

    ram = psutil.virtual_memory().total
    desc = (f"{os.cpu_count()} CPUs ({cpu}), {ram / GiB:.0f} GiB RAM, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
            "cpus": os.cpu_count(), "cpu": cpu, "ram_bytes": ram, "kernel": platform.release(),
            "torch": torch.__version__, "description": desc, "bench_fs": fs,
            "loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def run_workload(runner: Runner, name: str, args: argparse.Namespace, work: str) -> tuple[dict, dict, str]:
    """Every candidate on one workload; returns (families, loads, cold method)."""
    wdir = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    base = {"workload": name, "dir": wdir, "reps": args.reps, "memory_factor": args.memory_factor}
    env = {"NEBULITE_RUNTIME_DIR": runtime}
    families: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    cold = ""

    def load(kind: str, target: dict[str, str], make_cold: bool = True) -> None:
        """args.load_reps loads, each in a fresh process (cold: after evicting the files);
        keeps the median one and every time."""
        nonlocal cold
        runs = []
        for _ in range(args.load_reps):
            if make_cold:
                c = pagecache.make_cold([target.get("path") or target["root"]], args.drop_caches)
                cold = f"{c['method']}, {c['still_cached_fraction']:.1%} of the files still cached"
            runs.append(runner.run("loader", dict(target, kind=kind), env))
        runs.sort(key=lambda r: r["seconds"])
        r = dict(runs[len(runs) // 2], all_seconds=[x["seconds"] for x in runs],
                 cold=cold if make_cold else "memory tier")
        key = {"torch.load": "torch.load", "dcp.load": "dcp.load", "nebulite-store": "nebulite store",
               "nebulite-agent": "nebulite memory agent"}[kind]
        loads[key] = r

    try:
        # The machine's limits again, right before this workload's candidates: a shared
        # disk drifts over a long run, and each workload is compared with its own.
        probe = max(64 * MiB, min(GiB, estimated_bytes(name)) // (8 * MiB) * (8 * MiB))
        print(f"{name}: machine limits ({probe // MiB} MiB probes)", flush=True)
        families["limits"] = runner.run("worker", {"family": "limits", "dir": wdir, "memcpy_bytes": probe,
                                                   "disk_bytes": probe})
        print(f"{name}: torch.save", flush=True)
        families["torch"] = runner.run("worker", dict(base, family="torch"), env)
        load("torch.load", {"path": families["torch"]["file"]})
        _rm(families["torch"]["file"])

        print(f"{name}: DCP", flush=True)
        families["dcp"] = runner.run("worker", dict(base, family="dcp"), env)
        load("dcp.load", {"path": families["dcp"]["dir"]})
        _rm(families["dcp"]["dir"])

        print(f"{name}: nebulite embedded", flush=True)
        families["nebulite-sync"] = runner.run("worker", dict(base, family="nebulite-sync"), env)
        load("nebulite-store", {"root": families["nebulite-sync"]["root"]})
        _rm(families["nebulite-sync"]["root"])

        print(f"{name}: nebulite embedded, async staging", flush=True)
        families["nebulite-async"] = runner.run("worker", dict(base, family="nebulite-async"), env)
        _rm(families["nebulite-async"]["root"])

        print(f"{name}: nebulite agent", flush=True)
        families["nebulite-agent"] = runner.run("worker", dict(base, family="nebulite-agent"), env)
        load("nebulite-agent", {"root": families["nebulite-agent"]["root"]}, make_cold=False)
    finally:
        stop_agents(runtime)
        shutil.rmtree(wdir, ignore_errors=True)
    return families, loads, cold


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_resume(runner: Runner, args: argparse.Namespace, work: str) -> dict[str, Any]:
    """The resume workload: `--resume-ranks` processes save their shards (nebulite, then
    DCP) and exit; then, `--load-reps` times each, as many fresh processes resume from the
    store with nebulite and from DCP's checkpoint, each after evicting the files from the
    page cache (nebulite and DCP take turns going first)."""
    world, reps = args.resume_ranks, args.load_reps
    rdir = tempfile.mkdtemp(prefix="resume-", dir=work)
    runtime = tempfile.mkdtemp(prefix="nbrt-")  # short: Unix socket paths are limited
    base = {"world": world, "shard_mb": args.resume_shard_mb, "checkpoints": args.resume_checkpoints,
            "root": os.path.join(rdir, "nebulite"), "dcp_dir": os.path.join(rdir, "dcp"),
            "memory_factor": args.memory_factor, "timeout_s": 300}
    env = {"NEBULITE_RUNTIME_DIR": runtime}
    out: dict[str, Any] = {"ranks": world, "shard_mb": args.resume_shard_mb,
                           "checkpoints": args.resume_checkpoints, "retention": 2, "reps": reps,
                           "nebulite": [], "dcp": []}
    try:
        print(f"{RESUME}: {world} ranks save {args.resume_shard_mb} MiB shards", flush=True)
        port = _free_port()
        saved = runner.run_ranks("resume", [dict(base, role="save", rank=r, port=port) for r in range(world)], env)
        out["save"] = saved
        for rep in range(reps):
            for kind in ("nebulite", "dcp") if rep % 2 == 0 else ("dcp", "nebulite"):
                cold = pagecache.make_cold([base["root"], base["dcp_dir"]], args.drop_caches)
                print(f"{RESUME}: {kind}, resume {rep + 1} of {reps}", flush=True)
                port = _free_port()
                ranks = runner.run_ranks(
                    "resume", [dict(base, role=kind, rank=r, port=port, step=saved[r]["step"],
                                    fingerprint=saved[r]["fingerprint"]) for r in range(world)], env)
                out[kind].append({"ranks": ranks, "cold": cold})
    finally:
        stop_agents(runtime)
        shutil.rmtree(rdir, ignore_errors=True)
    return out


def rereport(path: str, no_plot: bool) -> int:
    """The table, targets and plot of a result file, derived again from its measurements."""
    with open(path) as f:
        result = json.load(f)
    result["targets"] = report.targets({w: s for w, s in result["summaries"].items() if not s.get("skipped")},
                                       result["limits"], result.get("train"), result.get("resume"))
    text = report.table(result)
    print(text)
    base = os.path.splitext(path)[0]
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    if not no_plot:
        report.plot(result, base + ".png")
    print(f"\nrewrote {os.path.relpath(base)}.txt" + ("" if no_plot else " and .png"))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description="nebulite benchmark suite (see benchmarks/README.md)")
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated, from: {', '.join(workloads.WORKLOADS)}, {RESUME} "
                         f"(default: {','.join(workloads.DEFAULT_WORKLOADS)},{RESUME})")
    ap.add_argument("--quick", action="store_true",
                    help=f"{','.join(workloads.QUICK_WORKLOADS)}, 2 reps, 2 training rounds")
    ap.add_argument("--smoke", action="store_true", help="tiny states and training: seconds (smoke test)")
    ap.add_argument("--reps", type=int, default=None, help="timed saves per candidate, after a warm-up (3)")
    ap.add_argument("--dir", default="/tmp", help="where bench files go (a fresh subdirectory, removed after)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="where the JSON and PNG go")
    ap.add_argument("--memory-factor", type=float, default=1.02,
                    help="nebulite memory budget = factor x state size + 16 MiB (default 1.02)")
    ap.add_argument("--drop-caches", choices=["auto", "fadvise", "global"], default="auto",
                    help="how loads are made cold: fadvise(DONTNEED) on the files, dropping the whole "
                         "page cache, or auto (fadvise, then global if pages stayed)")
    ap.add_argument("--load-reps", type=int, default=None, help="loads per kind, each in a fresh process (3)")
    ap.add_argument("--resume-ranks", type=int, default=None,
                    help=f"the {RESUME} workload: ranks, one process each (4)")
    ap.add_argument("--resume-shard-mb", type=int, default=None,
                    help=f"the {RESUME} workload: MiB of state per rank (256)")
    ap.add_argument("--resume-checkpoints", type=int, default=3,
                    help=f"the {RESUME} workload: checkpoints saved before the resume (3; retention keeps 2)")
    ap.add_argument("--no-train", action="store_true", help="skip the training run")
    ap.add_argument("--train-workload", default=None, help="model of the training run (gpt2-124m)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="a checkpoint every N steps (10)")
    ap.add_argument("--train-rounds", type=int, default=None,
                    help="rounds of N steps per variant, variants taking turns (5)")
    ap.add_argument("--train-batch", type=int, default=2)
    ap.add_argument("--train-seq", type=int, default=64)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--verbose", action="store_true", help="show the workers' own output")
    ap.add_argument("--report", metavar="JSON", default=None,
                    help="measure nothing: print the table and redraw the plot of a result file")
    args = ap.parse_args()
    if args.report:
        return rereport(args.report, args.no_plot)

    if args.smoke:
        names = ["syn-tiny"]
        args.reps = args.reps or 1
        args.load_reps = args.load_reps or 1
        args.train_workload = args.train_workload or "gpt2-tiny"
        args.train_rounds = args.train_rounds or 1
        args.ckpt_every = 2
        args.resume_ranks = args.resume_ranks or 2
        args.resume_shard_mb = args.resume_shard_mb or 1
        limit_bytes = 64 * MiB
    elif args.quick:
        names = list(workloads.QUICK_WORKLOADS) + [RESUME]
        args.reps = args.reps or 2
        args.train_rounds = args.train_rounds or 2
        limit_bytes = 512 * MiB
    else:
        names = list(workloads.DEFAULT_WORKLOADS) + [RESUME]
        limit_bytes = GiB
    if args.workloads:
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        for n in names:
            if n != RESUME:
                workloads.get(n)
    args.resume_ranks = args.resume_ranks or 4
    args.resume_shard_mb = args.resume_shard_mb or 256
    if args.resume_ranks < 1 or args.resume_shard_mb < 1 or args.resume_checkpoints < 1:
        ap.error("--resume-ranks, --resume-shard-mb and --resume-checkpoints must be at least 1")
    args.reps = args.reps or 3
    args.load_reps = args.load_reps or (2 if args.quick else 3)
    args.train_workload = args.train_workload or "gpt2-124m"
    args.train_rounds = args.train_rounds or 5

    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="nebulite-bench-", dir=args.dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = os.path.join(args.out, f"logs-{stamp}")
    os.makedirs(log_dir, exist_ok=True)
    # Workers import the suite from here and nebulite from where this process found it.
    paths = [HERE] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env[LINK_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    runner = Runner(env, log_dir, args.verbose)
    t_start = time.perf_counter()
    result: dict[str, Any] = {"args": vars(args), "machine": machine(args.dir), "workloads": {},
                              "summaries": {}}
    try:
        def measure_limits() -> dict[str, float]:
            print(f"machine limits ({limit_bytes // MiB} MiB probes)", flush=True)
            return runner.run("worker", {"family": "limits", "dir": tempfile.mkdtemp(prefix="limits-", dir=work),
                                         "memcpy_bytes": limit_bytes, "disk_bytes": limit_bytes})

        result["limits_start"] = measure_limits()
        colds = set()
        for name in names:
            if name == RESUME:
                # Per rank: its shard, nebulite's memory budget for it, and a little.
                need = 2.3 * args.resume_ranks * args.resume_shard_mb * MiB + GiB
                avail = psutil.virtual_memory().available
                if avail < need:
                    why = f"needs about {need / GB:.1f} GB of free memory, {avail / GB:.1f} GB available"
                    print(f"{name}: skipped ({why})", flush=True)
                    result["resume"] = {"skipped": why}
                else:
                    result["resume"] = run_resume(runner, args, work)
                    result["resume"]["summary"] = report.resume_summary(result["resume"])
                continue
            need = 2.3 * estimated_bytes(name) + GiB
            avail = psutil.virtual_memory().available
            if avail < need:
                why = f"needs about {need / GB:.1f} GB of free memory, {avail / GB:.1f} GB available"
                print(f"{name}: skipped ({why})", flush=True)
                result["summaries"][name] = {"skipped": why}
                continue
            families, loads, cold = run_workload(runner, name, args, work)
            colds.add(cold)
            result["workloads"][name] = {"families": families, "loads": loads,
                                         "description": workloads.get(name).description}
            result["summaries"][name] = report.summarize(families, loads)
        result["cold_method"] = "; ".join(sorted(colds))
        if not args.no_train:
            print(f"training run: {args.train_workload}", flush=True)
            tdir = tempfile.mkdtemp(prefix="train-", dir=work)
            runtime = tempfile.mkdtemp(prefix="nbrt-")
            try:
                result["train"] = runner.run(
                    "worker", {"family": "train", "workload": args.train_workload, "dir": tdir,
                               "rounds": args.train_rounds, "every": args.ckpt_every,
                               "batch": args.train_batch, "seq": args.train_seq,
                               "memory_factor": args.memory_factor},
                    {"NEBULITE_RUNTIME_DIR": runtime})
            finally:
                stop_agents(runtime)
        # Measured again at the end: each limit is the better of the two (the machine may be
        # shared, and a limit measured while others ran would flatter the candidates).
        if not args.smoke:
            result["limits_end"] = measure_limits()
        end = result.get("limits_end", {})
        result["limits"] = {k: max(v, end.get(k, v)) for k, v in result["limits_start"].items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    result["targets"] = report.targets({w: s for w, s in result["summaries"].items() if not s.get("skipped")},
                                       result["limits"], result.get("train"), result.get("resume"))
    result["seconds"] = time.perf_counter() - t_start
    text = report.table(result)
    print()
    print(text)
    base = os.path.join(args.out, f"bench-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    outputs = [base + ".json", base + ".txt"]
    if not args.no_plot:
        report.plot(result, base + ".png")
        outputs.append(base + ".png")
    for p in outputs:
        latest = os.path.join(args.out, "latest" + os.path.splitext(p)[1])
        shutil.copyfile(p, latest)
    print(f"\nresults: {', '.join(os.path.relpath(p) for p in outputs)} (and latest.*); "
          f"worker logs in {os.path.relpath(log_dir)}; took {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
