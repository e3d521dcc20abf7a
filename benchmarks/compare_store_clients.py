"""Object-store client libraries compared on the emulators the tests use.

For each emulator (Azurite, moto's S3 server, gcp-storage-emulator) and each client library
installed in this interpreter (the others are skipped, and the table says so), one object
of --mb MiB of random bytes is

* uploaded in one call, with the library's parallel or multipart upload: parts of 16 MiB,
  8 in flight, where the library takes these settings;
* downloaded into memory with the library's parallel ranged reads (16 MiB ranges, 8 in
  flight: its own concurrent read where it has one, else 8 threads), each range copied into
  one buffer of the object's size, as the storage driver copies what a get returns;
* uploaded again while a pure-Python thread counts as fast as it can, to see whether the
  GIL is held while the bytes move.

Reported per client (the median of --reps runs, each in a fresh process, so that no run
inherits another's allocator state or connections):

* upload and download throughput, MB/s (10^6 bytes per second);
* peak extra RSS during the upload: the process's resident size above what it was right
  before the call (the object itself is already resident), the larger of a psutil sampler
  (every 5 ms) and the kernel's high-water mark (VmHWM, reset through /proc/self/clear_refs);
  a zero-copy client needs about nothing, one that copies each part in flight about
  parts x concurrency, one that copies the object its size or more;
* the counting thread's rate during the upload, as a percentage of its rate on its own
  (1 s, main thread asleep): near 100% when the client releases the GIL while bytes move,
  far less when it holds it. The emulator shares the CPUs, so on a small machine even a
  client that never holds the GIL does not reach 100%.

The object is handed over as a memoryview (as the storage driver does) where the library
accepts one. Nothing is written but the table; every emulator is stopped and its temporary
directory removed at the end, whatever happens.

Candidates (module needed): obstore; pyarrow.fs (pyarrow); fsspec's s3fs, adlfs and gcsfs;
google-cloud-storage (GCS); azure-storage-blob and boto3, the vendors' SDKs, for reference.
They need not be in the project's environment; a separate one works, e.g.

    python3 -m venv /tmp/cmpvenv
    /tmp/cmpvenv/bin/pip install obstore google-cloud-storage pyarrow s3fs adlfs gcsfs \\
        psutil boto3 azure-storage-blob
    /tmp/cmpvenv/bin/python benchmarks/compare_store_clients.py [--mb 256] [--reps 3]

The emulators' programs (moto_server, gcp-storage-emulator) are looked up beside this
interpreter, then in the checkout's .venv/bin (--bin-dir overrides); Azurite where
tests/object_stores.py finds it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
PART = 16 * MIB
CONCURRENCY = 8

# (store, client, modules it needs); the order of the table.
CANDIDATES = [
    ("az", "obstore", ["obstore"]),
    ("az", "pyarrow.fs", ["pyarrow"]),
    ("az", "adlfs (fsspec)", ["adlfs"]),
    ("az", "azure-storage-blob", ["azure.storage.blob"]),
    ("s3", "obstore", ["obstore"]),
    ("s3", "pyarrow.fs", ["pyarrow"]),
    ("s3", "s3fs (fsspec)", ["s3fs"]),
    ("s3", "boto3", ["boto3"]),
    ("gs", "obstore", ["obstore"]),
    ("gs", "pyarrow.fs", ["pyarrow"]),
    ("gs", "gcsfs (fsspec)", ["gcsfs"]),
    ("gs", "google-cloud-storage", ["google.cloud.storage"]),
]
EMULATOR_NAMES = {"az": "Azurite", "s3": "moto (S3)", "gs": "gcp-storage-emulator"}


# --- the clients (run in the child process) ----------------------------------------------
#
# Each adapter has put(key, view), get(key, size) -> bytearray, delete(key) and `notes`
# (how its upload is parallel). Keys are relative to a fresh prefix.


def _ranges(size: int) -> list[tuple[int, int]]:
    return [(s, min(s + PART, size)) for s in range(0, size, PART)]


def _threaded_get(size: int, read_range) -> bytearray:
    """8 threads, each reading 16 MiB ranges with read_range(start, end) -> buffer, copied
    into one buffer of the object's size."""
    out = bytearray(size)
    view = memoryview(out)

    def one(r):
        got = read_range(*r)
        view[r[0] : r[1]] = memoryview(got).cast("B")

    with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(one, _ranges(size)))
    view.release()
    return out


