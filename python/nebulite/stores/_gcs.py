"""Google Cloud Storage client on google-cloud-storage (the JSON API).

obstore's GCS client speaks the XML API, which gcp-storage-emulator does not serve, so
gs:// goes through the official SDK instead: it honours ``STORAGE_EMULATOR_HOST`` (then
anonymous credentials) and otherwise google.auth's default chain
(``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application-default credentials, the GCE/GKE
metadata server). ``GOOGLE_CLOUD_PROJECT`` is passed on where set; object operations need
no project.

Upload protocol (objects of more than one part are a parallel composite upload):

1. With ``if_absent``, a metadata read fails fast where the key exists (gcp-storage-emulator
   ignores preconditions, so this is what refuses there; on GCS the generation-0
   precondition of step 4 decides races).
2. Each part of ``NEBULITE_STORE_PART_BYTES`` is uploaded, ``NEBULITE_STORE_CONCURRENCY`` at
   a time, from views of the caller's memory (read a request's worth at a time), to a
   hidden temporary object next to the key: ``<dir>/.<name>.part-<k>-<random>``.
3. While more than 32 objects remain (compose's limit), groups of 32 are composed into
   hidden intermediate objects.
4. The last compose writes the key (``ifGenerationMatch=0`` when ``if_absent``): the object
   appears whole or not at all.
5. The temporary objects are deleted, after success and after failure alike.

The etag of an object is its generation; a ranged read with an etag is made with
``ifGenerationMatch`` (gcp-storage-emulator ignores it too).

Thread-safety: a client may be used from several threads at once (one requests session
with a connection pool sized for the concurrency).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import uuid
from datetime import datetime
from typing import Callable, Sequence

from nebulite.errors import StorageError, StoragePermissionError
from nebulite.stores import ObjectChangedError, ObjectStoreError, StoreTuning, check_version
from nebulite.stores._obstore import mtime_ns
from nebulite.stores._views import ByteViews

_COMPOSE_MAX = 32


class _Collector:
    """A write-only file that keeps what the download writes; a single write (the usual
    single-shot download) is returned as is, without a copy."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, b) -> int:
        self.chunks.append(b)
        return len(b)

    def value(self):
        if len(self.chunks) == 1:
            return self.chunks[0]
        return b"".join(self.chunks)


