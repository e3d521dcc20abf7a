"""Azure Blob / ADLS Gen2 and S3 clients on obstore (Rust object_store; releases the GIL).

URLs and credentials
--------------------
``az://container/prefix``, ``abfs[s]://container/prefix`` and
``abfs[s]://container@account.dfs.core.windows.net/prefix`` (ADLS Gen2 paths go through the
account's Blob endpoint; the account of an abfs host wins). Credentials, first found wins:

1. ``AZURE_STORAGE_CONNECTION_STRING``: AccountName, AccountKey, SharedAccessSignature,
   BlobEndpoint (an ``http://`` endpoint, e.g. Azurite's, allows plain HTTP),
   DefaultEndpointsProtocol + EndpointSuffix, or UseDevelopmentStorage=true;
2. ``AZURE_STORAGE_ACCOUNT_NAME`` or ``AZURE_STORAGE_ACCOUNT``, with
   ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_KEY`` (or ``..._ACCESS_KEY``), or
   ``AZURE_STORAGE_SAS_TOKEN``;
3. obstore's own chain, from its environment variables: ``AZURE_STORAGE_TOKEN`` (bearer),
   service principal (``AZURE_CLIENT_ID``, ``AZURE_CLIENT_SECRET``, ``AZURE_TENANT_ID``),
   workload identity (``AZURE_FEDERATED_TOKEN_FILE``), the Azure CLI
   (``AZURE_USE_AZURE_CLI``), then managed identity (IMDS); ``AZURE_STORAGE_ENDPOINT``
   overrides the endpoint, ``AZURE_STORAGE_USE_EMULATOR`` targets Azurite's default one.

``s3://bucket/prefix``: obstore's AWS chain: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``,
``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` (``http://`` allows plain HTTP), web identity
(``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``), ECS container credentials, then the
EC2 instance metadata service. obstore does not read ``~/.aws`` profiles: where
``AWS_PROFILE`` is set and no access key is, the credentials come from boto3's session for
that profile (boto3 must then be installed).

Conditional create (``if_absent``): obstore's ``mode="create"`` (S3 ``If-None-Match: *``,
Azure ``If-None-Match: *``) is one request with no multipart, so an object larger than a
part is first uploaded in parallel under a hidden temporary key next to it
(``.<name>.upload-<random>``) and then copied server-side onto the key with a
copy-if-absent the store decides (Azure: ``If-None-Match: *`` on Copy Blob; S3: a
multipart copy completed with ``If-None-Match: *``, hence at most 5 GiB); the temporary
key is deleted either way.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime, timedelta, timezone
from typing import Sequence

import obstore
from obstore import exceptions as obx

from nebulite.errors import StoragePermissionError
from nebulite.stores import ObjectChangedError, ObjectStoreError, StoreTuning, check_version
from nebulite.stores._views import ByteViews

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def mtime_ns(dt: datetime) -> int:
    return (dt - _EPOCH) // timedelta(microseconds=1) * 1000


def _short(e: BaseException) -> str:
    """The store's message without obstore's multi-line debug dump."""
    text = str(e).split("\n\nDebug source:")[0].strip()
    return text if len(text) <= 1500 else text[:1500] + "..."


def parse_connection_string(text: str) -> dict[str, str]:
    """Azure's ``Key=Value;...`` form (a value may contain '='); keys as written."""
    out: dict[str, str] = {}
    for part in text.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key:
            out[key.strip()] = value.strip()
    return out


def _azure_config(account_from_url: str | None) -> tuple[dict, bool]:
    """(AzureStore keyword arguments, allow_http) from the environment; see the module."""
    cfg: dict[str, object] = {}
    allow_http = False
    env = os.environ
    cs = env.get("AZURE_STORAGE_CONNECTION_STRING")
    if cs:
        fields = {k.lower(): v for k, v in parse_connection_string(cs).items()}
        if fields.get("usedevelopmentstorage", "").lower() == "true":
            cfg["use_emulator"] = True
            allow_http = True
        if "accountname" in fields:
            cfg["account_name"] = fields["accountname"]
        if "accountkey" in fields:
            cfg["account_key"] = fields["accountkey"]
        if "sharedaccesssignature" in fields:
            cfg["sas_key"] = fields["sharedaccesssignature"].lstrip("?")
        endpoint = fields.get("blobendpoint")
        if not endpoint and "endpointsuffix" in fields and "accountname" in fields:
            protocol = fields.get("defaultendpointsprotocol", "https")
            endpoint = f"{protocol}://{fields['accountname']}.blob.{fields['endpointsuffix']}"
        if endpoint:
            cfg["endpoint"] = endpoint.rstrip("/")
    else:
        name = env.get("AZURE_STORAGE_ACCOUNT_NAME") or env.get("AZURE_STORAGE_ACCOUNT")
        if name:
            cfg["account_name"] = name
        key = env.get("AZURE_STORAGE_ACCOUNT_KEY") or env.get("AZURE_STORAGE_KEY")
        if key:
            cfg["account_key"] = key
    if account_from_url:
        cfg["account_name"] = account_from_url
    endpoint = cfg.get("endpoint") or env.get("AZURE_STORAGE_ENDPOINT") or env.get("AZURE_ENDPOINT")
    if isinstance(endpoint, str) and endpoint.lower().startswith("http://"):
        allow_http = True
    return cfg, allow_http


