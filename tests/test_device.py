"""Device-to-host staging (nebulite._device), on the CPU.

The copies, events and streams are driven through a stand-in backend: host storages play
the device's, and a copy runs when the stand-in "device" would run it (when a stream is
made to wait for its event, or when the host synchronizes with it). Everything a CUDA
device adds is in tests/test_gpu.py.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time
from typing import Any

import pytest
import torch

import nebulite as nm
from nebulite import _device, _plan, _serialization, _staging
from nebulite._serialization import RecordCollector, flatten, save_skeleton
from nebulite.errors import MemoryBudgetError, TornCheckpointError
from test_async_staging import _model  # the same model and optimizer as the CPU staging tests

HANG = 600.0


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = 0


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.upto = len(stream.queue)


class FakeDevice:
    """A CopyBackend whose copies run when the device would have run them. Closing the
    `gate` keeps host synchronizations from completing (copies that have not landed)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        self.streams: dict[torch.device, FakeStream] = {}
        self.copied_on: set[str] = set()  # the threads that issued copies

    def copy_stream(self, device: torch.device) -> FakeStream:
        with self._lock:
            return self.streams.setdefault(device, FakeStream(device))

    def wait_current(self, stream: FakeStream, device: torch.device) -> None:
        self.log.append(("wait_current", device))

    def copy(self, stream: FakeStream, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.copied_on.add(threading.current_thread().name)
        for dst, src in pairs:
            self.log.append(("copy", int(src.numel())))
            stream.queue.append((dst, src))

    def record(self, stream: FakeStream) -> FakeEvent:
        self.log.append(("record", len(stream.queue)))
        return FakeEvent(stream)

    def _run(self, event: FakeEvent) -> None:
        with self._lock:
            s = event.stream
            while s.ran < event.upto:
                dst, src = s.queue[s.ran]
                dst.copy_(src)
                s.ran += 1

    def order_current_after(self, event: FakeEvent | tuple[str, int],
                            device: torch.device) -> None:
        if isinstance(event, tuple):  # a mark: what it marks ran already
            self.log.append(("order", event))
            return
        self.log.append(("order", event.upto))
        self._run(event)  # what the device runs next runs after these copies

    def synchronize(self, event: FakeEvent) -> None:
        assert self.gate.wait(HANG)
        self.log.append(("synchronize", event.upto))
        self._run(event)

    def mark(self, device: torch.device) -> tuple[str, int]:
        # What the device ran before is done here at once: the mark needs no copy.
        mark = ("mark", len(self.log))
        self.log.append(mark)
        return mark

    def wait_event(self, stream: FakeStream, event: tuple[str, int]) -> None:
        self.log.append(("wait_event", event))


def test_chunks_cover_the_bytes_in_order_each_at_most_a_chunk():
    assert _device.chunks(0) == []
    assert _device.chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert _device.chunks(8, 4) == [(0, 4), (4, 4)]
    got = _device.chunks(5 * _device.CHUNK_BYTES + 3)
    assert all(size <= _device.CHUNK_BYTES for _, size in got)
    assert sum(size for _, size in got) == 5 * _device.CHUNK_BYTES + 3
    assert [off for off, _ in got] == [i * _device.CHUNK_BYTES for i in range(6)]
    with pytest.raises(ValueError):
        _device.chunks(10, 0)


def test_without_cuda_in_use_nothing_is_copied_from_a_device():
    assert not _device.in_use() or torch.cuda.is_available()
    state = {"w": torch.randn(1 << 19), "b": torch.randn(3)}
    records = flatten(state, tag="t", name="m", rank=0, version="v")
    assert not records.device_copies
    assert records.on_device == set()


def _records(obj: Any, save: Any) -> tuple[RecordCollector, list[tuple[str, bytes]]]:
    c = RecordCollector()
    save(obj, c, pickle, 2, False)
    out = []
    for (name, _, size, _), src in zip(c.records, c.sources):
        out.append((name, bytes(src) if isinstance(src, bytes) else ("storage", src.data_ptr(), size)))
    return c, out


class Custom:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.n = 3


def _objects() -> list[Any]:
    base = torch.arange(4096, dtype=torch.float32)
    return [
        {"w": torch.randn(33, 7), "i": torch.arange(5), "b": torch.zeros(3, dtype=torch.bool)},
        {"view": base[10:20], "t": base[:1024].view(32, 32).t(), "s": base[::3], "base": base},
        [torch.randn(2, dtype=dt) for dt in (torch.float16, torch.bfloat16, torch.complex64)],
        {"p": torch.nn.Parameter(torch.randn(4)), "custom": Custom(torch.ones(2)), "x": 1.5,
         "none": None, "nested": ({"a": [torch.empty(0)]},)},
        torch.nn.Linear(4, 3).state_dict(),
        {"typed": torch.arange(6, dtype=torch.int16).untyped_storage()},
    ]


@pytest.mark.parametrize("i", range(len(_objects())))
def test_the_skeleton_writer_writes_what_torch_save_writes(i):
    obj = _objects()[i]
    _, theirs = _records(obj, torch.serialization._save)
    _, ours = _records(obj, save_skeleton)
    assert ours == theirs


def test_the_skeleton_writer_knows_it_writes_what_this_torch_writes():
    assert _serialization.skeleton_matches_torch()


def test_the_skeleton_writer_refuses_what_torch_save_refuses():
    base = torch.arange(8, dtype=torch.float32)
    bad = {"a": base, "b": base.view(torch.int32)}  # one storage seen as two types
    with pytest.raises(RuntimeError) as theirs:
        _records(bad, torch.serialization._save)
    with pytest.raises(RuntimeError) as ours:
        _records(bad, save_skeleton)
    assert str(ours.value) == str(theirs.value)


def test_objects_flattened_by_the_skeleton_writer_load_with_torch_load(store, monkeypatch):
    monkeypatch.setattr(_device, "in_use", lambda: True)  # as on a machine using CUDA
    nm.init(persistent_storage_path=store)
    state = _objects()[1]
    nm.Checkpoint("t").save("s", state)
    nm.flush_persistence()
    got = torch.load(nm.get_latest_checkpoint_path("s"), weights_only=True)
    for k, t in state.items():
        assert torch.equal(got[k], t) and got[k].stride() == t.stride(), k
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()


def test_copies_are_chunked_unsafe_first_and_marked_by_events():
    fake = FakeDevice()
    copies = _device.DeviceCopies(fake, chunk=1000)
    safe = torch.arange(2500, dtype=torch.uint8).untyped_storage()
    unsafe = torch.arange(1200, dtype=torch.uint8).flip(0).untyped_storage()
    host = torch.zeros(3700, dtype=torch.uint8)
    address = host.data_ptr()
    copies.add(0, safe, host[:2500], safe=True)
    copies.add(1, unsafe, host[2500:], safe=False)
    copies.finish()
    assert fake.log == [("wait_current", torch.device("cpu")),
                        ("copy", 1000), ("copy", 200), ("record", 2),
                        ("copy", 1000), ("copy", 1000), ("copy", 500), ("record", 5)]
    assert not host.any()  # nothing ran on the "device" yet
    copies.order_after(unsafe_only=True)
    assert torch.equal(host[2500:], torch.arange(1200, dtype=torch.uint8).flip(0))
    assert not host[:2500].any()
    copies.order_after()
    copies.order_after()  # once ordered, never again
    assert [e for e in fake.log if e[0] == "order"] == [("order", 2), ("order", 5)]
    assert torch.equal(host[:2500], torch.arange(2500, dtype=torch.uint8))
    copies.synchronize()
    assert copies._sources == []  # the sources go once the copies landed
    assert copies.spans == [(0, address, 2500), (1, address + 2500, 1200)]


def test_the_host_sees_the_copies_land_group_by_group_in_the_order_issued():
    fake = FakeDevice()
    copies = _device.DeviceCopies(fake, chunk=100, group=250)
    host = torch.zeros(1000, dtype=torch.uint8)
    sources = [torch.full((200,), k + 1, dtype=torch.uint8).untyped_storage() for k in range(5)]
    for k, src in enumerate(sources):
        copies.add(k, src, host[200 * k:200 * (k + 1)], safe=k != 2)
    copies.finish()
    # unsafe first (record 2); then the safe ones, an event after every 250 bytes or more
    assert [e for e in fake.log if e[0] == "record"] == [("record", 2), ("record", 6), ("record", 10)]
    landed = []
    for index, address, size in copies.landing():
        assert size == 200 and bool((host[200 * index:200 * (index + 1)] == index + 1).all())
        landed.append(index)
    assert landed == [2, 0, 1, 3, 4]
    assert copies._sources == []


def test_the_sealer_runs_jobs_in_order_after_their_copies_and_keeps_errors():
    fake = FakeDevice()
    fake.gate.clear()
    sealer = _device.Sealer()
    ran: list[int] = []
    jobs = []
    host = torch.zeros(3, dtype=torch.uint8)
    for k in range(3):
        copies = _device.DeviceCopies(fake)
        copies.add(0, torch.ones(1, dtype=torch.uint8).untyped_storage(), host[k:k + 1], safe=True)
        copies.finish()

        def then(k: int = k, copies: _device.DeviceCopies = copies) -> None:
            copies.synchronize()
            ran.append(k)
            if k == 1:
                raise RuntimeError("seal failed")
        jobs.append(sealer.submit(copies, then))
    assert not jobs[0].done.wait(0.05)
    fake.gate.set()
    sealer.drain()
    assert ran == [0, 1, 2]
    assert [j.error is not None for j in jobs] == [False, True, False]
    assert all(j.done.is_set() for j in jobs)
    assert host.tolist() == [1, 1, 1]


def _sealer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nebulite-device-sealer"]


def test_the_sealer_keeps_its_thread_for_the_next_job_until_drained():
    fake = FakeDevice()
    sealer = _device.Sealer()
    ran_on: list[threading.Thread] = []

    def seal_one() -> None:
        copies = _device.DeviceCopies(fake)
        copies.finish()
        job = sealer.submit(copies, lambda: ran_on.append(threading.current_thread()))
        assert job.done.wait(HANG)

    seal_one()
    seal_one()
    assert ran_on[0] is ran_on[1], "the second job started a thread of its own"
    sealer.drain(stop=False)
    assert ran_on[0].is_alive() and _sealer_threads() == [ran_on[0]]
    sealer.drain()
    assert not ran_on[0].is_alive() and not _sealer_threads()
    seal_one()  # a job after the stop starts a thread again
    assert ran_on[2] is not ran_on[0]
    sealer.drain()
    assert not _sealer_threads()


def _fake_device(monkeypatch, scanned: bool) -> FakeDevice:
    """Saves copy storages as if they were on a device, through a FakeDevice. Without
    `scanned`, every storage, from the caller's thread (as an object holding a CUDA buffer
    is staged). With it, an asynchronous save scans the object as it scans one whose
    CUDA storages are all safe: the safe storages are copied from the "device" by the
    staging thread, behind the marks save() made; the others were copied at save()."""
    fake = FakeDevice()
    monkeypatch.setattr(_device, "_backend", fake)
    original = RecordCollector.write_record

    def write_record(self: RecordCollector, name: str, data: Any, nbytes: int) -> None:
        original(self, name, data, nbytes)
        if isinstance(self.sources[-1], bytes):
            return
        n, _, size, deferred = self.records[-1]
        if self.watch.scanned is not None and not deferred:
            return  # copied into host memory at save()
        self.records[-1] = (n, 0, size, deferred)
        self.on_device.add(len(self.records) - 1)

    monkeypatch.setattr(RecordCollector, "write_record", write_record)
    if scanned:
        scan = _staging.scan

        def scan_on_device(obj: Any) -> _staging.Scanned | None:
            found = scan(obj)
            if found is not None and found.storage_bytes:
                found.devices = [torch.device("cpu")]  # the device the stand-in plays
            return found

        monkeypatch.setattr(_staging, "scan", scan_on_device)
    else:
        monkeypatch.setattr(_staging, "scan", lambda obj: None)
    return fake


@pytest.fixture
def fake_device(monkeypatch) -> FakeDevice:
    return _fake_device(monkeypatch, scanned=False)


@pytest.fixture(params=["caller", "scanned"])
def async_device(request, monkeypatch) -> FakeDevice:
    """A FakeDevice for asynchronous saves, each way an object on a device is staged: from
    the caller's thread (it holds a CUDA buffer), or scanned (see _fake_device)."""
    return _fake_device(monkeypatch, scanned=request.param == "scanned")


@pytest.fixture(params=["embedded", "agent"])
def mode(request, monkeypatch):
    if request.param == "agent":
        request.getfixturevalue("agent_env")
        monkeypatch.setenv("NEBULITE_AGENT", "1")
    return request.param




def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_blocking_staging_returns_once_the_copies_landed_and_the_object_is_sealed(
        store, mode, fake_device):
    nm.init(persistent_storage_path=store, persistent_time_interval=0)
    model, opt = _model()
    _step(model, opt)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    nm.Checkpoint("b").save("model", model.state_dict())
    assert any(e[0] == "synchronize" for e in fake_device.log)
    assert not nm.api._session.pending
    _step(model, opt)
    got = nm.get_latest_checkpoint().load("model")
    for k, t in state.items():
        assert torch.equal(got[k], t), k
    nm.flush_persistence()
    got = torch.load(nm.get_latest_checkpoint_path("model"), weights_only=True)  # CRCs held
    assert all(torch.equal(got[k], t) for k, t in state.items())


def test_async_staging_orders_the_step_after_the_copies_and_commits_once_they_landed(
        store, mode, async_device):
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    model, opt = _model()
    _step(model, opt)  # the optimizer's storages are known to be safe from now on
    async_device.gate.clear()  # the copies do not land before we say so
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    ck = nm.Checkpoint("a", 2)
    ck.save("model", model.state_dict())  # returns with the copies issued, not landed
    ck.save("optimizer", opt.state_dict())
    s = nm.api._session
    assert s.pending and s.held_commits
    _step(model, opt)  # the barrier: ordered after the copies on the device, host not held
    assert s.held_commits, "committed before its bytes landed"
    assert not any(v["tag"] == "a" for v in s.engine.versions())
    async_device.gate.set()
    got = nm.get_checkpoint(tag="a")
    assert got.tag == "a"
    model_got = got.load("model")
    for k, t in expected.items():
        assert torch.equal(model_got[k], t), k
    assert torch.equal(got.load("optimizer")["state"][0]["exp_avg"], expected_opt)


def test_the_sealer_thread_outlives_the_optimizer_barrier_but_no_other_call(
        store, async_device):
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    model, opt = _model()
    _step(model, opt)
    nm.Checkpoint("a", 1).save("model", model.state_dict())
    _step(model, opt)  # the barrier: the next save finds the thread there
    sealers = _sealer_threads()
    assert len(sealers) == 1
    nm.Checkpoint("b", 1).save("model", model.state_dict())
    _step(model, opt)
    assert _sealer_threads() == sealers, "a save started another sealer thread"
    assert nm.get_checkpoint(tag="b").tag == "b"  # any other call waits for it, and it ends
    assert not _sealer_threads() and not sealers[0].is_alive()


def test_a_save_waiting_for_memory_that_copies_still_landing_hold_goes_on(
        store, mode, async_device, monkeypatch):
    # Each checkpoint takes most of the memory tier, so the next one's reservation needs
    # the memory of the one before, whose copies land (and whose objects are sealed) only
    # after that reservation was asked for: with the node agent, the seals go over the
    # connection the reservation holds.
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(16 << 20))
    original = FakeDevice.synchronize

    def late(self: FakeDevice, event: FakeEvent) -> None:
        time.sleep(0.2)
        original(self, event)

    monkeypatch.setattr(FakeDevice, "synchronize", late)
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    model, opt = _model()
    _step(model, opt)
    save_each_step_and_check(model, opt, lambda: _step(model, opt))