def _cat_ranges_get(fs, path: str, size: int) -> bytearray:
    """fsspec's own concurrent ranged read (one event loop, all ranges at once)."""
    rs = _ranges(size)
    parts = fs.cat_ranges([path] * len(rs), [a for a, _ in rs], [b for _, b in rs])
    out = bytearray(size)
    view = memoryview(out)
    for (a, b), got in zip(rs, parts):
        view[a:b] = got
    view.release()
    return out


class ObstoreClient:
    notes = "multipart, 16 MiB x 8"

    def __init__(self, spec: dict) -> None:
        import obstore
        from obstore.store import AzureStore, GCSStore, S3Store

        self.ob = obstore
        opts = {"allow_http": True, "timeout": "300s"}
        if spec["store"] == "az":
            self.store = AzureStore(
                spec["container"],
                account_name=spec["account"],
                account_key=spec["key"],
                endpoint=spec["endpoint"],
                client_options=opts,
            )
        elif spec["store"] == "s3":
            self.store = S3Store(
                spec["container"],
                endpoint=spec["endpoint"],
                access_key_id="testing",
                secret_access_key="testing",
                region="us-east-1",
                client_options=opts,
            )
        else:
            # object_store's way to a GCS emulator: a service-account key naming the base
            # URL, without OAuth. Its GCS client speaks the XML API.
            key = {"gcs_base_url": spec["endpoint"], "disable_oauth": True,
                   "client_email": "", "private_key": "", "private_key_id": ""}
            self.store = GCSStore(spec["container"], service_account_key=json.dumps(key),
                                  client_options=opts)
        self.prefix = spec["prefix"]

    def put(self, key: str, view: memoryview) -> None:
        self.ob.put(self.store, f"{self.prefix}/{key}", view, chunk_size=PART,
                    max_concurrency=CONCURRENCY)

    def get(self, key: str, size: int) -> bytearray:
        path = f"{self.prefix}/{key}"
        return _threaded_get(size, lambda a, b: self.ob.get_range(self.store, path, start=a, end=b))

    def delete(self, key: str) -> None:
        self.ob.delete(self.store, f"{self.prefix}/{key}")


class PyarrowClient:
    notes = "output stream (the library's part size; 8 io threads)"

    def __init__(self, spec: dict) -> None:
        import pyarrow
        from pyarrow import fs

        pyarrow.set_io_thread_count(CONCURRENCY)
        host = spec["endpoint"].split("://", 1)[1].split("/", 1)[0]
        if spec["store"] == "az":
            self.fs = fs.AzureFileSystem(
                account_name=spec["account"],
                account_key=spec["key"],
                blob_storage_authority=host,
                blob_storage_scheme="http",
                dfs_storage_authority=host,
                dfs_storage_scheme="http",
            )
        elif spec["store"] == "s3":
            self.fs = fs.S3FileSystem(
                access_key="testing",
                secret_key="testing",
                region="us-east-1",
                endpoint_override=host,
                scheme="http",
            )
        else:
            self.fs = fs.GcsFileSystem(anonymous=True, endpoint_override=host, scheme="http")
        # Its ranged reads never return from gcp-storage-emulator (a whole-object read
        # does): on GCS it reads the object as one stream.
        self.sequential_get = spec["store"] == "gs"
        if self.sequential_get:
            self.notes += "; download: one stream"
        self.root = f"{spec['container']}/{spec['prefix']}"

    def put(self, key: str, view: memoryview) -> None:
        with self.fs.open_output_stream(f"{self.root}/{key}") as out:
            out.write(view)

    def get(self, key: str, size: int) -> bytearray:
        path = f"{self.root}/{key}"
        if self.sequential_get:
            with self.fs.open_input_stream(path) as f:
                return bytearray(f.read())
        with self.fs.open_input_file(path) as f:
            return _threaded_get(size, lambda a, b: f.read_at(b - a, a))

    def delete(self, key: str) -> None:
        self.fs.delete_file(f"{self.root}/{key}")


