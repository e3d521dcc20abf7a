"""Object stores: nebulite's persistence and load against the client library used directly.

    python benchmarks/bench_object_stores.py                       # az, s3, gs; 256 MiB, 6 reps
    python benchmarks/bench_object_stores.py --stores s3 --mb 1024 --reps 5
    python benchmarks/bench_object_stores.py --smoke               # 8 MiB, 1 rep (the smoke test)

For each store an emulator is started on 127.0.0.1 (Azurite for az://, moto server for
s3://, gcp-storage-emulator for gs://; tests/object_stores.py) and, in the same run, with
the same bytes (one float32 tensor of --mb MiB of random values):

* direct upload: the library call nebulite's client makes, by hand (obstore ``put`` of one
  memoryview with the same part size and concurrency; for gs the one-call
  ``upload_from_string`` and the same parallel composite upload written out);
* nebulite persistence: ``Checkpoint.save()`` start to ``flush_persistence()`` return (the
  state in memory until committed in the store: the data file, the manifest, the commit
  marker, the sequence claim); save()'s blocking time is shown too;
* direct download: parallel ranged reads of 16 MiB pieces, 8 at a time, into one buffer
  allocated in the timed section (as a load allocates its tensors), and one plain GET of
  the whole object;
* nebulite load, in a fresh session: ``get_checkpoint(tag, persist_path)`` (reads the
  catalog and the manifest, then reads and CRC-checks the data file into the buffers the
  load hands out) and ``load()``; the loaded tensor is compared with the saved one.

Each candidate runs --reps times (median reported), taking turns at going first, and each
starts once the emulator is idle, so that none is timed while the emulator still works
for the one before. The peak
RSS increase of the process during each upload is sampled in a thread. Prints a table per
store with the ratios against the targets and writes benchmarks/results/object-stores-*.json.
benchmarks/README.md explains the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))  # the emulators the object-store tests use

import object_stores  # noqa: E402
from object_stores import AZURITE_ACCOUNT, AZURITE_KEY, store_environment  # noqa: E402

import nebulite  # noqa: E402
import nebulite.api  # noqa: E402
from nebulite.stores import StoreTuning, open_client  # noqa: E402

MiB = 1 << 20
TARGET = 0.90  # nebulite's bandwidth / the direct library's, for persistence and for load
STORES = ("az", "s3", "gs")
EMULATOR_NAMES = {"az": "Azurite", "s3": "moto server", "gs": "gcp-storage-emulator"}


# --- measuring ---------------------------------------------------------------------------

class PeakRss:
    """Samples this process's RSS in a thread until stop(); the peak above the first sample."""

    def __init__(self, interval: float = 0.01) -> None:
        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.base = self._proc.memory_info().rss
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak - self.base


def _pieces(size: int, part: int) -> list[tuple[int, int]]:
    return [(a, min(a + part, size)) for a in range(0, size, part)]


def _parallel(jobs: list[Callable[[], Any]], threads: int) -> list[Any]:
    with cf.ThreadPoolExecutor(max_workers=threads) as pool:
        return [f.result() for f in [pool.submit(j) for j in jobs]]


def _fresh_buffer(size: int) -> memoryview:
    """Memory not touched yet (its pages fault in as it is written), as a load's tensors."""
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy()).cast("B")