def _s3_config() -> tuple[dict, bool]:
    env = os.environ
    cfg: dict[str, object] = {}
    endpoint = next(
        (env[k] for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT") if env.get(k)),
        "",
    )
    if env.get("AWS_PROFILE") and not env.get("AWS_ACCESS_KEY_ID"):
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider

        cfg["credential_provider"] = Boto3CredentialProvider(
            boto3.Session(profile_name=env["AWS_PROFILE"])
        )
    # The conditional copy that makes a large if_absent put atomic (see the module).
    cfg["copy_if_not_exists"] = "multipart"
    return cfg, endpoint.lower().startswith("http://")


def _refused_range(e: BaseException) -> bool:
    """The store (416) or obstore's own check refused the range asked for."""
    text = str(e)
    return any(m in text for m in ("Range Not Satisfiable", "InvalidRange",
                                   "Wanted range starting at"))


class ObstoreClient:
    """One store URL; thread-safe (obstore stores are)."""

    def __init__(
        self, url: str, scheme: str, container: str, prefix: str, tuning: StoreTuning
    ) -> None:
        self.url = url.rstrip("/")
        self._tuning = tuning
        self._scheme, self._bucket, self._prefix = scheme, container, prefix
        retry = {
            "max_retries": tuning.max_retries,
            "retry_timeout": timedelta(seconds=tuning.retry_seconds),
            "backoff": {
                "init_backoff": timedelta(milliseconds=100),
                "max_backoff": timedelta(seconds=15),
                "base": 2,
            },
        }
        if scheme == "s3":
            cfg, allow_http = _s3_config()
            store_cls = obstore.store.S3Store
        else:
            account = None
            if "@" in container:  # abfs[s]://container@account.dfs.core.windows.net
                container, _, host = container.partition("@")
                account = host.split(".")[0] or None
            cfg, allow_http = _azure_config(account)
            store_cls = obstore.store.AzureStore
        options = {
            # A whole part, or a whole ranged read, must fit; a hung connection still ends.
            "timeout": "300s",
            "connect_timeout": "10s",
            "pool_max_idle_per_host": str(max(16, 2 * tuning.concurrency)),
        }
        if allow_http:
            options["allow_http"] = True
        try:
            self._store = store_cls(
                container,
                prefix=prefix or None,
                client_options=options,
                retry_config=retry,
                **cfg,
            )
        except Exception as e:  # obstore raises its own errors for a bad configuration
            raise ObjectStoreError(f"cannot open {self.url}: {_short(e)}") from e

    # --- helpers -------------------------------------------------------------------------
    def _where(self, key: str) -> str:
        return f"{self.url}/{key}" if key else self.url

    def _error(self, e: BaseException, op: str, key: str) -> BaseException:
        where = self._where(key)
        msg = f"{op} {where}: {_short(e)}"
        if isinstance(e, FileNotFoundError):
            return FileNotFoundError(f"{where}: no such object")
        if isinstance(e, obx.AlreadyExistsError):
            return FileExistsError(f"{where}: already exists")
        if isinstance(e, obx.PreconditionError):
            return ObjectChangedError(f"{where}: the object changed since it was read ({op})")
        if isinstance(e, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
            return StoragePermissionError(msg)
        return ObjectStoreError(msg)

    # --- the interface -------------------------------------------------------------------
    def put(self, key: str, data: Sequence[memoryview], if_absent: bool) -> None:
        t = self._tuning
        with ByteViews(data) as views:
            # A library may keep this frame alive (a caught exception's traceback reaches it
            # through f_back): then it must not hold the caller's views.
            del data
            try:
                if if_absent and views.size > t.part_bytes:
                    self._put_large_if_absent(key, views)
                    return
                obstore.put(
                    self._store,
                    key,
                    views.payload(t.part_bytes),
                    mode="create" if if_absent else "overwrite",
                    chunk_size=t.part_bytes,
                    max_concurrency=t.concurrency,
                )
            except (FileExistsError, ObjectStoreError):
                raise
            except Exception as e:
                raise self._error(e, "put", key) from e

    def _put_large_if_absent(self, key: str, views: ByteViews) -> None:
        try:  # fail before moving the bytes where it is already there
            obstore.head(self._store, key)
            raise FileExistsError(f"{self._where(key)}: already exists")
        except FileNotFoundError:
            pass
        head, _, name = key.rpartition("/")
        tmp = f"{head}/" * bool(head) + f".{name}.upload-{uuid.uuid4().hex[:16]}"
        t = self._tuning
        try:
            obstore.put(
                self._store,
                tmp,
                views.payload(t.part_bytes),
                chunk_size=t.part_bytes,
                max_concurrency=t.concurrency,
            )
            obstore.copy(self._store, tmp, key, overwrite=False)
        finally:
            try:
                obstore.delete(self._store, tmp)
            except Exception:
                pass  # never written, or the error that matters is already in flight

    def get(self, key: str, offset: int, length: int, etag: str | None):
        if length <= 0:
            check_version(self, key, etag)
            return b""
        options: dict = {"range": (offset, offset + length)}
        if etag:
            options["if_match"] = etag
        try:
            return obstore.get(self._store, key, options=options).bytes()
        except Exception as e:
            err = self._error(e, "get", key)
            if type(err) is ObjectStoreError and _refused_range(e):
                # Stores refuse a range that starts at or past the end (416, or obstore's
                # own check): that read is empty, as a file's would be. (Any other failure
                # was retried already: a head would only spend a second retry budget.)
                size = check_version(self, key, etag)
                if offset >= size:
                    return b""
            raise err from e

    def head(self, key: str) -> tuple[int, int, str]:
        try:
            meta = obstore.head(self._store, key)
        except Exception as e:
            raise self._error(e, "head", key) from e
        return meta["size"], mtime_ns(meta["last_modified"]), meta["e_tag"] or ""

    def list(self, prefix: str, recursive: bool) -> tuple[list[tuple[str, int, int]], list[str]]:
        p = prefix.rstrip("/") or None
        try:
            if recursive:
                objects = [
                    (m["path"], m["size"], mtime_ns(m["last_modified"]))
                    for chunk in obstore.list(self._store, p)
                    for m in chunk
                ]
                return objects, []
            result = obstore.list_with_delimiter(self._store, p)
        except Exception as e:
            raise self._error(e, "list", prefix) from e
        objects = [(m["path"], m["size"], mtime_ns(m["last_modified"])) for m in result["objects"]]
        return objects, [d.rstrip("/") for d in result["common_prefixes"]]

    def copy(self, src: str, dst: str) -> None:
        try:
            obstore.copy(self._store, src, dst)
        except Exception as e:
            raise self._error(e, f"copy to {self._where(dst)} from", src) from e

    def delete(self, key: str) -> None:
        try:
            obstore.delete(self._store, key)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error(e, "delete", key) from e

    def abort_stale_uploads(self, older_than: float) -> list[str]:
        """Aborts the multipart uploads below this URL's prefix that started more than
        `older_than` seconds ago (uploads cut short by a crash; a failed upload is aborted
        when it fails) and returns their keys. S3 only, through boto3 when it is installed
        (obstore cannot list uploads): Azure discards uncommitted blocks by itself."""
        if self._scheme != "s3":
            return []
        try:
            import boto3
        except ImportError:
            return []
        prefix = f"{self._prefix}/" if self._prefix else ""
        cutoff = datetime.now(timezone.utc) - timedelta(seconds=older_than)
        aborted: list[str] = []
        try:
            s3 = boto3.client("s3")
            pages = s3.get_paginator("list_multipart_uploads").paginate(
                Bucket=self._bucket, Prefix=prefix)
            for page in pages:
                for u in page.get("Uploads", []):
                    if u["Initiated"] < cutoff:
                        s3.abort_multipart_upload(Bucket=self._bucket, Key=u["Key"],
                                                  UploadId=u["UploadId"])
                        aborted.append(u["Key"][len(prefix):])
        except Exception as e:  # boto3's errors: the clean-up is best effort, and says why
            raise ObjectStoreError(f"aborting stale uploads in {self.url}: {e}") from e
        return aborted