def save_each_step_and_check(model: torch.nn.Module, opt: torch.optim.Optimizer,
                             step: Any, **load: Any) -> None:
    """Three checkpoints of the model and its optimizer (two objects each), each followed
    at once by `step`; then each checkpoint's model loads (with `load`'s arguments) as it
    was when saved. Shared with tests/test_gpu.py."""
    expected = {}
    for k in range(3):
        expected[k] = {n: t.clone() for n, t in model.state_dict().items()}
        ck = nm.Checkpoint(f"s{k}", 2)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        step()
    for k, state in expected.items():
        got = nm.get_checkpoint(tag=f"s{k}").load("model", **load)
        for n, t in state.items():
            assert torch.equal(got[n], t), (k, n)


def test_an_async_save_of_safe_device_storages_leaves_their_copies_to_the_staging_thread(
        store, mode, monkeypatch):
    fake = _fake_device(monkeypatch, scanned=True)
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    model, opt = _model()
    _step(model, opt)
    _step(model, opt)  # the optimizer's state, made by the first step, is known to be safe
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    ck = nm.Checkpoint("a", 2)
    ck.save("model", model.state_dict())
    # The staging thread starts at the commit: save() marked the device, and nothing else.
    assert fake.log == [("mark", 0)]
    ck.save("optimizer", opt.state_dict())
    _step(model, opt)
    assert fake.copied_on == {"nebulite-stager"}
    assert not any(e[0] == "wait_current" for e in fake.log)
    marks = [e for e in fake.log if e[0] == "mark"]
    assert len(marks) == 2  # one per object (and device)
    waits = [i for i, e in enumerate(fake.log) if e[0] == "wait_event"]
    copies = [i for i, e in enumerate(fake.log) if e[0] == "copy"]
    assert [fake.log[i][1] for i in waits] == marks  # each object's copies wait for its mark
    assert copies and waits[0] < copies[0]
    got = nm.get_checkpoint(tag="a")
    model_got = got.load("model")
    for k, t in expected.items():
        assert torch.equal(model_got[k], t), k
    assert torch.equal(got.load("optimizer")["state"][0]["exp_avg"], expected_opt)