class RequestLog:
    """Every call nebulite's storage driver makes on its object-store client, with its
    duration: nebulite.stores.open_client (which the driver calls for each store it opens)
    hands out clients wrapped in a pass-through that records each call (a few microseconds
    each, against milliseconds per request)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int, float]] = []  # op, key, bytes, seconds
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self.calls = []

    def install(self) -> None:
        import nebulite.stores as stores

        opened = stores.open_client
        log = self

        class Recorded:
            def __init__(self, client: Any) -> None:
                self._client = client
                self.url = client.url

            def __getattr__(self, op: str) -> Any:
                fn = getattr(self._client, op)
                if not callable(fn):
                    return fn

                def call(*args: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return fn(*args)
                    finally:
                        seconds = time.perf_counter() - t0
                        key = args[0] if args and isinstance(args[0], str) else ""
                        n = 0
                        if op == "put":
                            n = sum(v.nbytes for v in args[1])
                        elif op == "get":
                            n = int(args[2])
                        with log._lock:
                            log.calls.append((op, key, n, seconds))

                return call

        stores.open_client = lambda url: Recorded(opened(url))

    def breakdown(self, data_key_suffix: str) -> dict[str, Any]:
        """Calls on the data file (puts, gets big and small) apart from all the others."""
        with self._lock:
            calls = list(self.calls)
        out: dict[str, Any] = {"requests": len(calls)}
        groups = {
            "data_put": [c for c in calls if c[0] == "put" and c[1].endswith(data_key_suffix)],
            "data_get_large": [c for c in calls if c[0] == "get" and c[1].endswith(data_key_suffix)
                               and c[2] >= MiB],
            "data_get_small": [c for c in calls if c[0] == "get" and c[1].endswith(data_key_suffix)
                               and c[2] < MiB],
        }
        grouped = {id(c) for g in groups.values() for c in g}
        groups["other"] = [c for c in calls if id(c) not in grouped]
        for name, g in groups.items():
            out[name] = {"count": len(g), "seconds": sum(c[3] for c in g),
                         "bytes": sum(c[2] for c in g)}
        out["other"]["ops"] = dict(Counter(c[0] for c in groups["other"]))
        return out


REQUESTS = RequestLog()


# --- the libraries used directly ---------------------------------------------------------

class DirectObstore:
    """obstore against the emulator, configured by hand (not through nebulite.stores)."""

    def __init__(self, scheme: str, emu: object_stores.Emulator, tuning: StoreTuning) -> None:
        import obstore
        import obstore.store

        self.obstore = obstore
        self.tuning = tuning
        options = {"allow_http": True, "timeout": "300s"}
        if scheme == "s3":
            self.store = obstore.store.S3Store(
                emu.container, endpoint=emu.endpoint, access_key_id="testing",
                secret_access_key="testing", region="us-east-1", client_options=options)
            self.upload_call = "obstore.put(S3Store, memoryview)"
        else:
            self.store = obstore.store.AzureStore(
                emu.container, account_name=AZURITE_ACCOUNT, account_key=AZURITE_KEY,
                endpoint=emu.endpoint, client_options=options)
            self.upload_call = "obstore.put(AzureStore, memoryview)"

    def uploads(self) -> dict[str, Callable[[str, memoryview, bytes], None]]:
        t = self.tuning

        def put(key: str, view: memoryview, _: bytes) -> None:
            self.obstore.put(self.store, key, view, chunk_size=t.part_bytes,
                             max_concurrency=t.concurrency)

        return {self.upload_call + f", {t.part_bytes // MiB} MiB parts x {t.concurrency}": put}

    def downloads(self) -> dict[str, Callable[[str, int], Any]]:
        t = self.tuning

        def ranged(key: str, size: int) -> memoryview:
            out = _fresh_buffer(size)

            def piece(a: int, b: int) -> None:
                out[a:b] = memoryview(self.obstore.get_range(self.store, key, start=a, end=b))

            _parallel([lambda a=a, b=b: piece(a, b) for a, b in _pieces(size, t.part_bytes)],
                      t.concurrency)
            return out

        def whole(key: str, size: int) -> memoryview:
            return memoryview(self.obstore.get(self.store, key).bytes())

        return {
            f"obstore.get_range {t.part_bytes // MiB} MiB x {t.concurrency} threads": ranged,
            "obstore.get, one GET": whole,
        }

    def delete_prefix(self, prefix: str) -> None:
        for chunk in self.obstore.list(self.store, prefix):
            for m in chunk:
                self.obstore.delete(self.store, m["path"])


class DirectGcs:
    """google-cloud-storage against the emulator (STORAGE_EMULATOR_HOST is set)."""

    def __init__(self, emu: object_stores.Emulator, tuning: StoreTuning) -> None:
        import requests.adapters
        from google.cloud import storage

        self.tuning = tuning
        self.client = storage.Client(project="bench")
        # A connection per thread, as many threads as the parallel candidates use.
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=max(32, 4 * tuning.concurrency))
        self.client._http.mount("http://", adapter)
        self.bucket = self.client.bucket(emu.container)

    def uploads(self) -> dict[str, Callable[[str, memoryview, bytes], None]]:
        t = self.tuning

        def simple(key: str, _: memoryview, data: bytes) -> None:
            self.bucket.blob(key).upload_from_string(data, content_type="application/octet-stream")

        def composite(key: str, view: memoryview, _: bytes) -> None:
            tag = uuid.uuid4().hex[:12]
            temps: list[str] = []

            def part(name: str, a: int, b: int) -> None:
                self.bucket.blob(name).upload_from_string(
                    view[a:b].tobytes(), content_type="application/octet-stream")

            def compose(dest: str, sources: list[str]) -> None:
                blob = self.bucket.blob(dest)
                blob.content_type = "application/octet-stream"
                blob.compose([self.bucket.blob(s) for s in sources])

            with cf.ThreadPoolExecutor(max_workers=t.concurrency) as pool:
                parts = [f"{key}.part-{k}-{tag}" for k in range(len(_pieces(view.nbytes, t.part_bytes)))]
                temps += parts
                for f in [pool.submit(part, p, a, b)
                          for p, (a, b) in zip(parts, _pieces(view.nbytes, t.part_bytes))]:
                    f.result()
                level = 0
                while len(parts) > 32:  # compose takes at most 32 sources
                    groups = [parts[i:i + 32] for i in range(0, len(parts), 32)]
                    parts = [f"{key}.compose-{level}-{i}-{tag}" for i in range(len(groups))]
                    temps += parts
                    for f in [pool.submit(compose, d, g) for d, g in zip(parts, groups)]:
                        f.result()
                    level += 1
                compose(key, parts)
                for f in [pool.submit(self.bucket.blob(n).delete) for n in temps]:
                    f.result()

        return {
            "blob.upload_from_string, one call": simple,
            f"parallel composite: {t.part_bytes // MiB} MiB parts x {t.concurrency}, compose": composite,
        }

    def downloads(self) -> dict[str, Callable[[str, int], Any]]:
        t = self.tuning

        def ranged(key: str, size: int) -> memoryview:
            out = _fresh_buffer(size)
            blob = self.bucket.blob(key)

            def piece(a: int, b: int) -> None:
                out[a:b] = blob.download_as_bytes(start=a, end=b - 1, raw_download=True,
                                                  checksum=None, single_shot_download=True)

            _parallel([lambda a=a, b=b: piece(a, b) for a, b in _pieces(size, t.part_bytes)],
                      t.concurrency)
            return out

        def whole(key: str, size: int) -> bytes:
            return self.bucket.blob(key).download_as_bytes(raw_download=True, checksum=None,
                                                           single_shot_download=True)

        return {
            f"blob.download_as_bytes ranges {t.part_bytes // MiB} MiB x {t.concurrency} threads": ranged,
            "blob.download_as_bytes, one GET": whole,
        }

    def delete_prefix(self, prefix: str) -> None:
        for blob in list(self.client.list_blobs(self.bucket, prefix=prefix)):
            blob.delete()


# --- one store ---------------------------------------------------------------------------

NEB_PERSIST = "nebulite save -> committed"
NEB_LOAD = "nebulite get_checkpoint + load"
DATA_SUFFIX = "/rank0/model"  # the data file of the object saved as "model" by rank 0


def _nebulite_persist(url: str, tag: str, tensor: torch.Tensor) -> dict[str, Any]:
    # prefault: the memory tier's pages are touched after init(), in the background, as they
    # are in a trainer by its first checkpoint; waited for here (a fresh arena's page faults
    # would otherwise be in save(): on this kind of VM they cost more than the copy).
    nebulite.init(persistent_storage_path=url, agent=False, persistent_time_interval=0,
                  memory_buffer_size=tensor.nbytes + (64 << 20), prefault=True)
    try:
        engine = getattr(nebulite.api._session, "engine", None)
        if hasattr(engine, "wait_prefaulted"):
            engine.wait_prefaulted()
        REQUESTS.clear()
        rss = PeakRss()
        t0 = time.perf_counter()
        nebulite.Checkpoint(tag).save("model", tensor)
        t1 = time.perf_counter()
        nebulite.flush_persistence()
        t2 = time.perf_counter()
        rss_increase = rss.stop()
        requests = REQUESTS.breakdown(DATA_SUFFIX)
    finally:
        nebulite.api._reset_for_tests()
    keys = open_client(url).list("", True)[0]
    data = [(k, size) for k, size, _ in keys if k.endswith(DATA_SUFFIX)]
    assert len(data) == 1, keys
    return {"seconds": t2 - t0, "save_s": t1 - t0, "rss_increase": rss_increase,
            "data_file_bytes": data[0][1], "objects": sorted(k for k, _, _ in keys),
            "requests": requests}


def _nebulite_load(url: str, tag: str, tensor: torch.Tensor) -> dict[str, Any]:
    nebulite.api._reset_for_tests()  # a fresh session: nothing remembered of the store
    try:
        REQUESTS.clear()
        t0 = time.perf_counter()
        ck = nebulite.get_checkpoint(tag=tag, persist_path=url)
        t1 = time.perf_counter()
        loaded = ck.load("model")
        t2 = time.perf_counter()
        requests = REQUESTS.breakdown(DATA_SUFFIX)
    finally:
        nebulite.api._reset_for_tests()
    assert ck.tag == tag, f"no checkpoint {tag!r} found in {url}"
    return {"seconds": t2 - t0, "get_checkpoint_s": t1 - t0, "load_s": t2 - t1,
            "equal": bool(torch.equal(loaded, tensor)), "requests": requests}


def _settle(emu, quiet_s: float = 0.2, at_most_s: float = 5.0) -> None:
    """Returns once the emulator's process used under 2% of a core for `quiet_s` (or after
    `at_most_s`): what it still does for the previous candidate is not timed in the next."""
    if emu.proc is None:
        return
    try:
        root = psutil.Process(emu.proc.pid)
        procs = [root] + root.children(recursive=True)  # a wrapper's server, too

        def used() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        end = time.monotonic() + at_most_s
        while time.monotonic() < end:
            before = used()
            time.sleep(quiet_s)
            if used() - before < 0.02 * quiet_s:
                return
    except psutil.Error:
        return


def _timed(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    rss = PeakRss()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return seconds, rss.stop(), out


def run_store(scheme: str, mb: int, reps: int, tuning: StoreTuning, log: Callable[[str], None]) -> dict[str, Any]:
    emu = object_stores.STARTERS[scheme]()
    result: dict[str, Any] = {"store": scheme, "emulator": EMULATOR_NAMES[scheme],
                              "emulator_pid": emu.proc.pid if emu.proc else None,
                              "emulator_dir": str(emu.tmp), "endpoint": emu.endpoint}
    try:
        with store_environment(emu.env):
            direct = DirectGcs(emu, tuning) if scheme == "gs" else DirectObstore(scheme, emu, tuning)
            uploads, downloads = direct.uploads(), direct.downloads()
            result["upload_baselines"] = list(uploads)
            result["download_baselines"] = list(downloads)
            gen = torch.Generator().manual_seed(1234)
            # One warm-up of every candidate on 1 MiB (connections, imports), not timed.
            _rep(direct, uploads, downloads, emu, torch.rand(1 << 18, generator=gen), 0, None)
            tensor = torch.rand(mb * MiB // 4, generator=gen, dtype=torch.float32)
            runs: list[dict[str, Any]] = []
            for rep in range(reps):
                runs.append(_rep(direct, uploads, downloads, emu, tensor, rep, log))
            result["runs"] = runs
            result["state_bytes"] = tensor.nbytes
    finally:
        nebulite.api._reset_for_tests()  # no session left to reach the emulator
        emu.stop()
    return result


def _rep(direct, uploads: dict, downloads: dict, emu, tensor: torch.Tensor, rep: int,
         log: Callable[[str], None] | None) -> dict[str, Any]:
    view = memoryview(tensor.numpy()).cast("B")
    size = view.nbytes
    data = bytes(view) if any("one call" in n for n in uploads) else b""  # upload_from_string's bytes
    prefix = f"direct-{uuid.uuid4().hex[:12]}"
    url, tag = emu.new_url(), f"bench{rep}"
    out: dict[str, Any] = {"rep": rep, "upload": {}, "download": {}}
    up_keys: dict[str, str] = {}

    def note(kind: str, name: str, r: dict[str, Any]) -> None:
        if log is not None:
            log(f"  rep {rep + 1} {kind:8s} {name}: {r['seconds']:.3f} s")

    up_order: list[str] = list(uploads) + [NEB_PERSIST]
    if rep % 2:
        up_order.reverse()
    for name in up_order:
        _settle(emu)
        if name == NEB_PERSIST:
            r = _nebulite_persist(url, tag, tensor)
        else:
            key = up_keys[name] = f"{prefix}/u{len(up_keys)}"
            seconds, rss, _ = _timed(lambda: uploads[name](key, view, data))
            r = {"seconds": seconds, "rss_increase": rss, "bytes": size}
        out["upload"][name] = r
        note("upload", name, r)
    data = b""  # its copy of the state is not needed any more
    src = next(iter(up_keys.values()))  # the object the first direct upload wrote
    down_order: list[str] = list(downloads) + [NEB_LOAD]
    if rep % 2 == 0:  # the other way round than the uploads
        down_order.reverse()
    for name in down_order:
        _settle(emu)
        if name == NEB_LOAD:
            r = _nebulite_load(url, tag, tensor)
        else:
            seconds, _, got = _timed(lambda: downloads[name](src, size))
            r = {"seconds": seconds, "bytes": size, "equal": bytes(got) == bytes(view)}
            del got
        out["download"][name] = r
        note("download", name, r)
    out["upload_order"], out["download_order"] = up_order, down_order
    direct.delete_prefix(prefix)
    client = open_client(url)
    for k, _, _ in client.list("", True)[0]:
        client.delete(k)
    return out


# --- summary and report ------------------------------------------------------------------

def summarize(res: dict[str, Any]) -> dict[str, Any]:
    runs = res["runs"]
    data_bytes = runs[0]["upload"][NEB_PERSIST]["data_file_bytes"]

    def med(kind: str, name: str, field: str = "seconds") -> float:
        return statistics.median(r[kind][name][field] for r in runs)

    s: dict[str, Any] = {"data_file_bytes": data_bytes, "state_bytes": res["state_bytes"],
                         "upload": {}, "download": {}}
    for name in res["upload_baselines"]:
        t = med("upload", name)
        s["upload"][name] = {"seconds": t, "mib_s": res["state_bytes"] / MiB / t,
                             "rss_increase": max(r["upload"][name]["rss_increase"] for r in runs)}
    t = med("upload", NEB_PERSIST)
    s["upload"][NEB_PERSIST] = {"seconds": t, "mib_s": data_bytes / MiB / t,
                                "save_s": med("upload", NEB_PERSIST, "save_s"),
                                "rss_increase": max(r["upload"][NEB_PERSIST]["rss_increase"] for r in runs)}
    for name in res["download_baselines"]:
        t = med("download", name)
        s["download"][name] = {"seconds": t, "mib_s": res["state_bytes"] / MiB / t}
    t = med("download", NEB_LOAD)
    s["download"][NEB_LOAD] = {"seconds": t, "mib_s": data_bytes / MiB / t,
                               "get_checkpoint_s": med("download", NEB_LOAD, "get_checkpoint_s"),
                               "load_s": med("download", NEB_LOAD, "load_s")}
    for kind, name in (("upload", NEB_PERSIST), ("download", NEB_LOAD)):
        logs = [r[kind][name].get("requests") for r in runs]
        if all(logs):
            s[kind][name]["requests"] = {
                group: {f: statistics.median(g[group][f] for g in logs) for f in ("count", "seconds", "bytes")}
                for group in ("data_put", "data_get_large", "data_get_small", "other")}
            s[kind][name]["requests"]["other_ops"] = logs[len(logs) // 2]["other"]["ops"]
    s["all_equal"] = all(r["download"][n]["equal"] for r in runs for n in r["download"])
    # The baseline of each target: the direct call that does what nebulite's client does
    # (parallel parts / parallel ranges); the other direct figures are shown beside it.
    up_base = res["upload_baselines"][-1] if res["store"] == "gs" else res["upload_baselines"][0]
    down_base = res["download_baselines"][0]
    s["targets"] = [
        _target("persistence", s["upload"][NEB_PERSIST]["mib_s"], up_base, s["upload"][up_base]["mib_s"]),
        _target("load", s["download"][NEB_LOAD]["mib_s"], down_base, s["download"][down_base]["mib_s"]),
    ]
    return s


def _target(what: str, value: float, base: str, base_value: float) -> dict[str, Any]:
    ratio = value / base_value
    return {"target": f"{what} >= {TARGET:.0%} of direct", "baseline": base, "ratio": ratio,
            "met": ratio >= TARGET}


def report(res: dict[str, Any], s: dict[str, Any], tuning: StoreTuning) -> list[str]:
    reps = len(res["runs"])
    lines = [
        f"{res['store']}:// through {res['emulator']} at {res['endpoint']}: a float32 tensor of "
        f"{s['state_bytes'] / MiB:.0f} MiB (nebulite's data file {s['data_file_bytes'] / MiB:.2f} MiB); "
        f"part {tuning.part_bytes // MiB} MiB, concurrency {tuning.concurrency}; median of {reps}",
        f"  {'upload / persistence':76s} {'MiB/s':>8s} {'s':>8s} {'nebulite':>9s} {'peak RSS +MiB':>14s}",
    ]
    neb = s["upload"][NEB_PERSIST]
    up_base = s["targets"][0]["baseline"]
    for name in res["upload_baselines"]:
        u = s["upload"][name]
        mark = " (baseline)" if name == up_base else ""
        lines.append(f"    {'direct ' + name + mark:74s} {u['mib_s']:8.1f} {u['seconds']:8.3f} "
                     f"{neb['mib_s'] / u['mib_s']:8.0%} {u['rss_increase'] / MiB:14.0f}")
    lines.append(f"    {NEB_PERSIST:74s} {neb['mib_s']:8.1f} {neb['seconds']:8.3f} {'':9s} "
                 f"{neb['rss_increase'] / MiB:14.0f}")
    lines.append(f"      {'of which save() blocking (staging into the memory tier)':72s} {'':8s} {neb['save_s']:8.3f}")
    lines += _request_lines(neb.get("requests"), persist=True)
    lines.append(f"  {'download / load':76s} {'MiB/s':>8s} {'s':>8s} {'nebulite':>9s}")
    neb = s["download"][NEB_LOAD]
    down_base = s["targets"][1]["baseline"]
    for name in res["download_baselines"]:
        d = s["download"][name]
        mark = " (baseline)" if name == down_base else ""
        lines.append(f"    {'direct ' + name + mark:74s} {d['mib_s']:8.1f} {d['seconds']:8.3f} "
                     f"{neb['mib_s'] / d['mib_s']:8.0%}")
    lines.append(f"    {NEB_LOAD + ' (fresh session)':74s} {neb['mib_s']:8.1f} {neb['seconds']:8.3f}")
    lines.append(f"      {'of which get_checkpoint (reads and checks the data file)':72s} {'':8s} "
                 f"{neb['get_checkpoint_s']:8.3f}")
    lines.append(f"      {'of which load() (unpickling the buffers read)':72s} {'':8s} {neb['load_s']:8.3f}")
    lines += _request_lines(neb.get("requests"), persist=False)
    lines.append(f"  every download and load returned the saved bytes: {'yes' if s['all_equal'] else 'NO'}")
    lines.append("  targets (same run)")
    for t in s["targets"]:
        lines.append(f"    {t['target'] + ' (' + t['baseline'] + ')':98s} {t['ratio']:5.0%} "
                     f"{'MET' if t['met'] else 'MISSED'}")
    return lines


def _request_lines(req: dict[str, Any] | None, persist: bool) -> list[str]:
    """nebulite's requests (medians over the reps): on the data file, and all the others."""
    if not req:
        return []
    lines = []

    def row(text: str, seconds: float) -> None:
        lines.append(f"      {text:72s} {'':8s} {seconds:8.3f}")

    other = req["other"]
    ops = ", ".join(f"{n} {op}" for op, n in sorted(req["other_ops"].items()))
    big, small = req["data_get_large"], req["data_get_small"]
    if persist:
        row(f"data file upload ({req['data_put']['count']:.0f} put)", req["data_put"]["seconds"])
        if big["count"] or small["count"]:
            row(f"data file read back: {big['count'] + small['count']:.0f} GETs, "
                f"{(big['bytes'] + small['bytes']) / MiB:.0f} MiB", big["seconds"] + small["seconds"])
        row(f"other requests: {other['count']:.0f} ({ops})", other["seconds"])
    else:
        row(f"data file GETs >= 1 MiB: {big['count']:.0f}, {big['bytes'] / MiB:.0f} MiB (time summed over threads)",
            big["seconds"])
        row(f"data file GETs < 1 MiB: {small['count']:.0f}, {small['bytes'] / 1024:.0f} KiB (summed)",
            small["seconds"])
        row(f"other requests: {other['count']:.0f} ({ops})", other["seconds"])
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stores", default=",".join(STORES), help="comma-separated: az, s3, gs")
    ap.add_argument("--mb", type=int, default=256, help="MiB of state (default 256)")
    ap.add_argument("--reps", type=int, default=6,
                    help="repetitions per candidate (default 6: as often first as second)")
    ap.add_argument("--smoke", action="store_true", help="8 MiB, 1 rep")
    ap.add_argument("--out", default=str(HERE / "results"), help="where the JSON goes")
    ap.add_argument("--quiet", action="store_true", help="no line per timed run")
    ap.add_argument("--no-request-log", action="store_true",
                    help="leave nebulite's store clients unwrapped (no request breakdown)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.mb, args.reps = 8, 1
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    bad = [s for s in stores if s not in STORES]
    if bad or not stores or args.mb < 1 or args.reps < 1:
        ap.error(f"--stores takes {', '.join(STORES)}; --mb and --reps at least 1")
    tuning = StoreTuning.from_env()
    if not args.no_request_log:
        REQUESTS.install()

    def log(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    started = datetime.datetime.now()
    header = (f"object stores, {started:%Y-%m-%d %H:%M}: nebulite {getattr(nebulite, '__version__', '?')}, "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
              f"load average {os.getloadavg()[0]:.1f} at the start")
    print(header, flush=True)
    results, lines = [], [header]
    for scheme in stores:
        log(f"{scheme}: starting {EMULATOR_NAMES[scheme]}")
        res = run_store(scheme, args.mb, args.reps, tuning, log)
        res["summary"] = summarize(res)
        results.append(res)
        block = report(res, res["summary"], tuning)
        print("\n".join(block), flush=True)
        lines += block
    missed = sum(not t["met"] for r in results for t in r["summary"]["targets"])
    tail = (f"load average {os.getloadavg()[0]:.1f} at the end; "
            + ("every target MET" if not missed else f"{missed} target check(s) MISSED"))
    print(tail)
    lines.append(tail)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = f"object-stores-{started:%Y%m%d-%H%M%S}"
    doc = {"started": started.isoformat(), "args": vars(args), "tuning": dataclasses.asdict(tuning),
           "stores": results,
           "report": lines}
    for name in (stamp, "object-stores-latest"):
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{name}.txt").write_text("\n".join(lines) + "\n")
    print(f"results: {out / stamp}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