class FsspecClient:
    def __init__(self, spec: dict) -> None:
        import inspect

        if spec["store"] == "az":
            import adlfs

            self.fs = adlfs.AzureBlobFileSystem(connection_string=spec["connection_string"])
        elif spec["store"] == "s3":
            import s3fs

            self.fs = s3fs.S3FileSystem(
                key="testing",
                secret="testing",
                client_kwargs={"endpoint_url": spec["endpoint"], "region_name": "us-east-1"},
            )
        else:
            # gcsfs.GCSFileSystem first asks each bucket's layout over gRPC, which the
            # emulator does not serve (60 s per call); the JSON-API filesystem underneath
            # is what talks to GCS either way for a plain bucket.
            from gcsfs.core import GCSFileSystem

            self.fs = GCSFileSystem(token="anon", endpoint_url=spec["endpoint"],
                                          project="test")
        self.root = f"{spec['container']}/{spec['prefix']}"
        # pipe_file's keywords differ between the implementations: pass what each takes.
        params = inspect.signature(self.fs._pipe_file).parameters
        self.kwargs = {}
        if "chunksize" in params:
            self.kwargs["chunksize"] = PART
        if "max_concurrency" in params:
            self.kwargs["max_concurrency"] = CONCURRENCY
        shown = [f"{k}={v >> 20} MiB" if k == "chunksize" else f"{k}={v}"
                 for k, v in self.kwargs.items()]
        self.notes = "pipe_file(" + ", ".join(shown) + ")"
        # s3fs and adlfs (the Azure SDK underneath) refuse a memoryview.
        self.takes_bytes = spec["store"] in ("az", "s3")

    def put(self, key: str, data) -> None:
        self.fs.pipe_file(f"{self.root}/{key}", data, **self.kwargs)

    def get(self, key: str, size: int) -> bytearray:
        return _cat_ranges_get(self.fs, f"{self.root}/{key}", size)

    def delete(self, key: str) -> None:
        self.fs.rm_file(f"{self.root}/{key}")


class ViewReader:
    """A file over a memoryview; read() returns bytes copies (HTTP libraries send what
    they read)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = bytes(self.view[self.pos : end])
        self.pos = end
        return out

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: len(self.view)}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.view = memoryview(b"")


class ViewWriter:
    """A seekable file writing into a preallocated buffer (the SDK's parallel download
    seeks to each chunk's place)."""

    def __init__(self, buf: bytearray) -> None:
        self.view, self.pos = memoryview(buf), 0

    def write(self, b) -> int:
        n = len(b)
        self.view[self.pos : self.pos + n] = b
        self.pos += n
        return n

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: len(self.view)}[whence] + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True


class GcsSdkClient:
    """google-cloud-storage (JSON API) with a parallel composite upload, as nebulite's gs://
    client does: 16 MiB parts uploaded 8 at a time as temporary objects, then one compose."""

    notes = "parallel composite, 16 MiB x 8"

    def __init__(self, spec: dict) -> None:
        import requests.adapters
        from google.cloud import storage

        self.client = storage.Client(project="test")
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=4 * CONCURRENCY)
        self.client._http.mount("http://", adapter)
        self.bucket = self.client.bucket(spec["container"])
        self.prefix = spec["prefix"]

    def put(self, key: str, view: memoryview) -> None:
        name = f"{self.prefix}/{key}"
        rs = _ranges(len(view))
        if len(rs) > 32:
            raise ValueError("more than 32 parts: compose in several levels (not needed here)")
        parts = [f"{self.prefix}/.{key}.part-{k}" for k in range(len(rs))]

        def one(k: int) -> None:
            a, b = rs[k]
            self.bucket.blob(parts[k]).upload_from_file(ViewReader(view[a:b]), size=b - a)

        try:
            with cf.ThreadPoolExecutor(CONCURRENCY) as pool:
                list(pool.map(one, range(len(rs))))
            self.bucket.blob(name).compose([self.bucket.blob(p) for p in parts])
        finally:
            for p in parts:
                try:
                    self.bucket.blob(p).delete()
                except Exception:
                    pass  # never written

    def get(self, key: str, size: int) -> bytearray:
        blob = self.bucket.blob(f"{self.prefix}/{key}")
        return _threaded_get(size, lambda a, b: blob.download_as_bytes(
            start=a, end=b - 1, raw_download=True, checksum=None))

    def delete(self, key: str) -> None:
        self.bucket.blob(f"{self.prefix}/{key}").delete()


