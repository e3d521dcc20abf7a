"""The suite's outputs: the summary of each workload (and of the resume workload), the
targets, the table, the plot."""

from __future__ import annotations

import math
import statistics
from typing import Any

GB = 1e9
GiB = 1 << 30

# (key, label) of every save candidate, in the order of the table.
SAVES = [
    ("torch.save+fsync", "torch.save + fsync"),
    ("torch.save", "torch.save, no fsync (not durable)"),
    ("dcp.save", "DCP save"),
    ("dcp.async_save", "DCP async_save (default stager)"),
    ("dcp.async_save+stager", "DCP async_save + cached stager"),
    ("dcp.async_save+async_stager", "DCP async_save + async cached stager"),
    ("nebulite", "nebulite embedded"),
    ("nebulite async staging", "nebulite embedded, async staging"),
    ("nebulite agent", "nebulite agent"),
]
ASYNC_STAGING = ("dcp.async_save+async_stager", "nebulite async staging")
LOADS = [
    ("torch.load", "torch.load, cold page cache"),
    ("dcp.load", "DCP load, cold page cache"),
    ("nebulite store", "nebulite from store, cold (find + load)"),
    ("nebulite store find", "  of which get_latest_checkpoint"),
    ("nebulite memory agent", "nebulite from agent memory (new process)"),
    ("nebulite memory embedded", "nebulite from memory (same process)"),
]
MEMORY = [
    ("torch.save+fsync", "torch.save + fsync"),
    ("dcp.async_save", "DCP async_save (default stager)"),
    ("dcp.async_save+stager", "DCP async_save + cached stager"),
    ("dcp.async_save+async_stager", "DCP async_save + async cached stager"),
    ("nebulite", "nebulite embedded"),
    ("nebulite async staging", "nebulite embedded, async staging"),
    ("nebulite agent", "nebulite agent (trainer + agent)"),
]
NEBULITE = ["nebulite", "nebulite async staging", "nebulite agent"]


def _median(xs: list[float] | None) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(families: dict[str, Any], loads: dict[str, Any]) -> dict[str, Any]:
    """Flattens one workload's raw results into medians per candidate."""
    s: dict[str, Any] = {"blocking_s": {}, "staged_s": {}, "committed_s": {}, "load_s": {},
                         "memory_beyond_bytes": {}, "memory_peak_bytes": {}}
    state = None
    if "limits" in families:
        s["limits"] = families["limits"]
    for name, fam in families.items():
        if name == "limits":
            continue
        state = state or fam.get("state")
        for key, _ in SAVES:
            figures = fam.get(key)
            if not isinstance(figures, dict):
                continue
            for what in ("blocking_s", "staged_s", "committed_s"):
                v = _median(figures.get(what))
                if v is not None:
                    s[what][key] = v
            if "first_blocking_s" in figures:
                s.setdefault("first_blocking_s", {})[key] = figures["first_blocking_s"]
        for key, m in fam.get("memory", {}).items():
            s["memory_beyond_bytes"][key] = m["peak"] - m["baseline"]
            s["memory_peak_bytes"][key] = m["peak"]
        if "load_memory" in fam:
            s["load_s"]["nebulite memory embedded"] = fam["load_memory"]["seconds"]
            s["load_tier_embedded"] = fam["load_memory"]["tier"]
        if "memory_budget" in fam:
            s["nebulite_memory_budget"] = fam["memory_budget"]
    for key, r in loads.items():
        s["load_s"][key] = r["seconds"]
        if key == "nebulite store":
            s["load_s"]["nebulite store find"] = r["find_s"]
        if key == "nebulite memory agent":
            s["load_tier_agent"] = r["tier"]
    s["state"] = state or {}
    s["state_bytes"] = (state or {}).get("bytes", 0)
    return s