def test_a_checkpoint_of_an_object_with_a_device_buffer_and_a_scanned_one_holds_both(
        store, mode, monkeypatch):
    # The model holds buffers on the device (its copies are issued by save()); the
    # optimizer's state is all safe (scanned, its copies issued by the staging thread).
    fake = _fake_device(monkeypatch, scanned=True)
    scan = _staging.scan
    monkeypatch.setattr(_staging, "scan",
                        lambda obj: None if "1.running_mean" in obj else scan(obj))
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    model, opt = _model()
    _step(model, opt)
    _step(model, opt)
    for k in range(2):
        expected = {n: t.clone() for n, t in model.state_dict().items()}
        expected_opt = opt.state_dict()["state"][2]["exp_avg_sq"].clone()
        ck = nm.Checkpoint(f"m{k}", 2)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        _step(model, opt)
        got = nm.get_checkpoint(tag=f"m{k}")
        model_got = got.load("model")
        for n, t in expected.items():
            assert torch.equal(model_got[n], t), (k, n)
        assert torch.equal(got.load("optimizer")["state"][2]["exp_avg_sq"], expected_opt)
    assert fake.copied_on == {threading.current_thread().name, "nebulite-stager"}
    assert any(e[0] == "mark" for e in fake.log)
    assert ("wait_current", torch.device("cpu")) in fake.log


