"""Real object-store emulators for tests: Azurite (Azure Blob), moto (S3) and
gcp-storage-emulator (GCS JSON API), each started on a free 127.0.0.1 port and stopped
at the end, with nothing left behind.

Use the pytest fixtures (``azurite``, ``moto_s3``, ``gcs_emulator``: one emulator per test
module; ``object_store``: the three, parametrized; ``store_url``/``store_env``: a fresh
prefix and the environment that makes ``nebulite.stores.open_client`` reach it) or start
an emulator yourself with :func:`start_azurite`, :func:`start_moto` or :func:`start_gcs`
and call ``stop()``.

Each emulator object has:

* ``scheme``: ``az``, ``s3`` or ``gs``; ``container``: the container/bucket made for it;
* ``endpoint``: ``http://127.0.0.1:PORT`` (Azurite: with ``/devstoreaccount1``);
* ``new_url()``: a URL under a fresh unique prefix;
* ``env`` / ``env_for(endpoint)``: the variables that make the clients reach it (through
  a proxy such as ``tests.http_faults.FaultProxy`` with ``env_for(proxy.endpoint)``);
* ``kill()`` (SIGKILL) and ``restart()`` (the same port, and with Azurite started with
  ``persist=True`` the same data).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
AZURITE = REPO.parent / "shared" / "tools" / "azurite" / "run-azurite-blob"

AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

#: Bounds a hang only: emulators start in about a second on an idle machine.
START_TIMEOUT = 180.0

#: Environment variables that would change where the clients go or how they sign.
_STORE_ENV_PREFIXES = ("AWS_", "AZURE_", "STORAGE_EMULATOR_HOST", "GOOGLE_")


def import_stores():
    """nebulite.stores from this checkout's source tree (it is pure Python, so the tests
    exercise the code beside them even where the installed nebulite is older), else the
    installed one."""
    import importlib
    import importlib.util

    import nebulite  # noqa: F401 - the parent package, installed (it holds the C++ core)

    if "nebulite.stores" in sys.modules:
        return sys.modules["nebulite.stores"]
    src = REPO / "python" / "nebulite" / "stores"
    if not (src / "__init__.py").is_file():
        return importlib.import_module("nebulite.stores")
    spec = importlib.util.spec_from_file_location(
        "nebulite.stores", src / "__init__.py", submodule_search_locations=[str(src)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["nebulite.stores"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    """Waits until `url` answers any HTTP status (an error status is an answer)."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"emulator exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"emulator did not answer at {url}: {log.read_text()[-2000:]}")
            time.sleep(0.1)