class GcsClient:
    def __init__(self, url: str, bucket: str, prefix: str, tuning: StoreTuning) -> None:
        import requests.adapters
        from google.api_core import exceptions as gex
        from google.cloud import storage
        from google.cloud.storage.retry import _should_retry

        self.url = url.rstrip("/")
        self._tuning = tuning
        self._gex = gex
        self._should_retry = _should_retry
        self._prefix = prefix + "/" if prefix else ""
        try:
            self._client = storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT"))
        except Exception as e:  # no default credentials, a bad credentials file
            raise ObjectStoreError(f"cannot open {self.url}: {e}") from e
        adapter = requests.adapters.HTTPAdapter(
            pool_connections=4, pool_maxsize=max(32, 4 * tuning.concurrency)
        )
        self._client._http.mount("https://", adapter)
        self._client._http.mount("http://", adapter)
        # google-cloud-storage (3.17 and later) fetches a bucket's metadata on a thread of
        # its own at the client's first call, for tracing attributes that nebulite does
        # not use. That is one more request per bucket, it needs storage.buckets.get, and
        # it runs alongside the calls made through this client.
        if getattr(self._client, "_bucket_metadata_cache", None) is not None:
            self._client._bucket_metadata_cache = None
        self._bucket = self._client.bucket(bucket)

    # --- helpers -------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return self._prefix + key

    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _retry(self):
        """A retry policy for one call: transient errors, at most max_retries times and
        within retry_seconds of the first attempt, exponential backoff with jitter."""
        from google.api_core.retry import Retry

        attempts = [0]
        limit = self._tuning.max_retries

        def transient(exc: Exception) -> bool:
            if not self._should_retry(exc):
                return False
            attempts[0] += 1
            return attempts[0] <= limit

        return Retry(
            predicate=transient,
            initial=0.1,
            maximum=15.0,
            multiplier=2.0,
            timeout=self._tuning.retry_seconds,
        )

    def _error(self, e: BaseException, op: str, key: str, precondition=None) -> BaseException:
        gex = self._gex
        where = self._where(key)
        if isinstance(e, (FileNotFoundError, FileExistsError, StorageError)):
            return e
        if isinstance(e, gex.NotFound):
            return FileNotFoundError(f"{where}: no such object")
        if isinstance(e, gex.PreconditionFailed) and precondition is not None:
            return precondition(f"{where}: " + ("already exists" if precondition is FileExistsError else f"the object changed since it was read ({op})"))
        if isinstance(e, (gex.Forbidden, gex.Unauthorized)):
            return StoragePermissionError(f"{op} {where}: {e}")
        text = str(e)
        if len(text) > 1500:
            text = text[:1500] + "..."
        return ObjectStoreError(f"{op} {where}: {type(e).__name__}: {text}")

    def _call(self, op: str, key: str, fn: Callable, precondition=None):
        try:
            return fn()
        except Exception as e:
            raise self._error(e, op, key, precondition) from e

    # --- put -----------------------------------------------------------------------------
    def put(self, key: str, data: Sequence[memoryview], if_absent: bool) -> None:
        name = self._name(key)
        gen = 0 if if_absent else None
        with ByteViews(data) as views:
            # A library may keep this frame alive (a caught exception's traceback reaches it
            # through f_back): then it must not hold the caller's views.
            del data
            if if_absent and self._call("put", key, lambda: self._bucket.get_blob(name, retry=self._retry())):
                raise FileExistsError(f"{self._where(key)}: already exists")
            if views.size <= self._tuning.part_bytes:
                self._call("put", key, lambda: self._upload(name, views, 0, views.size, gen), FileExistsError)
                return
            self._composite_put(key, name, views, gen)

    def _upload(self, name: str, views: ByteViews, start: int, end: int, gen) -> None:
        blob = self._bucket.blob(name)
        reader = views.reader(start, end)
        try:
            blob.upload_from_file(
                reader,
                size=end - start,
                if_generation_match=gen,
                content_type="application/octet-stream",
                retry=self._retry(),
            )
        finally:
            reader.close()

    def _composite_put(self, key: str, name: str, views: ByteViews, gen) -> None:
        t = self._tuning
        head, _, base = name.rpartition("/")
        stem = f"{head}/" * bool(head) + f".{base}"
        tag = uuid.uuid4().hex[:12]
        bounds = [(s, min(s + t.part_bytes, views.size)) for s in range(0, views.size, t.part_bytes)]
        temps: list[str] = []
        try:
            with cf.ThreadPoolExecutor(max_workers=t.concurrency) as pool:
                parts = [f"{stem}.part-{k}-{tag}" for k in range(len(bounds))]
                temps.extend(parts)
                self._all(pool, [lambda p=p, b=b: self._upload(p, views, *b, None) for p, b in zip(parts, bounds)])
                level = 0
                while len(parts) > _COMPOSE_MAX:
                    groups = [parts[i : i + _COMPOSE_MAX] for i in range(0, len(parts), _COMPOSE_MAX)]
                    parts = [f"{stem}.compose-{level}-{i}-{tag}" for i in range(len(groups))]
                    temps.extend(parts)
                    self._all(pool, [lambda d=d, g=g: self._compose(d, g, None) for d, g in zip(parts, groups)])
                    level += 1
                self._compose(name, parts, gen)
        except Exception as e:
            raise self._error(e, "put", key, FileExistsError) from e
        finally:
            self._delete_quietly(temps)

    @staticmethod
    def _all(pool: cf.ThreadPoolExecutor, jobs: list[Callable]) -> None:
        """Runs the jobs; at the first failure cancels those not started, waits for the
        others and raises that failure."""
        futures = [pool.submit(j) for j in jobs]
        done, _ = cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            raise failed.exception()  # type: ignore[misc]

    def _compose(self, dest: str, sources: list[str], gen) -> None:
        blob = self._bucket.blob(dest)
        blob.content_type = "application/octet-stream"
        blob.compose(
            [self._bucket.blob(s) for s in sources],
            if_generation_match=gen,
            retry=self._retry(),
        )

    def _delete_quietly(self, names: list[str]) -> None:
        if not names:
            return

        def drop(n: str) -> None:
            try:
                self._bucket.blob(n).delete(retry=self._retry())
            except Exception:
                pass  # missing (never written) or unreachable: nothing better to do here

        with cf.ThreadPoolExecutor(max_workers=self._tuning.concurrency) as pool:
            list(pool.map(drop, names))

    # --- the rest of the interface -------------------------------------------------------
    def get(self, key: str, offset: int, length: int, etag: str | None):
        if length <= 0:
            check_version(self, key, etag)
            return b""
        out = _Collector()
        blob = self._bucket.blob(self._name(key))

        def download():
            blob.download_to_file(
                out,
                start=offset,
                end=offset + length - 1,
                raw_download=True,
                checksum=None,  # ranged reads carry no checksum
                if_generation_match=int(etag) if etag else None,
                single_shot_download=True,
                retry=self._retry(),
            )

        try:
            download()
        except self._gex.RequestRangeNotSatisfiable:
            size = check_version(self, key, etag)
            if offset >= size:
                return b""
            raise ObjectStoreError(f"get {self._where(key)}: range {offset}+{length} refused")
        except Exception as e:
            raise self._error(e, "get", key, ObjectChangedError) from e
        return out.value()

    def head(self, key: str) -> tuple[int, int, str]:
        blob = self._call("head", key, lambda: self._bucket.get_blob(self._name(key), retry=self._retry()))
        if blob is None:
            raise FileNotFoundError(f"{self._where(key)}: no such object")
        updated: datetime | None = blob.updated
        return int(blob.size or 0), mtime_ns(updated) if updated else 0, str(blob.generation)

    def list(self, prefix: str, recursive: bool) -> tuple[list[tuple[str, int, int]], list[str]]:
        full = self._prefix + prefix
        n = len(self._prefix)

        def run():
            it = self._client.list_blobs(
                self._bucket,
                prefix=full or None,
                delimiter=None if recursive else "/",
                retry=self._retry(),
            )
            objects = [
                (b.name[n:], int(b.size or 0), mtime_ns(b.updated) if b.updated else 0)
                for b in it
            ]
            dirs = [] if recursive else sorted(p[n:].rstrip("/") for p in it.prefixes)
            return objects, dirs

        return self._call("list", prefix, run)

    def copy(self, src: str, dst: str) -> None:
        target = self._bucket.blob(self._name(dst))
        source = self._bucket.blob(self._name(src))

        def run():
            token = None
            while True:  # GCS rewrites large objects in several calls
                token, _, _ = target.rewrite(source, token=token, retry=self._retry())
                if token is None:
                    return

        self._call(f"copy to {self._where(dst)} from", src, run)

    def delete(self, key: str) -> None:
        try:
            self._bucket.blob(self._name(key)).delete(retry=self._retry())
        except self._gex.NotFound:
            pass
        except Exception as e:
            raise self._error(e, "delete", key) from e

    def abort_stale_uploads(self, older_than: float) -> list[str]:
        """Nothing to do: a parallel composite upload's parts are objects below the version
        they belong to, removed with it (and deleted when the upload fails)."""
        return []