def test_without_a_skeleton_writer_for_this_torch_a_device_object_is_staged_by_the_caller(
        store, monkeypatch):
    # torch's own writer would copy each CUDA storage to the host on the staging thread,
    # outside the order of the device's current stream: the caller stages the object.
    fake = _fake_device(monkeypatch, scanned=True)
    monkeypatch.setattr(nm.api, "skeleton_matches_torch", lambda: False)
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _model()
    _step(model, opt)
    nm.Checkpoint("c").save("model", model.state_dict())
    assert not any(e[0] == "mark" for e in fake.log)
    assert fake.copied_on == {threading.current_thread().name}
    nm.wait_staged()
    assert nm.get_checkpoint(tag="c").tag == "c"


def test_a_scanned_object_too_large_for_the_memory_tier_is_copied_behind_its_mark(
        store, monkeypatch):
    fake = _fake_device(monkeypatch, scanned=True)

    def full(*args: Any, **kwargs: Any) -> Any:
        raise MemoryBudgetError("no room")

    monkeypatch.setattr(_device, "stage", full)
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _model()
    _step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    nm.Checkpoint("big").save("model", model.state_dict())
    _step(model, opt)
    mark = next(e for e in fake.log if e[0] == "mark")
    assert ("order", mark) in fake.log  # the copies to host memory came after its mark
    got = nm.get_checkpoint(tag="big").load("model")
    for k, t in expected.items():
        assert torch.equal(got[k], t), k