class Emulator:
    """One emulator process; see the module docstring for the attributes."""

    scheme = ""

    def __init__(self, persist: bool = False) -> None:
        self.port = free_port()
        self.container = "nebulite-" + uuid.uuid4().hex[:8]
        self.tmp = Path(tempfile.mkdtemp(prefix=f"nebulite-{self.scheme}-"))
        self.data_dir = self.tmp / "data" if persist else None
        self.log = self.tmp / "emulator.log"
        self.proc: subprocess.Popen | None = None

    # Subclasses: the command line, its environment, the readiness URL, the container creation.
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _process_env(self) -> dict[str, str]:
        # Its temporary files (Azurite's telemetry cache, say) go where stop() removes them.
        return dict(_clean_env(), TMPDIR=str(self.tmp))

    def _ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def _create_container(self) -> None:
        raise NotImplementedError

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env_for(self, endpoint: str) -> dict[str, str]:
        raise NotImplementedError

    @property
    def env(self) -> dict[str, str]:
        return self.env_for(self.endpoint)

    def new_url(self) -> str:
        return f"{self.scheme}://{self.container}/t-{uuid.uuid4().hex[:12]}"

    def _spawn(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self._process_env(),
            )
        _wait_http(self._ready_url(), self.proc, self.log)

    def start(self) -> "Emulator":
        try:
            self._spawn()
            self._create_container()
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the emulator (its whole process group) and reaps it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=START_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Starts the emulator again on the same port (after kill(), or kills it first)."""
        self.kill()
        deadline = time.monotonic() + START_TIMEOUT
        while True:  # the port may linger a moment after the kill
            try:
                self._spawn()
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Azurite(Emulator):
    scheme = "az"

    def _command(self) -> list[str]:
        cmd = [str(AZURITE), str(self.port)]
        if self.data_dir is not None:
            cmd.append(str(self.data_dir))
        return cmd

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURITE_ACCOUNT}"

    def connection_string(self, endpoint: str) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
            f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
        )

    def env_for(self, endpoint: str) -> dict[str, str]:
        if not endpoint.rstrip("/").endswith(AZURITE_ACCOUNT):
            endpoint = endpoint.rstrip("/") + "/" + AZURITE_ACCOUNT
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string(endpoint)}

    def wait_saved(self, name: str) -> None:
        """Waits until Azurite's metadata file names `name` (a blob name or any string in
        it). Azurite saves its metadata every 5 s, and a SIGTERM takes it minutes to act
        on: after this a SIGKILL loses nothing written before."""
        assert self.data_dir is not None, "start it with persist=True"
        db = self.data_dir / "__azurite_db_blob__.json"
        deadline = time.monotonic() + START_TIMEOUT
        while not (db.is_file() and name in db.read_text(errors="replace")):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Azurite did not save {name!r} in {db}")
            time.sleep(0.2)

    def _create_container(self) -> None:
        from azure.storage.blob import BlobServiceClient

        svc = BlobServiceClient.from_connection_string(self.connection_string(self.endpoint))
        svc.create_container(self.container)


class MotoS3(Emulator):
    scheme = "s3"

    def _command(self) -> list[str]:
        return [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)]

    def _process_env(self) -> dict[str, str]:
        # Objects in memory, as the other emulators keep them (gcp-storage-emulator's
        # --in-memory, Azurite without a data folder): moto's default spills every object
        # and part over 5 MiB to a temporary file, whose write-back to disk then lands on
        # whatever runs next (a benchmark's next candidate).
        return dict(super()._process_env(), MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(1 << 30))

    def _ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/moto-api/"

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }

    def _create_container(self) -> None:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        s3.create_bucket(Bucket=self.container)


class GcsEmulator(Emulator):
    scheme = "gs"

    def _command(self) -> list[str]:
        return [
            str(BIN / "gcp-storage-emulator"),
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--in-memory",
            "--default-bucket",
            self.container,
            "--quiet",
        ]

    def _bucket_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/storage/v1/b/{self.container}"

    def _ready_url(self) -> str:
        return self._bucket_url()

    def env_for(self, endpoint: str) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": endpoint}

    def _spawn(self) -> None:
        super()._spawn()
        # As the README advises for a checkpoint bucket: no soft delete. The emulator would
        # otherwise keep a copy of every object deleted (each temporary part of an upload,
        # each checkpoint retention removes) in its memory, and its state, and with it the
        # time of each request, would grow over a test run.
        body = b'{"softDeletePolicy": {"retentionDurationSeconds": "0"}}'
        request = urllib.request.Request(
            self._bucket_url(),
            data=body,
            method="PATCH",
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(request, timeout=30).close()

    def _create_container(self) -> None:
        pass  # --default-bucket made it (and _spawn configured it)


def start_azurite(persist: bool = False) -> Azurite:
    return Azurite(persist).start()  # type: ignore[return-value]


def start_moto() -> MotoS3:
    return MotoS3().start()  # type: ignore[return-value]


def start_gcs() -> GcsEmulator:
    return GcsEmulator().start()  # type: ignore[return-value]


STARTERS: dict[str, Callable[[], Emulator]] = {
    "az": start_azurite,
    "s3": start_moto,
    "gs": start_gcs,
}


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(_STORE_ENV_PREFIXES)}


@contextlib.contextmanager
def store_environment(env: dict[str, str]) -> Iterator[None]:
    """Sets `env` (and unsets every other store variable) for the duration; for code that
    is not a pytest test (benchmarks), tests use monkeypatch through ``store_env``."""
    saved = dict(os.environ)
    for k in list(os.environ):
        if k.startswith(_STORE_ENV_PREFIXES):
            del os.environ[k]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _emulator_fixture(scheme: str):
    @pytest.fixture(scope="module")
    def fixture() -> Iterator[Emulator]:
        emu = STARTERS[scheme]()
        try:
            yield emu
        finally:
            emu.stop()

    return fixture


azurite = _emulator_fixture("az")
moto_s3 = _emulator_fixture("s3")
gcs_emulator = _emulator_fixture("gs")


@pytest.fixture(params=["az", "s3", "gs"])
def object_store(request) -> Emulator:
    """Each of the three emulators in turn (module-scoped underneath)."""
    name = {"az": "azurite", "s3": "moto_s3", "gs": "gcs_emulator"}[request.param]
    return request.getfixturevalue(name)


@pytest.fixture
def store_env(object_store, monkeypatch) -> dict[str, str]:
    """Points the process environment at `object_store` (other store variables unset)."""
    for k in list(os.environ):
        if k.startswith(_STORE_ENV_PREFIXES):
            monkeypatch.delenv(k)
    for k, v in object_store.env.items():
        monkeypatch.setenv(k, v)
    return object_store.env


@pytest.fixture
def store_url(object_store, store_env) -> str:
    """A fresh, empty prefix in `object_store`, with the environment pointing at it."""
    return object_store.new_url()