def persistence_bandwidth(summary: dict[str, Any], who: str) -> float | None:
    """Bytes per second of `who` from the end of the save (the last object staged: writing
    starts then) until the checkpoint is committed (data and manifest fsynced, marker
    written); None where either time is missing."""
    b, c = summary["blocking_s"].get(who), summary["committed_s"].get(who)
    if b is None or not c or c <= b:
        return None
    return summary["state_bytes"] / (c - b)


#: The resume workload: its name in the targets, and what resumes in it.
RESUME_WORKLOAD = "resume"
RESUME_KINDS = [("nebulite", "nebulite"), ("dcp", "DCP load")]
#: The resume workload's bytes-read target: per rank, against its own share of the checkpoint.
RESUME_READ_LIMIT = 1.2


def resume_summary(resume: dict[str, Any]) -> dict[str, Any]:
    """The resume workload's figures, per kind (nebulite, DCP): each resume's time is its
    slowest rank's; the median resume by that time gives the time and each rank's; the
    ratios of bytes read (rchar, read_bytes) to a rank's own share are each rank's worst
    over every resume."""
    s: dict[str, Any] = {"ranks": resume["ranks"], "shard_mb": resume["shard_mb"], "kinds": {}}
    for kind, _ in RESUME_KINDS:
        runs = resume.get(kind) or []
        if not runs:
            continue
        slowest = [max(r["seconds"] for r in run["ranks"]) for run in runs]
        order = sorted(range(len(runs)), key=slowest.__getitem__)
        med = runs[order[len(order) // 2]]["ranks"]
        n = len(med)

        def worst(counter: str, i: int) -> float:
            return max(run["ranks"][i]["io"][counter] / max(1, run["ranks"][i]["own_bytes"]) for run in runs)

        k: dict[str, Any] = {
            "max_s": slowest[order[len(order) // 2]], "all_max_s": slowest,
            "rank_s": [r["seconds"] for r in med], "own_bytes": [r["own_bytes"] for r in med],
            "rchar": [r["io"]["rchar"] for r in med], "read_bytes": [r["io"]["read_bytes"] for r in med],
            "rchar_ratio": [worst("rchar", i) for i in range(n)],
            "read_bytes_ratio": [worst("read_bytes", i) for i in range(n)],
            "still_cached_max": max(run["cold"]["still_cached_fraction"] for run in runs),
            "cold": sorted({run["cold"]["method"] for run in runs}),
        }
        if kind == "nebulite":
            k["rank_find_s"] = [r["find_s"] for r in med]
            k["init_rchar_max"] = max(r["init_io"]["rchar"] for run in runs for r in run["ranks"])
            k["tags"] = sorted({r["tag"] for run in runs for r in run["ranks"]})
            k["store"] = med[0]["store"]
        else:
            k["files_shared_with"] = sorted({o for run in runs for r in run["ranks"] for o in r["files_shared_with"]})
        s["kinds"][kind] = k
    return s


def _ratio_text(x: float) -> str:
    if x >= 1:
        return f"{x:.2f}x"
    return f"1/{1 / x:.1f}" if x > 0 else "0"


def targets(summaries: dict[str, dict[str, Any]], limits: dict[str, float],
            train: dict[str, Any] | None, resume: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every target, per workload and nebulite mode: the measured ratio and MET/MISSED
    (None where the target does not apply or a figure is missing). The training run's and
    the resume workload's rows are `single`: one figure each, not one per workload."""
    rows: list[dict[str, Any]] = []
    mc2 = limits.get("memcpy_2threads_Bps", math.nan)
    odw = limits.get("odirect_write_Bps", math.nan)
    odr = limits.get("odirect_read_Bps", math.nan)

    def add(target: str, who: str, w: str, value: float | None, limit: float | None, ok: bool | None,
            text: str, applies: bool = True, single: bool = False) -> None:
        rows.append({"target": target, "who": who, "workload": w, "value": value, "limit": limit,
                     "met": ok if applies else None, "ratio": text, "applies": applies, "single": single})

    for w, s in summaries.items():
        # Each workload against the limits measured right before it (else the run's).
        wl = s.get("limits") or limits
        mc2, odw, odr = wl["memcpy_2threads_Bps"], wl["odirect_write_Bps"], wl["odirect_read_Bps"]
        big = s["state_bytes"] >= GiB
        n = s["state_bytes"]
        blk, stg = s["blocking_s"], s["staged_s"]
        ts = blk.get("torch.save+fsync")
        for who in NEBULITE:
            b = blk.get(who)
            if b is not None and ts:
                add("blocking <= 1/20 of torch.save+fsync (states >= 1 GiB)", who, w, b, ts / 20,
                    b <= ts / 20, _ratio_text(b / ts), big)
            dflt = blk.get("dcp.async_save")
            if b is not None and dflt:
                add("blocking <= 1/2 of DCP async_save (states >= 1 GiB)", who, w, b, dflt / 2,
                    b <= dflt / 2, _ratio_text(b / dflt), big)
            # Stricter: DCP's fastest async_save with the same kind of staging: synchronous
            # staging against the faster of DCP's synchronous stagers, asynchronous staging
            # against DCP's asynchronous stager.
            if who == "nebulite async staging":
                base_key = "dcp.async_save+async_stager"
                base = blk.get(base_key)
            else:
                cands = {k: blk[k] for k in ("dcp.async_save", "dcp.async_save+stager") if k in blk}
                base_key = min(cands, key=cands.get) if cands else ""
                base = cands.get(base_key)
            # A comparison, not a target: DCP's own stagers copy at memcpy speed as well.
            if b is not None and base:
                add("(no target) blocking vs DCP's fastest async_save with the same staging", who, w, b,
                    None, None, f"{_ratio_text(b / base)} of {base_key}", False)
            if who == "nebulite async staging" and stg.get(who) is not None and stg.get(base_key):
                st = stg[who]
                add("(no target) until staged vs DCP's async cached stager", who, w, st, None, None,
                    _ratio_text(st / stg[base_key]), False)
        for who in ("nebulite", "nebulite agent"):
            b = blk.get(who)
            if b:
                bw = n / b
                add("staging >= 70% of 2-thread memcpy", who, w, bw, 0.7 * mc2, bw >= 0.7 * mc2,
                    f"{bw / mc2:.0%}")
        for who in NEBULITE:
            bw = persistence_bandwidth(s, who)
            if bw is not None:
                add("persistence >= 80% of O_DIRECT write", who, w, bw, 0.8 * odw, bw >= 0.8 * odw,
                    f"{bw / odw:.0%}")
        ld = s["load_s"].get("nebulite store")
        if ld:
            bw = n / ld
            add("load from store >= 80% of O_DIRECT read", "nebulite", w, bw, 0.8 * odr, bw >= 0.8 * odr,
                f"{bw / odr:.0%}")
        for who in NEBULITE:
            m = s["memory_beyond_bytes"].get(who)
            if m is not None and n:
                add("peak memory beyond the model <= 1.1x the state", who, w, m, 1.1 * n,
                    m <= 1.1 * n, f"{m / n:.2f}x")
    if train:
        for v in train["variants"]:
            r = v.get("relative_to_none")
            if v["variant"].startswith("nebulite") and r is not None:
                add(f"training steps/s with a checkpoint every {train['every']} steps >= 95% of none",
                    v["variant"], train["workload"], v["steps_per_s"], None, r >= 0.95, f"{r:.1%}",
                    single=True)
    if resume and not resume.get("skipped"):
        rs = resume_summary(resume)
        neb, dcp = rs["kinds"].get("nebulite"), rs["kinds"].get("dcp")
        who = f"nebulite, worst of {rs['ranks']} ranks"
        lim = RESUME_READ_LIMIT
        if neb:
            x = max(neb["rchar_ratio"])
            add(f"resume: bytes read per rank (rchar) <= {lim}x its own share", who, RESUME_WORKLOAD, x, lim,
                x <= lim, f"{x:.2f}x", single=True)
            # Only meaningful if the files were not in the page cache when the ranks started.
            x = max(neb["read_bytes_ratio"])
            add(f"resume: read from disk per rank (read_bytes) <= {lim}x its own share", who, RESUME_WORKLOAD,
                x, lim, x <= lim, f"{x:.2f}x", applies=neb["still_cached_max"] <= 0.01, single=True)
        if neb and dcp:
            add("(no target) resume time, slowest rank, vs DCP load", "nebulite", RESUME_WORKLOAD,
                neb["max_s"], None, None, _ratio_text(neb["max_s"] / dcp["max_s"]), False, single=True)
    return rows


# --------------------------------------------------------------------------- the table


def _fmt_s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _fmt_gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def table(result: dict[str, Any]) -> str:
    summaries: dict[str, dict[str, Any]] = result["summaries"]
    ws = [w for w in summaries if not summaries[w].get("skipped")]
    lim = result["limits"]
    col = 14
    lines: list[str] = []

    def head(title: str) -> None:
        lines.append(f"{title:46s}" + "".join(f"{w:>{col}s}" for w in ws))

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"  {label:44s}" + "".join(f"{c:>{col}s}" for c in cells))

    m = result["machine"]
    lines.append(f"nebulite benchmark suite, {m['date']}: {m['description']}")
    lines.append(f"  load average {m['loadavg_start']} at the start, {m['loadavg_end']} at the end; "
                 f"bench files on {m['bench_fs']}")
    def limits_text(x: dict[str, float]) -> str:
        def kinds(key: str) -> str:
            libc, stream = x.get(f"{key}_libc_Bps"), x.get(f"{key}_streaming_Bps")
            if libc is None or stream is None or math.isnan(stream):
                return ""
            return f": C library {libc / GB:.1f}, streaming stores {stream / GB:.1f}"

        return (f"memcpy into warm memory {x['memcpy_1thread_Bps'] / GB:.1f} GB/s (1 thread"
                f"{kinds('memcpy_1thread')}), {x['memcpy_2threads_Bps'] / GB:.1f} GB/s (2 threads"
                f"{kinds('memcpy_2threads')}); O_DIRECT write+fsync "
                f"{x['odirect_write_Bps'] / GB:.2f} GB/s, read {x['odirect_read_Bps'] / GB:.2f} GB/s")

    lines.append(f"machine limits (the better of start and end): {limits_text(lim)}")
    for when in ("start", "end"):
        if f"limits_{when}" in result:
            lines.append(f"  at the {when:5s}: {limits_text(result[f'limits_{when}'])}")
    for w, s in summaries.items():
        if s.get("skipped"):
            lines.append(f"  {w}: skipped ({s['skipped']})")
    if ws:
        lines.append("")
        head("workload")
        row("state (GB)", [_fmt_gb(summaries[w]["state_bytes"]) for w in ws])
        row("tensors", [str(summaries[w]["state"].get("tensors", "-")) for w in ws])
        row("nebulite memory budget (GB)", [_fmt_gb(summaries[w].get("nebulite_memory_budget")) for w in ws])
        reps = result["args"]["reps"]
        lines.append("")
        head("machine limits before the workload, GB/s")
        for key, label in (("memcpy_2threads_Bps", "memcpy into warm memory, 2 threads"),
                           ("odirect_write_Bps", "O_DIRECT write + fsync"), ("odirect_read_Bps", "O_DIRECT read")):
            row(label, [_fmt_gb(summaries[w].get("limits", {}).get(key)) for w in ws])
        lines.append("")
        head(f"blocking time per save, s (median of {reps})")
        for key, label in SAVES:
            row(label, [_fmt_s(summaries[w]["blocking_s"].get(key)) for w in ws])
            if key in ASYNC_STAGING:
                row("  until staged (the next optimizer step waits)",
                    [_fmt_s(summaries[w]["staged_s"].get(key)) for w in ws])
        lines.append("")
        head("first save after setting up (the warm-up), blocking s")
        for key, label in SAVES:
            if key.startswith(("dcp.async_save+", "nebulite")):
                row(label, [_fmt_s(summaries[w].get("first_blocking_s", {}).get(key)) for w in ws])
        lines.append("")
        head("time until committed (durable), s")
        for key, label in SAVES:
            if key == "torch.save":
                continue
            row(label, [_fmt_s(summaries[w]["committed_s"].get(key)) for w in ws])
        lines.append("")
        head("bandwidth, GB/s (state / time)")
        row("nebulite staging (embedded, blocking)",
            [_fmt_gb(_div(summaries[w]["state_bytes"], summaries[w]["blocking_s"].get("nebulite"))) for w in ws])
        row("nebulite persistence, embedded (1)", [_fmt_gb(persistence_bandwidth(summaries[w], "nebulite")) for w in ws])
        row("nebulite persistence, agent (1)",
            [_fmt_gb(persistence_bandwidth(summaries[w], "nebulite agent")) for w in ws])
        row("nebulite save start to committed, embedded",
            [_fmt_gb(_div(summaries[w]["state_bytes"], summaries[w]["committed_s"].get("nebulite"))) for w in ws])
        row("torch.save + fsync",
            [_fmt_gb(_div(summaries[w]["state_bytes"], summaries[w]["committed_s"].get("torch.save+fsync")))
             for w in ws])
        row("nebulite load from store (cold)",
            [_fmt_gb(_div(summaries[w]["state_bytes"], summaries[w]["load_s"].get("nebulite store"))) for w in ws])
        lines.append("  (1) from the end of the save (writing starts when its last object is staged) to committed")
        lines.append("")
        head(f"load, s (median of {result['args'].get('load_reps', 1)}, fresh processes)")
        for key, label in LOADS:
            row(label, [_fmt_s(summaries[w]["load_s"].get(key)) for w in ws])
        lines.append(f"  (cold: {result.get('cold_method', '?')})")
        lines.append("")
        head("peak memory beyond the model, GB (PSS)")
        for key, label in MEMORY:
            row(label, [_fmt_gb(summaries[w]["memory_beyond_bytes"].get(key)) for w in ws])

    train = result.get("train")
    if train:
        lines.append("")
        lines.append(f"training run: {train['workload']}, batch {train['batch']}x{train['seq']} tokens, "
                     f"a checkpoint every {train['every']} steps, {train['rounds']} rounds of "
                     f"{train['every']} steps per variant (state {train['state_bytes'] / GB:.2f} GB)")
        for v in train["variants"]:
            rel = v.get("relative_to_none")
            rel_text = f"{rel:.1%} of none" if rel is not None else ""
            rounds = " ".join(f"{x:.0%}" for x in v.get("relative_by_round", []))
            calls = v["checkpoint_call_s"]
            stall = f"checkpoint call {statistics.median(calls):.3f} s" if calls else ""
            lines.append(f"  {v['variant']:26s}{v['steps_per_s']:7.3f} steps/s {rel_text:>14s} "
                         f"(rounds: {rounds})  {stall}")

    resume = result.get("resume")
    if resume and resume.get("skipped"):
        lines.append("")
        lines.append(f"resume: skipped ({resume['skipped']})")
    elif resume:
        lines.append("")
        lines.extend(_resume_table(resume, lim))

    lines.append("")
    head("targets (measured ratio; MET, MISSED or n/a)")
    rows = result["targets"]
    for target in dict.fromkeys(r["target"] for r in rows):
        lines.append(f"  {target}")
        for who in dict.fromkeys(r["who"] for r in rows if r["target"] == target):
            cells = []
            for w in ws:
                r = next((r for r in rows if r["target"] == target and r["who"] == who
                          and r["workload"] == w), None)
                if r is None:
                    cells.append("")
                else:
                    verdict = "n/a" if r["met"] is None else ("MET" if r["met"] else "MISSED")
                    if target.startswith("(no target)"):
                        verdict = ""
                    cells.append(f"{r['ratio'].split(' of ')[0]} {verdict}".strip())
            r = next(r for r in rows if r["target"] == target and r["who"] == who)
            if r.get("single"):  # one figure, not one per workload
                verdict = "" if target.startswith("(no target)") else \
                    "n/a" if r["met"] is None else ("MET" if r["met"] else "MISSED")
                cells = [f"{r['ratio']} {verdict}".strip()]
            lines.append(f"    {who:42s}" + "".join(f"{c:>{col}s}" for c in cells))
    missed = [r for r in rows if r["met"] is False]
    lines.append(f"{len(missed)} of {sum(r['met'] is not None for r in rows)} target checks MISSED"
                 if missed else "every target check MET")
    return "\n".join(line.rstrip() for line in lines)


def _div(a: float, b: float | None) -> float | None:
    return a / b if b else None


def _resume_table(resume: dict[str, Any], lim: dict[str, float]) -> list[str]:
    """The resume workload's section: per rank and kind, time and bytes read."""
    rs = resume_summary(resume)
    neb, dcp = rs["kinds"].get("nebulite"), rs["kinds"].get("dcp")
    n, col = rs["ranks"], 10
    out = [f"resume: {n} ranks (a process each; gloo over tcp on 127.0.0.1), {rs['shard_mb']} MiB of state per "
           f"rank ({len(resume.get('save', [{}])[0].get('fingerprint', {}))} tensors); nebulite embedded: "
           f"{resume['checkpoints']} checkpoints saved, retention {resume['retention']}"
           + (f" (the store holds {', '.join(neb['store'])})" if neb else "")
           + "; DCP: dcp.save of the final shards"]
    kinds = neb or dcp
    if kinds:
        out.append(f"  each resume in {n} fresh processes, the median of {resume['reps']} by the slowest rank; "
                   f"cold: {', '.join(kinds['cold'])}, at most {kinds['still_cached_max']:.1%} of the files "
                   "still cached")

    def head(title: str) -> None:
        out.append(f"  {title:44s}" + "".join(f"{f'rank {i}':>{col}s}" for i in range(n))
                   + f"{'max':>{col}s}")

    def row(label: str, cells: list[str], last: str = "") -> None:
        out.append(f"    {label:42s}" + "".join(f"{c:>{col}s}" for c in cells) + f"{last:>{col}s}")

    def mb(x: float) -> str:
        return f"{x / 1e6:.1f}"

    head("own share of the checkpoint, MB")
    for k, label in ((neb, "nebulite (its data files)"), (dcp, "DCP (its .distcp file)")):
        if k:
            row(label, [mb(x) for x in k["own_bytes"]])
    head("resume time, s")
    if neb:
        row("nebulite: get_latest_checkpoint + load", [_fmt_s(x) for x in neb["rank_s"]], _fmt_s(neb["max_s"]))
        row("  of which get_latest_checkpoint", [_fmt_s(x) for x in neb["rank_find_s"]])
    if dcp:
        row("DCP load", [_fmt_s(x) for x in dcp["rank_s"]], _fmt_s(dcp["max_s"]))
    for counter, title in (("rchar", "bytes read (rchar) / own share"),
                           ("read_bytes", "read from disk (read_bytes) / own share")):
        head(f"{title}{' (1)' if counter == 'rchar' else ''}")
        for k, label in ((neb, "nebulite"), (dcp, "DCP load")):
            if k:
                ratios = k[f"{counter}_ratio"]
                row(label, [f"{x:.3f}x" for x in ratios], f"{max(ratios):.3f}x")
    out.append("  (1) the worst of the resumes, per rank; rchar counts every byte returned by read(2)/pread(2), "
               "from the page cache or not")
    total = sum((neb or dcp or {}).get("own_bytes", [0]))
    parts = [f"{label} {_fmt_gb(_div(sum(k['own_bytes']), k['max_s']))} GB/s"
             for k, label in ((neb, "nebulite"), (dcp, "DCP load")) if k]
    odr = lim.get("odirect_read_Bps")
    out.append(f"  all ranks together ({total / GB:.2f} GB / slowest rank's time): {', '.join(parts)}"
               + (f"; O_DIRECT read, one process: {odr / GB:.2f} GB/s" if odr else ""))
    if neb:
        out.append(f"  resumed from {', '.join(neb['tags'])}; nebulite's init() before it read at most "
                   f"{neb['init_rchar_max'] / 1e3:.1f} kB per rank (not counted above)")
    if dcp and dcp["files_shared_with"]:
        out.append(f"  DCP: a rank's file also holds items of {', '.join(dcp['files_shared_with'])}")
    return out


# --------------------------------------------------------------------------- the plot


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = {w: s for w, s in result["summaries"].items() if not s.get("skipped")}
    ws = list(summaries)
    fig, axes = plt.subplots(2, 4, figsize=(25, 11))
    fig.suptitle(f"nebulite benchmark suite, {result['machine']['date']}: {result['machine']['description']}",
                 fontsize=10)
    cmap = plt.get_cmap("tab20")
    colors = {k: cmap(i) for i, k in enumerate([k for k, _ in SAVES] + [k for k, _ in LOADS])}
    colors.update({"staging": "tab:blue", "persistence": "tab:orange", "load": "tab:green"})

    def bars(ax: Any, series: list[tuple[str, str, list[float | None]]], title: str, ylabel: str,
             log: bool = False, groups: list[str] | None = None) -> None:
        groups = ws if groups is None else groups
        ax.set_title(title, fontsize=10)
        if not groups or not series:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            return
        width = 0.8 / max(1, len(series))
        for i, (key, label, vals) in enumerate(series):
            xs = [j + i * width for j in range(len(groups))]
            ax.bar(xs, [v if v is not None else 0 for v in vals], width, label=label, color=colors.get(key))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels(groups, fontsize=8)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.7)
        ax.margins(y=0.35 if not log else 0.0)
        if log:
            lo, hi = ax.get_ylim()
            ax.set_ylim(lo, hi * 30)  # room for the legend above the bars

    def series(field: str, keys: list[tuple[str, str]]) -> list[tuple[str, str, list[float | None]]]:
        return [(k, label, [summaries[w][field].get(k) for w in ws]) for k, label in keys
                if any(summaries[w][field].get(k) is not None for w in ws)]

    bars(axes[0][0], series("blocking_s", SAVES), "blocking time per save (training stall)", "s", log=True)
    bars(axes[0][1], series("committed_s", [k for k in SAVES if k[0] != "torch.save"]),
         "time until committed (durable)", "s", log=True)
    bars(axes[0][2], series("load_s", [k for k in LOADS if k[0] != "nebulite store find"]),
         "load time (cold from disk, or from nebulite's memory tier)", "s", log=True)
    mem = [(k, label, [summaries[w]["memory_beyond_bytes"][k] / max(1, summaries[w]["state_bytes"])
                       if k in summaries[w]["memory_beyond_bytes"] else None for w in ws])
           for k, label in MEMORY]
    bars(axes[1][0], mem, "peak memory beyond the model (PSS) / state size (target: 1.1)", "x state")
    if ws:
        axes[1][0].axhline(1.1, color="k", lw=0.8, ls="--")

    lim = result["limits"]

    def frac(num: float | None, limit: float) -> float | None:
        return num / limit if num and limit and not math.isnan(limit) else None

    def bw(w: str, field: str, key: str) -> float | None:
        return _div(summaries[w]["state_bytes"], summaries[w][field].get(key))

    def wl(w: str, key: str) -> float:
        return (summaries[w].get("limits") or lim)[key]

    limits_series = [
        ("staging", "staging / 2-thread memcpy (target 0.7)",
         [frac(bw(w, "blocking_s", "nebulite"), wl(w, "memcpy_2threads_Bps")) for w in ws]),
        ("persistence", "persistence / O_DIRECT write (target 0.8)",
         [frac(persistence_bandwidth(summaries[w], "nebulite"), wl(w, "odirect_write_Bps")) for w in ws]),
        ("load", "load from store / O_DIRECT read (target 0.8)",
         [frac(bw(w, "load_s", "nebulite store"), wl(w, "odirect_read_Bps")) for w in ws]),
    ]
    bars(axes[1][1], limits_series, "nebulite (embedded) against the machine's limits", "fraction of the limit")
    for y in (0.7, 0.8) if ws else ():
        axes[1][1].axhline(y, color="k", lw=0.8, ls="--")

    ax = axes[1][2]
    train = result.get("train")
    if train:
        vs = [v for v in train["variants"] if v["variant"] != "none"]
        ax.bar(range(len(vs)), [100 * (v.get("relative_to_none") or 0) for v in vs],
               color=[colors.get({"dcp.async_save": "dcp.async_save+stager",
                                  "torch.save": "torch.save"}.get(v["variant"], v["variant"]))
                      or cmap(19 - i) for i, v in enumerate(vs)])
        ax.axhline(95, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(vs)))
        ax.set_xticklabels([v["variant"] for v in vs], rotation=20, ha="right", fontsize=8)
        ax.set_ylim(0, 110)
        ax.set_title(f"training {train['workload']}, a checkpoint every {train['every']} steps\n"
                     "steps/s relative to no checkpointing (target 95%)", fontsize=10)
        ax.set_ylabel("% of the steps/s without checkpoints")
    else:
        ax.axis("off")

    resume = result.get("resume")
    rs = resume_summary(resume) if resume and not resume.get("skipped") else None
    neb, dcp = (rs["kinds"].get("nebulite"), rs["kinds"].get("dcp")) if rs else (None, None)
    ranks = [f"rank {i}" for i in range(rs["ranks"])] if rs else []
    colors.update({"resume nebulite": "tab:green", "resume find": "tab:olive", "resume dcp": "tab:purple",
                   "rchar nebulite": "tab:green", "read_bytes nebulite": "tab:olive",
                   "rchar dcp": "tab:purple", "read_bytes dcp": "plum"})
    times: list[tuple[str, str, list[float | None]]] = []
    fractions: list[tuple[str, str, list[float | None]]] = []
    if neb:
        times += [("resume nebulite", "nebulite: get_latest_checkpoint + load", neb["rank_s"]),
                  ("resume find", "  of which get_latest_checkpoint", neb["rank_find_s"])]
        fractions += [("rchar nebulite", "nebulite, rchar", neb["rchar_ratio"]),
                      ("read_bytes nebulite", "nebulite, read_bytes", neb["read_bytes_ratio"])]
    if dcp:
        times.append(("resume dcp", "DCP load", dcp["rank_s"]))
        fractions += [("rchar dcp", "DCP load, rchar", dcp["rchar_ratio"]),
                      ("read_bytes dcp", "DCP load, read_bytes", dcp["read_bytes_ratio"])]
    shard = f", {rs['shard_mb']} MiB per rank" if rs else ""
    bars(axes[0][3], times, f"resume: each rank in a fresh process{shard}, cold\n"
         "time from get_latest_checkpoint / dcp.load to its shard loaded", "s", groups=ranks)
    bars(axes[1][3], fractions, f"resume: bytes read / the rank's own share (target {RESUME_READ_LIMIT})",
         "x own share", groups=ranks)
    if fractions:
        axes[1][3].axhline(RESUME_READ_LIMIT, color="k", lw=0.8, ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