def test_async_staging_fails_a_checkpoint_changed_before_the_barrier(store, mode, async_device):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _model()
    _step(model, opt)
    async_device.gate.clear()
    nm.Checkpoint("torn").save("model", model.state_dict())
    with torch.no_grad():
        model[0].weight.add_(1)  # raced with the copy on a device
    async_device.gate.set()
    with pytest.raises(TornCheckpointError, match="0.weight"):
        nm.wait_staged()
    assert nm.get_checkpoint(tag="torn").tag == ""


def test_async_staging_commits_in_order_when_a_later_barrier_finds_the_copies_landed(
        store, async_device):
    nm.init(async_staging=True)
    model, opt = _model()
    _step(model, opt)
    async_device.gate.clear()
    nm.Checkpoint("one").save("model", model.state_dict())
    nm.Checkpoint("two").save("model", model.state_dict())
    _step(model, opt)
    s = nm.api._session
    assert [c[0] for c in s.held_commits] == ["one", "two"]
    async_device.gate.set()
    s.sealer.drain()
    _step(model, opt)  # the next barrier commits both, in order
    assert not s.held_commits and not s.pending
    assert [v["tag"] for v in s.engine.versions()][-2:] == ["one", "two"]


def test_a_cpu_only_plan_key_is_unchanged_by_device_support():
    t = torch.randn(3, 4)
    key = _plan.walk({"t": t}).key
    assert key is not None
    assert (torch.Tensor, torch.float32, t.shape, t.stride(), 0, False, 0, 48) in key