class AzureSdkClient:
    notes = "upload_blob, 16 MiB blocks x 8"

    def __init__(self, spec: dict) -> None:
        from azure.storage.blob import BlobServiceClient

        svc = BlobServiceClient.from_connection_string(
            spec["connection_string"], max_block_size=PART, max_single_put_size=PART,
            max_chunk_get_size=PART, max_single_get_size=PART)
        self.container = svc.get_container_client(spec["container"])
        self.prefix = spec["prefix"]

    takes_bytes = True  # it refuses a memoryview

    def put(self, key: str, data) -> None:
        self.container.upload_blob(f"{self.prefix}/{key}", data, overwrite=True,
                                   max_concurrency=CONCURRENCY)

    def get(self, key: str, size: int) -> bytearray:
        out = bytearray(size)
        self.container.download_blob(f"{self.prefix}/{key}",
                                     max_concurrency=CONCURRENCY).readinto(ViewWriter(out))
        return out

    def delete(self, key: str) -> None:
        self.container.delete_blob(f"{self.prefix}/{key}")


class Boto3Client:
    notes = "upload_fileobj, 16 MiB parts x 8"

    def __init__(self, spec: dict) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.s3 = boto3.client("s3", endpoint_url=spec["endpoint"], aws_access_key_id="testing",
                               aws_secret_access_key="testing", region_name="us-east-1")
        self.config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART,
                                     max_concurrency=CONCURRENCY)
        self.bucket, self.prefix = spec["container"], spec["prefix"]

    def put(self, key: str, view: memoryview) -> None:
        self.s3.upload_fileobj(ViewReader(view), self.bucket, f"{self.prefix}/{key}",
                               Config=self.config)

    def get(self, key: str, size: int) -> bytearray:
        k = f"{self.prefix}/{key}"
        return _threaded_get(size, lambda a, b: self.s3.get_object(
            Bucket=self.bucket, Key=k, Range=f"bytes={a}-{b - 1}")["Body"].read())

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")


def make_client(spec: dict):
    store, name = spec["store"], spec["client"]
    if name == "obstore":
        return ObstoreClient(spec)
    if name == "pyarrow.fs":
        return PyarrowClient(spec)
    if name.endswith("(fsspec)"):
        return FsspecClient(spec)
    if name == "google-cloud-storage":
        return GcsSdkClient(spec)
    if name == "azure-storage-blob":
        return AzureSdkClient(spec)
    if name == "boto3":
        return Boto3Client(spec)
    raise ValueError(f"no client {name!r} for {store}")


# --- one run (the child process) ---------------------------------------------------------


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _schedstat() -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable waiting for a CPU) of the calling thread, if the kernel
    keeps them."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return None


class Counter:
    """A pure-Python thread that counts while it runs. It never blocks by itself, so the
    time it was neither on a CPU nor waiting for one it spent waiting for the GIL."""

    def __init__(self) -> None:
        self.running = True
        self.count = 0
        self.blocked = None  # fraction of its time blocked (waiting for the GIL)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        s0, t0 = _schedstat(), time.perf_counter_ns()
        n = 0
        while self.running:
            n += 1
        s1, t1 = _schedstat(), time.perf_counter_ns()
        self.count = n
        if s0 and s1:
            wall = t1 - t0
            self.blocked = max(0, wall - (s1[0] - s0[0]) - (s1[1] - s0[1])) / wall

    def __enter__(self) -> "Counter":
        self.start = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.rate = self.count / (time.perf_counter() - self.start)


class PeakSampler:
    def __init__(self) -> None:
        self.running = True
        self.peak = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __enter__(self) -> "PeakSampler":
        self.peak = _rss()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, _rss())