@pytest.mark.parametrize("async_staging", [False, True], ids=["blocking", "async"])
def test_a_failed_staging_from_a_device_fails_that_checkpoint_only(store, async_device,
                                                                   monkeypatch, async_staging):
    from nebulite import _core
    from nebulite.errors import PersistError

    nm.init(persistent_storage_path=store, async_staging=async_staging)
    model, opt = _model()
    _step(model, opt)
    nm.Checkpoint("good").save("model", model.state_dict())
    nm.wait_staged()

    def crc32(address: int, n: int, threads: int) -> int:
        raise RuntimeError("the checksum failed")

    original = _core.crc32
    monkeypatch.setattr(_core, "crc32", crc32)
    if async_staging:
        nm.Checkpoint("bad").save("model", model.state_dict())
        with pytest.raises(PersistError, match="from the device failed: the checksum failed"):
            nm.wait_staged()
    else:
        with pytest.raises(RuntimeError, match="the checksum failed"):
            nm.Checkpoint("bad").save("model", model.state_dict())
    monkeypatch.setattr(_core, "crc32", original)
    assert nm.get_latest_checkpoint().tag == "good"
    assert nm.get_checkpoint(tag="bad").tag == ""
    nm.Checkpoint("bad").save("model", model.state_dict())  # the tag starts afresh
    assert nm.get_latest_checkpoint().tag == "bad"


def test_the_crc_of_bytes_in_memory_is_zlib_s_on_any_number_of_threads():
    import zlib

    from nebulite import _core

    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    want = zlib.crc32(data.numpy().tobytes())
    for threads in (1, 2, 4):
        assert _core.crc32(data.data_ptr(), data.numel(), threads) == want
    assert _core.crc32(data.data_ptr(), 0, 1) == 0


def _skeleton_at(location: bytes, obj: Any) -> bytes:
    c = RecordCollector()
    save_skeleton(obj, c, pickle, 2, False)
    pkl = c.sources[0]
    cpu = b"X" + struct.pack("<I", 3) + b"cpu"  # BINUNICODE, protocol 2
    assert isinstance(pkl, bytes) and cpu in pkl
    return pkl.replace(cpu, b"X" + struct.pack("<I", len(location)) + location)


def test_the_locations_of_a_skeleton_s_storages_are_read_without_running_it(tmp_path):
    base = torch.arange(10.0)
    pkl = _skeleton_at(b"cuda:1", {"a": base, "v": base[2:], "b": torch.ones(3)})
    assert _serialization.storage_locations(pkl) == {"0": "cuda:1", "1": "cuda:1"}

    class Evil:
        def __reduce__(self):
            return (open, (str(tmp_path / "ran"), "w"))

    evil = pickle.dumps({"x": Evil(), "t": 1}, protocol=2)
    assert _serialization.storage_locations(evil) == {}
    assert not (tmp_path / "ran").exists()
    assert _serialization.storage_locations(b"not a pickle") == {}


def test_a_source_that_lends_no_memory_or_a_machine_without_cuda_plans_no_device_copies():
    source = _serialization.ArchiveSource({"data.pkl": 3, "data/0": 8}, read=lambda n: b"",
                                          read_into=lambda n, a: None, description="d",
                                          lend=lambda n: 0)
    source.plan_device_copies("cuda:0")
    assert source.targets == {} or torch.cuda.is_available()
    plain = _serialization.ArchiveSource({"data/0": 8}, read=lambda n: b"",
                                         read_into=lambda n, a: None, description="d")
    plain.plan_device_copies("cuda:0")
    assert plain.targets == {}


def test_loads_plan_which_records_go_straight_to_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(_serialization, "_cuda_device",
                        lambda loc: torch.device("meta") if loc.startswith("cuda") else None)
    base = torch.arange(10.0)
    obj = {"a": base, "v": base[2:], "b": torch.ones(3)}
    on_cuda = _skeleton_at(b"cuda:1", obj)
    on_cpu = _skeleton_at(b"cpu", obj)
    pins: list[int] = []

    def targets(pkl: bytes, map_location: Any) -> set[str]:
        records = {"data.pkl": pkl, "byteorder": b"little", "data/0": b"", "data/1": b""}
        source = _serialization.ArchiveSource(
            {n: len(b) for n, b in records.items()}, read=lambda n: records[n],
            read_into=lambda n, a: None, description="d", lend=lambda n: 0,
            pin=lambda: bool(pins.append(1)))
        source.plan_device_copies(map_location)
        return set(source.targets)

    both = {"data/0", "data/1"}
    assert targets(on_cuda, None) == both and len(pins) == 1
    assert targets(on_cpu, None) == set() and len(pins) == 1  # nothing to pin for
    assert targets(on_cpu, "cuda:0") == both
    assert targets(on_cpu, torch.device("cuda", 0)) == both
    assert targets(on_cuda, "cpu") == set()
    assert targets(on_cuda, {"cuda:1": "cpu"}) == set()
    assert targets(on_cpu, {"cpu": "cuda:0"}) == both
    assert targets(on_cuda, lambda storage, location: storage) == set()  # decided per storage
    assert len(pins) == 4  # once per load with a record to copy to a device