def child(spec: dict) -> dict:
    size = spec["mb"] * MIB
    rng = random.Random(spec["seed"])
    data = b"".join(rng.randbytes(min(PART, size - s)) for s in range(0, size, PART))
    client = make_client(spec)
    takes_bytes = getattr(client, "takes_bytes", False)
    payload = data if takes_bytes else memoryview(data)
    warm = os.urandom(MIB)  # connections, lazy imports, the container's first use
    client.put("warm", warm if takes_bytes else memoryview(warm))
    client.get("warm", len(warm))
    client.delete("warm")

    with Counter() as idle_before:
        time.sleep(1.0)

    base = _rss()
    hwm_ok = _reset_hwm()
    with PeakSampler() as sampler:
        t0 = time.perf_counter()
        client.put("object", payload)
        t_up = time.perf_counter() - t0
    peak = max(sampler.peak, _hwm() if hwm_ok else 0)

    t0 = time.perf_counter()
    got = client.get("object", size)
    t_down = time.perf_counter() - t0
    if got != data:
        raise RuntimeError("the object read back differs from the one written")
    del got

    with Counter() as busy:
        client.put("object-2", payload)
    with Counter() as idle_after:
        time.sleep(1.0)
    idle = (idle_before.rate + idle_after.rate) / 2
    for key in ("object", "object-2"):
        client.delete(key)
    return {
        "upload_MBps": size / t_up / 1e6,
        "download_MBps": size / t_down / 1e6,
        "rss_MiB": max(0, peak - base) / MIB,
        "counter_pct": 100.0 * busy.rate / idle,
        "gil_wait_pct": 100.0 * busy.blocked if busy.blocked is not None else float("nan"),
        "notes": client.notes + (" (bytes)" if takes_bytes else ""),
    }


# --- the parent: emulators, runs, the table ----------------------------------------------


def _object_stores(bin_dir: Path | None):
    """tests/object_stores.py, with its programs found where they are installed."""
    sys.path.insert(0, str(REPO / "tests"))
    if importlib.util.find_spec("pytest") is None:
        # The module declares pytest fixtures at import; outside a test environment a
        # stand-in decorator suffices (nothing here uses the fixtures).
        stub = types.ModuleType("pytest")
        stub.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
        sys.modules["pytest"] = stub
    import object_stores

    candidates = [bin_dir] if bin_dir else [Path(sys.executable).parent, REPO / ".venv" / "bin"]
    for d in candidates:
        if (d / "moto_server").exists() and (d / "gcp-storage-emulator").exists():
            object_stores.BIN = d  # the module looks its programs up in BIN when it starts one
            break
    return object_stores


def _spec(store: str, client: str, emu, object_stores, mb: int, seed: int) -> dict:
    spec = {"store": store, "client": client, "mb": mb, "seed": seed,
            "container": emu.container, "prefix": f"cmp-{uuid.uuid4().hex[:12]}",
            "endpoint": emu.endpoint}
    if store == "az":
        spec.update(account=object_stores.AZURITE_ACCOUNT, key=object_stores.AZURITE_KEY,
                    connection_string=emu.connection_string(emu.endpoint))
    return spec


def run_child(spec: dict, env: dict, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1]
    return {"error": tail}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _short_error(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 110 else text[:107] + "..."


def _versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("obstore", "pyarrow", "fsspec", "s3fs", "adlfs", "gcsfs",
                 "google-cloud-storage", "azure-storage-blob", "boto3"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="object size in MiB (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="runs per client; the median is shown")
    ap.add_argument("--stores", default="az,s3,gs", help="comma-separated: az, s3, gs")
    ap.add_argument("--bin-dir", type=Path, help="where moto_server and gcp-storage-emulator are")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds per run before it is killed (default 300)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            print(json.dumps(child(json.loads(args.child))), flush=True)
        except Exception as e:
            text = " ".join(str(e).split())
            status = re.search(r"status: (\d{3})", text)  # obstore's nested report
            if status:
                text = text.split(" Caused by:")[0].split(" Debug source:")[0]
                text = f"HTTP {status.group(1)}: {text}"
            print(json.dumps({"error": f"{type(e).__name__}: {text}"}), flush=True)
        return
    # A SIGTERM ends the run through the finally clauses below (emulators stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    object_stores = _object_stores(args.bin_dir)
    stores = [s for s in args.stores.split(",") if s]
    load0 = os.getloadavg()
    t_start = time.monotonic()
    rows: list[tuple[str, str, dict]] = []
    for store in stores:
        todo = [(c, mods) for s, c, mods in CANDIDATES if s == store]
        emu = None
        try:
            for client, mods in todo:
                missing = [m for m in mods if not _installed(m)]
                if missing:
                    why = "not installed (" + ", ".join(missing) + ")"
                    rows.append((store, client, {"skip": why}))
                    continue
                if emu is None:
                    emu = object_stores.STARTERS[store]()
                env = object_stores._clean_env()
                env.update(emu.env)
                runs = []
                for rep in range(args.reps):
                    spec = _spec(store, client, emu, object_stores, args.mb, seed=rep)
                    try:
                        r = run_child(spec, env, args.timeout)
                    except subprocess.TimeoutExpired:
                        r = {"error": f"no answer within {args.timeout:.0f} s"}
                    print(f"  {EMULATOR_NAMES[store]:<21} {client:<21} run {rep + 1}: "
                          + (r["error"] if "error" in r else
                             f"up {r['upload_MBps']:.0f} MB/s, down {r['download_MBps']:.0f} MB/s, "
                             f"+{r['rss_MiB']:.0f} MiB, counter {r['counter_pct']:.0f}%, "
                             f"GIL wait {r['gil_wait_pct']:.0f}%"),
                          file=sys.stderr, flush=True)
                    runs.append(r)
                    if "error" in r:
                        break  # a client that cannot talk to this emulator fails every run
                ok = [r for r in runs if "error" not in r]
                if not ok:
                    rows.append((store, client, {"error": _short_error(runs[-1]["error"])}))
                    continue
                med = {k: statistics.median(r[k] for r in ok)
                       for k in ("upload_MBps", "download_MBps", "rss_MiB", "counter_pct",
                                 "gil_wait_pct")}
                med["notes"] = ok[0]["notes"]
                med["runs"] = len(ok)
                rows.append((store, client, med))
        finally:
            if emu is not None:
                emu.stop()

    load1 = os.getloadavg()
    print(f"object-store clients on the emulators: one object of {args.mb} MiB of random bytes, "
          f"median of {args.reps} runs (each in a fresh process)")
    print(f"  {os.cpu_count()} CPUs ({platform.machine()}), shared with the emulator; load average "
          f"{load0[0]:.1f} at the start, {load1[0]:.1f} at the end; "
          f"{time.monotonic() - t_start:.0f} s; Python {platform.python_version()}")
    print(f"  {_versions()}")
    print()
    print(f"{'emulator':<21} {'client':<21} {'upload':>7} {'download':>9} {'peak extra RSS':>15} "
          f"{'counter thread':>15} {'GIL wait':>9}  upload call")
    print(f"{'':<21} {'':<21} {'MB/s':>7} {'MB/s':>9} {'in upload, MiB':>15} "
          f"{'% of idle (1)':>15} {'(2)':>9}")
    for store, client, r in rows:
        name = EMULATOR_NAMES[store]
        if "skip" in r or "error" in r:
            what = "skipped: " + r["skip"] if "skip" in r else "failed: " + r["error"]
            print(f"{name:<21} {client:<21} {what}")
            continue
        print(f"{name:<21} {client:<21} {r['upload_MBps']:>7.0f} {r['download_MBps']:>9.0f} "
              f"{r['rss_MiB']:>15.0f} {r['counter_pct']:>14.0f}% {r['gil_wait_pct']:>8.0f}%  "
              f"{r['notes']}")
    print("(1) a pure-Python counting thread's rate during a second upload, as a percentage of "
          "its rate alone (CPUs taken by the client and the emulator lower it too)")
    print("(2) the share of that upload the counting thread spent neither on a CPU nor waiting "
          "for one (/proc/thread-self/schedstat): waiting for the GIL")

if __name__ == "__main__":
    main()
