"""init(async_staging=True): saves return before the bytes are copied, yet every
checkpoint holds exactly the state at save() time."""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import threading
import time

import pytest
import torch

import nebulite as nm
from nebulite import _core, _staging
from nebulite._serialization import flatten


@pytest.fixture(autouse=True, params=["embedded", "agent"])
def mode(request, monkeypatch):
    """Every test runs with the engine embedded and through the node agent."""
    if request.param == "agent":
        request.getfixturevalue("agent_env")
        monkeypatch.setenv("NEBULITE_AGENT", "1")
    return request.param


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024), torch.nn.Linear(1024, 512)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    model(torch.randn(8, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _clone(state: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}


def test_what_a_save_foresees_it_will_stage_is_not_less_than_what_it_takes(store):
    """Coordinated ranks decide at the commit whether a checkpoint stays in memory from
    what each object an asynchronous save left to the staging thread is expected to take
    (nebulite._room): never less than its data file really takes."""
    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=3600,
            num_of_version_in_retention=8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(64, 4, 128)
                                  for _ in range(3)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 5, 64)).sum().backward()
    opt.step()
    table = torch.arange(4096.0)
    objects = [model.state_dict(), opt.state_dict(),
               {"step": 1, "names": [f"layer{k}" for k in range(20000)], "big": 1 << 4000,
                "text": "état 名前 🙂" * 2000, "blob": bytes(30000), "t": torch.ones(3)},
               {"rows": [table[i:i + 2] for i in range(0, 4096, 4)]}]  # 1024 views of one
    foreseen = {}
    for i, obj in enumerate(objects):
        scanned = _staging.scan(obj)
        assert scanned is not None
        foreseen[f"t{i}"] = scanned.image_bytes
        nm.Checkpoint(f"t{i}").save("x", obj)
    nm.flush_persistence()
    sizes = {row["tag"]: row["bytes"] for row in nm.history()}
    assert sizes.keys() == foreseen.keys(), sizes
    for tag, size in sizes.items():  # the memory it takes: its size in 4 KiB blocks
        assert 0 < -(-size // 4096) * 4096 <= foreseen[tag], (tag, size, foreseen[tag])


def test_only_optimizer_managed_storages_are_deferred(store):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _model()
    before = flatten(model.state_dict(), tag="t", name="m", rank=0, version="v")
    assert not before.deferred  # no optimizer has stepped yet: nothing is known to be safe
    _step(model, opt)
    records = flatten(model.state_dict(), tag="t", name="m", rank=0, version="v")
    deferred = {name for name, _, size, d in records.records if d}
    assert deferred, "the parameters should be deferred"
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert {ptr for _, ptr, _, d in records.records if d} == params
    for name, ptr, size, d in records.records:
        if d:
            assert size >= _staging.MIN_DEFERRED_BYTES
    # BatchNorm statistics change in forward: never deferred.
    bn_ptrs = {model[1].running_mean.untyped_storage().data_ptr(),
               model[1].running_var.untyped_storage().data_ptr()}
    assert not any(d and ptr in bn_ptrs for _, ptr, _, d in records.records)


def test_checkpoints_hold_the_state_at_save_time(store, mode):
    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=0,
            num_of_version_in_retention=0)
    assert (nm.session_info()["agent_pid"] is not None) == (mode == "agent")
    model, opt = _model()
    _step(model, opt)
    expected = {}
    for k in range(4):
        ckpt = nm.Checkpoint(f"step{k}", 2)
        ckpt.save("model", model.state_dict())
        ckpt.save("optimizer", opt.state_dict())
        expected[k] = _clone(model.state_dict())
        # Training goes on at once: forward changes BatchNorm buffers, step() the weights.
        _step(model, opt)
    for k, state in expected.items():
        got = nm.get_checkpoint(tag=f"step{k}").load("model")
        for name, t in state.items():
            assert torch.equal(got[name], t), (k, name)
    nm.flush_persistence()
    nm.api._reset_for_tests()
    got = nm.get_latest_checkpoint(persist_path=store).load("model")
    for name, t in expected[3].items():
        assert torch.equal(got[name], t), name


def test_wait_staged_allows_direct_changes(store):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _model()
    _step(model, opt)
    nm.Checkpoint("a").save("model", model.state_dict())
    saved = _clone(model.state_dict())
    nm.wait_staged()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # a change outside optimizer.step(), after the explicit barrier
    got = nm.get_latest_checkpoint().load("model")
    for name, t in saved.items():
        assert torch.equal(got[name], t), name


def test_disabled_by_default_and_hook_removed_on_shutdown(store):
    nm.init(persistent_storage_path=store)
    assert not _staging.enabled()
    nm.init(persistent_storage_path=store, async_staging=True)
    assert _staging.enabled()
    nm.shutdown()
    assert not _staging.enabled()


def test_optimizer_step_right_after_save_waits_for_the_copy(store):
    """A step that starts the instant save() returns must not tear the checkpoint."""
    nm.init(persistent_storage_path=store, async_staging=True, num_of_version_in_retention=0)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.Linear(4096, 2048))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 2048)).square().mean().backward()  # gradients stay for every step
    opt.step()
    expected = {}
    for k in range(3):
        expected[k] = _clone(model.state_dict())
        nm.Checkpoint(f"s{k}").save("model", model.state_dict())
        opt.step()  # changes every weight in place, immediately
    for k, state in expected.items():
        got = nm.get_checkpoint(tag=f"s{k}").load("model")
        for name, t in state.items():
            assert torch.equal(got[name], t), (k, name)


def _stepped_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = _model()
    _step(model, opt)
    _step(model, opt)  # its state exists since the first step: known safe from the second
    return model, opt


def test_a_tensor_changed_before_its_deferred_copy_fails_that_checkpoint(store, mode):
    """A change outside optimizer.step() between save() and the copy tears the checkpoint:
    it is never committed, the error names the tensor, the previous one still loads."""
    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=0)
    model, opt = _stepped_model()
    ckpt = nm.Checkpoint("good", 2)
    ckpt.save("model", model.state_dict())
    ckpt.save("optimizer", opt.state_dict())
    good = _clone(model.state_dict())
    nm.wait_staged()
    bad = nm.Checkpoint("torn", 2)
    bad.save("model", model.state_dict())
    bad.save("optimizer", opt.state_dict())
    with torch.no_grad():
        model[0].weight.add_(1)  # in place, outside optimizer.step(), before the copy
    with pytest.raises(nm.errors.TornCheckpointError, match=r"0\.weight") as info:
        nm.wait_staged()
    assert "torn" in str(info.value) and "'model'" in str(info.value)
    assert nm.get_checkpoint(tag="torn").tag == ""
    assert nm.get_latest_checkpoint().tag == "good"
    got = nm.get_latest_checkpoint().load("model")
    for name, t in good.items():
        assert torch.equal(got[name], t), name
    nm.flush_persistence()
    nm.api._reset_for_tests()
    assert [e["tag"] for e in nm.list_checkpoints(persist_path=store)] == ["good"]


def test_a_torn_checkpoint_is_reported_at_the_next_save_after_a_step(store):
    """The optimizer's barrier never raises inside step(); the next nebulite call does."""
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    nm.Checkpoint("torn").save("optimizer", opt.state_dict())
    state = opt.state[model[0].weight]
    state["exp_avg"].mul_(2)  # changes optimizer state in place before the copy
    _step(model, opt)  # the barrier runs here: the checkpoint fails, training goes on
    with pytest.raises(nm.errors.TornCheckpointError, match=r"state\.0\.exp_avg"):
        nm.Checkpoint("next").save("optimizer", opt.state_dict())
    nm.wait_staged()
    assert nm.get_latest_checkpoint().tag == ""


def test_a_tensor_given_another_storage_fails_the_checkpoint(store):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    state = model.state_dict()
    nm.Checkpoint("torn").save("model", state)
    with torch.no_grad():
        state["2.weight"].set_(torch.zeros_like(state["2.weight"]))  # its storage is replaced
    with pytest.raises(nm.errors.TornCheckpointError, match=r"2\.weight"):
        nm.wait_staged()
    assert nm.get_latest_checkpoint().tag == ""


def test_a_freed_storage_whose_address_is_reused_is_not_deferred(store):
    """Safe storages are known by identity: a buffer that lands at the address a freed
    optimizer-managed storage left behind is copied before save() returns."""
    import gc

    import numpy as np

    nm.init(persistent_storage_path=store, async_staging=True)
    memory = np.zeros(1 << 20, dtype=np.float32)  # 4 MiB that outlive the tensors on them
    p = torch.nn.Parameter(torch.from_numpy(memory))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()  # p's storage is known safe from now on
    assert flatten({"p": p.detach()}, tag="t", name="p", rank=0, version="v").deferred
    address = p.data_ptr()
    del p, opt
    gc.collect()  # the parameter's storage is freed; its address is free for another
    buffer = torch.from_numpy(memory)  # a new storage at the very same address
    assert buffer.data_ptr() == address
    records = flatten({"buffer": buffer}, tag="t", name="b", rank=0, version="v")
    assert not records.deferred


def test_safe_storages_are_known_by_identity_not_by_id(store):
    """The registry of safe storages drops a storage's entry when the storage goes, before
    its address can be another's; a storage it does not hold is not safe (neither for the
    scan nor for the walk)."""
    import gc

    nm.init(persistent_storage_path=store, async_staging=True)
    p = torch.nn.Parameter(torch.zeros(1024))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    opt.step()
    assert _staging.deferrable(p.untyped_storage(), p.nbytes)
    assert p.untyped_storage() in _staging._safe_storages
    assert len(_staging._safe_storages) == 1
    del p, opt
    gc.collect()
    assert len(_staging._safe_storages) == 0  # the storage's entry left with it

    other = torch.nn.Parameter(torch.zeros(1024))
    opt = torch.optim.SGD([other], lr=0.1)
    other.grad = torch.ones_like(other)
    opt.step()  # something is safe, so saves are scanned
    buffer = torch.ones(1024)
    assert buffer.untyped_storage() not in _staging._safe_storages
    assert not _staging.deferrable(buffer.untyped_storage(), buffer.nbytes)
    scanned = _staging.scan({"buffer": buffer, "other": other.detach()})
    assert scanned is not None
    assert id(buffer.untyped_storage()) not in scanned.deferred
    assert id(buffer.untyped_storage()) in scanned.copied
    assert id(other.untyped_storage()) in scanned.deferred
    assert not flatten({"buffer": buffer}, tag="t", name="b", rank=0, version="v").deferred


def test_the_safe_storages_registry_keeps_many_entries_and_drops_each():
    """Entries come and go in any order (the table grows and moves entries back as others
    leave): every live registered storage is found, and no freed one is."""
    import gc
    import random

    registry = _core.SafeStorages()
    tensors = [torch.zeros(4) for _ in range(3000)]
    for t in tensors:
        registry.remember([{"params": [t]}], {}, torch.Tensor)
    del t
    assert len(registry) == len(tensors)
    rng = random.Random(0)
    order = list(range(len(tensors)))
    rng.shuffle(order)
    for i in order[:2000]:
        tensors[i] = None
    gc.collect()
    assert len(registry) == 1000
    assert all(t.untyped_storage() in registry for t in tensors if t is not None)
    fresh = [torch.zeros(4) for _ in range(3000)]
    assert not any(t.untyped_storage() in registry for t in fresh)
    registry.remember([{"params": fresh[:500]}], {}, torch.Tensor)
    assert len(registry) == 1500
    registry.clear()
    assert len(registry) == 0
    del fresh, tensors
    gc.collect()  # the dropped entries' callbacks do not run
    assert len(registry) == 0


@pytest.mark.skipif(sys.version_info >= (3, 12),
                    reason="from Python 3.12 a collection starts at the interpreter's next check, "
                           "not inside the allocation that crosses the threshold")
def test_a_storage_registered_while_its_weak_reference_is_made_keeps_one_entry():
    """Making an entry's weak reference may run Python (a collection's callbacks, another
    thread) that registers the same storage first: one entry stays, with one reference.
    A collection is started at each allocation of the registration in turn (a threshold of
    n starts one at the n+1-th allocation after gc.collect())."""
    import gc
    import weakref

    t = torch.zeros(4)
    storage = t.untyped_storage()  # its Python object, made now, stays the same
    groups = [{"params": [t]}]
    threshold = gc.get_threshold()
    registered_inside = 0
    for n in range(1, 9):
        registry = _core.SafeStorages()
        inner: list[int] = []

        def during_collection(phase: str, info: dict) -> None:
            if phase == "start" and not inner:
                inner.append(len(registry))
                registry.remember(groups, {}, torch.Tensor)

        gc.collect()
        gc.callbacks.append(during_collection)
        gc.set_threshold(n)
        try:
            registry.remember(groups, {}, torch.Tensor)
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(during_collection)
        registered_inside += inner == [0]
        assert len(registry) == 1 and storage in registry, n
        assert weakref.getweakrefcount(storage) == 1, n
        registry.clear()
        assert weakref.getweakrefcount(storage) == 0, n
    assert registered_inside  # some collection ran inside the outer registration


def _registered(t: torch.Tensor) -> bool:
    return t.untyped_storage() in _staging._safe_storages


def test_the_safe_storages_follow_what_the_optimizer_manages(store):
    """Each step's pre-hook registers the storages of the optimizer's parameters and of its
    tensor state, keeps the entries it has (the same weak references), and adds the new
    storage of a parameter given one; empty state tensors and other devices' tensors are
    not registered."""
    nm.init(persistent_storage_path=store, async_staging=True)
    p = torch.nn.Parameter(torch.zeros(64))
    q = torch.nn.Parameter(torch.zeros(8))
    meta = torch.nn.Parameter(torch.zeros(8, device="meta"))
    opt = torch.optim.SGD([{"params": [p]}, {"params": (q, meta)}], lr=0.1, momentum=0.9)
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    opt.step()  # registers the parameters; the momentum buffers made by this step come next
    assert _registered(p) and _registered(q) and not _registered(meta)
    momentum = opt.state[p]["momentum_buffer"]
    assert not _registered(momentum)
    opt.state[p]["empty"] = torch.zeros(0)
    opt.state[p]["count"] = 3
    opt.step()
    assert _registered(momentum) and not _registered(opt.state[p]["empty"])
    known = len(_staging._safe_storages)
    opt.step()
    assert len(_staging._safe_storages) == known
    old = p.untyped_storage()
    p.data = torch.ones(64)
    assert not _registered(p)
    opt.step()
    assert _registered(p) and _staging.deferrable(old, old.nbytes())  # the old one still lives


def test_an_optimizer_over_a_tensor_without_storage_steps(store):
    """A sparse parameter has no storage to defer: the step goes on, and its saves copy it
    before save() returns."""
    nm.init(persistent_storage_path=store, async_staging=True)
    dense = torch.nn.Parameter(torch.zeros(16))
    sparse = torch.nn.Parameter(
        torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (16,),
                                check_invariants=True))
    opt = torch.optim.SGD([dense, sparse], lr=0.5)
    for _ in range(2):
        dense.grad = torch.ones_like(dense)
        opt.step()
    assert _registered(dense)
    ckpt = nm.Checkpoint("a")
    ckpt.save("state", {"dense": dense, "sparse": sparse})
    dense.grad = torch.ones_like(dense)
    opt.step()
    got = nm.get_checkpoint(tag="a").load("state")
    assert torch.equal(got["dense"], torch.full((16,), -1.0))
    assert torch.equal(got["sparse"].to_dense(), sparse.detach().to_dense())


def _walked_on(monkeypatch) -> set[int]:
    """The threads that walk saved objects from now on."""
    from nebulite import _plan

    threads: set[int] = set()
    walk = _plan.walk

    def recorded(obj):
        threads.add(threading.get_ident())
        return walk(obj)

    monkeypatch.setattr(_plan, "walk", recorded)
    return threads


def test_a_save_only_records_what_to_copy_on_the_callers_thread(store, monkeypatch):
    """The walk, the pickling and the staging run on the staging thread, behind the barrier."""
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    walked = _walked_on(monkeypatch)
    ckpt = nm.Checkpoint("a", 2)
    ckpt.save("model", model.state_dict())
    ckpt.save("optimizer", opt.state_dict())
    expected = _clone(model.state_dict())
    _step(model, opt)  # the barrier waits for the staging thread, then the step goes on
    assert walked and threading.get_ident() not in walked
    got = nm.get_checkpoint(tag="a").load("model")
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_containers_changed_after_save_leave_the_checkpoint_as_saved(store):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    state = {"model": model.state_dict(), "epoch": 3, "seen": [1, 2], "pair": (opt.state_dict(), 7)}
    expected = _clone(state["model"])
    ckpt = nm.Checkpoint("a", nm.COMMIT_EXPLICITLY)
    ckpt.save("state", state)
    state["epoch"] = 4
    state["seen"].append(3)
    state["model"]["extra"] = torch.ones(2)
    del state["model"]["0.weight"]
    ckpt.commit()  # the staging thread reads the object only now
    got = nm.get_checkpoint(tag="a").load("state", weights_only=False)
    assert got["epoch"] == 3 and got["seen"] == [1, 2] and got["pair"][1] == 7
    assert set(got["model"]) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got["model"][name], t), name


def test_ordered_dicts_and_containers_they_share_are_kept_as_saved(store):
    """A state_dict's order and `_metadata`, a list inside a tuple, and one list reached
    twice are the ones at save(), however they change before the staging thread reads them."""
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    sd = model.state_dict()
    order, metadata = list(sd), {k: dict(v) for k, v in sd._metadata.items()}
    expected = _clone(sd)
    shared = [1, 2]
    state = {"model": sd, "pair": ([5], "x"), "plain": (1, "a", torch.ones(2)),
             "first": shared, "again": shared}
    ckpt = nm.Checkpoint("a", nm.COMMIT_EXPLICITLY)
    ckpt.save("state", state)
    sd.move_to_end(order[0])
    sd["0.bias"] = torch.zeros(3)
    sd._metadata[""]["version"] = 99
    state["pair"][0].append(6)
    shared.append(3)
    ckpt.commit()  # the staging thread reads the object only now
    got = nm.get_checkpoint(tag="a").load("state", weights_only=False)
    assert list(got["model"]) == order
    assert {k: dict(v) for k, v in got["model"]._metadata.items()} == metadata
    for name, t in expected.items():
        assert torch.equal(got["model"][name], t), name
    assert got["pair"] == ([5], "x") and got["plain"][:2] == (1, "a")
    assert got["first"] == [1, 2] and got["first"] is got["again"]


def test_buffers_are_copied_at_save_and_their_layout_checked_later(store):
    """A buffer forward changes is copied before save() returns; one reshaped in place
    before the staging thread read the object's structure fails the checkpoint."""
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    bn = model[1]
    scanned = _staging.scan(model.state_dict())
    copied = {scanned.storages[i].data_ptr() for i in scanned.copied}
    assert bn.running_mean.untyped_storage().data_ptr() in copied
    assert model[0].weight.untyped_storage().data_ptr() not in copied
    saved_mean = bn.running_mean.clone()
    ckpt = nm.Checkpoint("changed", nm.COMMIT_EXPLICITLY)
    ckpt.save("model", model.state_dict())
    bn.running_mean.add_(1)  # as forward does: the checkpoint keeps the value at save()
    ckpt.commit()
    nm.wait_staged()
    assert torch.equal(nm.get_checkpoint(tag="changed").load("model")["1.running_mean"], saved_mean)
    grid = {"grid": torch.arange(6.0).reshape(2, 3)}
    ckpt = nm.Checkpoint("reshaped", nm.COMMIT_EXPLICITLY)
    ckpt.save("grid", grid)
    grid["grid"].t_()
    ckpt.commit()
    with pytest.raises(nm.errors.TornCheckpointError, match=r"'grid' was reshaped in place"):
        nm.wait_staged()
    assert nm.get_checkpoint(tag="reshaped").tag == ""
    assert nm.get_latest_checkpoint().tag == "changed"


class Custom:
    """An object whose class pickles it its own way: never scanned."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> tuple:
        return Custom, (self.t,)


class Scaler:
    """An object that pickles as object's default does (as DeepSpeed's LossScaler)."""

    def __init__(self, scale: object) -> None:
        self.cur_scale = scale
        self.history = [scale]
        self.owner = self  # a cycle


@dataclasses.dataclass
class Address:
    """A dataclass (as DeepSpeed's fragment_address)."""

    numel: int
    start: int


class Stage(enum.IntEnum):
    ONE = 1


class Slotted:
    __slots__ = ("x",)

    def __init__(self, x: int) -> None:
        self.x = x


class Single:
    """One instance only: a copy made as unpickling makes it would be the instance."""

    _it: "Single | None" = None

    def __new__(cls) -> "Single":
        if cls._it is None:
            cls._it = super().__new__(cls)
        return cls._it


class OwnState:
    def __init__(self) -> None:
        self.x = 1

    def __getstate__(self) -> dict:
        return {"x": self.x}


def test_objects_sets_and_enum_members_are_scanned_as_they_were_at_save(store, monkeypatch):
    """Instances of classes that pickle as object's default does are copied at save() with
    their attributes, sets too: the checkpoint holds them as they were, whatever changes
    them before the next optimizer step; their tensors are recorded like any other."""
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    scaler = Scaler(2.0)
    obj = {"scaler": scaler, "map": {"w": Address(3, 0)}, "stage": Stage.ONE,
           "names": {"a", "b"}, "frozen": frozenset({1, (2, "x")}), "optimizer": opt.state_dict(),
           "holder": Scaler(torch.ones(2))}
    scanned = _staging.scan(obj)
    assert scanned is not None
    copy = scanned.obj
    assert copy["scaler"] is not scaler and copy["scaler"].owner is copy["scaler"]
    assert copy["scaler"].history is not scaler.history
    assert copy["names"] == obj["names"] and copy["names"] is not obj["names"]
    assert copy["frozen"] is obj["frozen"] and copy["stage"] is Stage.ONE
    for refused in (Slotted(1), OwnState(), Custom(torch.ones(1)), Address, Single()):
        assert _staging.scan({"x": refused}) is None, refused
    walked = _walked_on(monkeypatch)
    exp_avg = obj["optimizer"]["state"][0]["exp_avg"].clone()
    nm.Checkpoint("objects").save("state", obj)
    assert threading.get_ident() not in walked  # left to the staging thread
    scaler.cur_scale = 4.0
    scaler.history.append(4.0)
    obj["map"]["w"].start = 7
    obj["names"].add("c")
    obj["holder"].cur_scale.add_(1)  # not an optimizer's: its bytes were copied at save()
    _step(model, opt)  # the barrier: staged and committed
    got = nm.get_checkpoint(tag="objects").load("state", weights_only=False)
    assert got["scaler"].cur_scale == 2.0 and got["scaler"].history == [2.0]
    assert got["scaler"].owner is got["scaler"] and type(got["scaler"]) is Scaler
    assert got["map"]["w"] == Address(3, 0) and got["stage"] is Stage.ONE
    assert got["names"] == {"a", "b"} and got["frozen"] == frozenset({1, (2, "x")})
    assert torch.equal(got["holder"].cur_scale, torch.ones(2))
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], exp_avg)  # before the step


def test_a_torn_tensor_inside_an_object_is_named_by_its_attribute(store):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    nm.Checkpoint("held").save("state", {"scaler": Scaler(model[0].weight)})
    with torch.no_grad():
        model[0].weight.add_(1)  # a deferred storage, changed before the barrier
    with pytest.raises(nm.errors.TornCheckpointError, match=r"'scaler\.cur_scale' was changed"):
        nm.wait_staged()


def test_objects_the_scan_does_not_take_are_staged_on_the_callers_thread(store, monkeypatch):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    assert _staging.scan({"c": Custom(torch.ones(2))}) is None
    tagged = torch.ones(2)
    tagged.owner = torch.zeros(1)  # an attribute of its own: pickled with it by torch
    assert _staging.scan({"t": tagged}) is None
    # a tensor off the CPU that no optimizer manages (a CUDA buffer is one)
    assert _staging.scan({"m": model.state_dict(), "x": torch.zeros(2, device="meta")}) is None
    scanned = _staging.scan({"m": model.state_dict()})
    assert scanned is not None and scanned.devices == []  # no device to mark
    monkeypatch.setattr(_staging, "MAX_COPIED_BYTES", 1024)  # the buffers alone are more
    assert _staging.scan({"m": model.state_dict()}) is None
    monkeypatch.undo()
    walked = _walked_on(monkeypatch)
    ckpt = nm.Checkpoint("a", 2)
    ckpt.save("custom", {"c": Custom(model[0].weight.detach())})
    assert threading.get_ident() in walked  # staged before save() returned
    ckpt.save("model", model.state_dict())
    expected = _clone(model.state_dict())
    _step(model, opt)
    got = nm.get_checkpoint(tag="a")
    assert torch.equal(got.load("custom", weights_only=False)["c"].t, expected["0.weight"])
    assert list(got.list_names()) == ["custom", "model"]


def test_a_failure_on_the_staging_thread_fails_that_checkpoint_only(store, monkeypatch):
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    nm.Checkpoint("good").save("model", model.state_dict())
    nm.wait_staged()
    caller = threading.get_ident()
    flatten_ = nm.api.flatten

    def failing(*args, **kwargs):
        if threading.get_ident() != caller:
            raise RuntimeError("no memory left for the skeleton")
        return flatten_(*args, **kwargs)

    monkeypatch.setattr(nm.api, "flatten", failing)
    nm.Checkpoint("bad").save("model", model.state_dict())
    _step(model, opt)  # the barrier never raises in step()
    monkeypatch.undo()
    with pytest.raises(nm.errors.PersistError, match="no memory left for the skeleton"):
        nm.Checkpoint("next").save("model", model.state_dict())
    nm.wait_staged()
    assert nm.get_checkpoint(tag="bad").tag == ""
    assert nm.get_latest_checkpoint().tag == "good"


@pytest.mark.parametrize("commit", ["by_num_files", "explicit_after_step"])
def test_an_object_the_staging_thread_streams_has_its_checkpoint_persisted(store, commit):
    """With the memory tier full of a checkpoint kept in memory only, an object staged after
    save() returned goes straight to the store (streamed): its checkpoint is committed and
    persisted (at the barrier, or by a commit() after it), as a synchronous save's is, and
    step() raises nothing."""
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weight, 4 MiB of momentum
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> None:
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()

    # Room for one checkpoint and half; the first is persisted (due), the rest are not.
    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=3600,
            memory_buffer_size=12 << 20, num_of_version_in_retention=5)
    step()
    saved = {}
    for i in range(4):
        ck = nm.Checkpoint(f"c{i}", num_files=2 if commit == "by_num_files" else -2)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        saved[f"c{i}"] = _clone(model.state_dict())
        step()  # the barrier commits what the staging thread staged, streamed or not
        if commit == "explicit_after_step":
            assert ck.commit() is True
    nm.flush_persistence()
    assert nm.get_latest_checkpoint().tag == "c3"
    kept = [e["tag"] for e in nm.list_checkpoints()]
    for tag in kept:  # (memory-only ones make room for newer ones)
        got = nm.get_checkpoint(tag=tag).load("model")
        for name, t in saved[tag].items():
            assert torch.equal(got[name], t), (tag, name)
    nm.api._reset_for_tests()
    persisted = {e["tag"] for e in nm.list_checkpoints(persist_path=store)}
    assert persisted - {"c0"}, persisted  # a streamed one, beside the first (due)


def test_a_commit_that_fails_at_the_barrier_fails_that_checkpoint_only(store, monkeypatch):
    """The barrier commits what it waited for; a commit the engine refuses there fails that
    checkpoint (the next call raises why) and neither raises inside step() nor holds back
    the commits after it."""
    nm.init(persistent_storage_path=store, async_staging=True)
    model, opt = _stepped_model()
    s = nm.api._session

    class Refusing:
        """The session's engine, refusing to commit the checkpoint 'bad'."""

        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def commit(self, tag, *args):
            if tag == "bad":
                raise nm.errors.FailedPreconditionError("the engine refused it")
            return self._engine.commit(tag, *args)

    monkeypatch.setattr(s, "engine", Refusing(s.engine))
    nm.Checkpoint("bad").save("model", model.state_dict())
    nm.Checkpoint("good").save("model", model.state_dict())
    good = _clone(model.state_dict())
    _step(model, opt)  # the barrier commits both, or tries to
    with pytest.raises(nm.errors.PersistError, match="the engine refused it"):
        nm.Checkpoint("next").save("model", model.state_dict())
    assert nm.get_checkpoint(tag="bad").tag == ""
    got = nm.get_checkpoint(tag="good").load("model")
    for name, t in good.items():
        assert torch.equal(got[name], t), name
    monkeypatch.undo()


@pytest.mark.parametrize("also", ["nothing", "an_object_staged_on_the_callers_thread"])
def test_the_commit_asks_the_engine_whether_to_persist_only_what_it_alone_knows(store, also):
    """A checkpoint whose objects all wait for the staging thread is committed by the
    barrier, which learns itself whether one went to the store (see the test above): its
    commit asks the engine nothing (an agent's answer is a round trip on the caller's
    thread). An object staged before save() returned is the engine's to know of."""
    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=3600)
    model, opt = _stepped_model()
    nm.Checkpoint("first").save("model", model.state_dict())  # persisted: due
    _step(model, opt)
    s = nm.api._session
    asked = []

    class Recording:
        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            asked.append(name)
            return getattr(self._engine, name)

    s.engine = Recording(s.engine)
    try:
        ck = nm.Checkpoint("second", num_files=3 if also == "nothing" else 4)
        ck.save("model", model.state_dict())
        ck.save("optimizer", opt.state_dict())
        if also != "nothing":
            ck.save("custom", {"c": Custom(torch.ones(2))})  # the scan does not take it
        ck.save("meta", {"step": 2})
        assert ("must_persist" in asked) == (also != "nothing"), asked
        expected = _clone(model.state_dict())
        _step(model, opt)  # the barrier commits it
    finally:
        s.engine = s.engine._engine
    got = nm.get_checkpoint(tag="second")
    for name, t in expected.items():
        assert torch.equal(got.load("model")[name], t), name
    assert got.load("meta") == {"step": 2}


def test_a_background_failure_is_raised_by_the_first_save_of_the_next_checkpoint(store):
    """What failed while persisting is raised by the next checkpoint's first save, which then
    stages nothing; the checkpoint after it is saved whole."""
    nm.init(persistent_storage_path=store, async_staging=True, persistent_time_interval=0)
    model, opt = _stepped_model()
    with open(os.path.join(store, "bad"), "w") as f:  # where its folder would go
        f.write("in the way")
    nm.Checkpoint("bad").save("model", model.state_dict())
    _step(model, opt)
    deadline = time.monotonic() + 60
    while not any(r["tag"] == "bad" and r["outcome"].startswith("failed") for r in nm.history()):
        assert time.monotonic() < deadline, nm.history()
        time.sleep(0.05)
    with pytest.raises(nm.errors.PersistError, match="bad"):
        nm.Checkpoint("next").save("model", model.state_dict())
    assert nm.api._session.pending == []  # nothing of it is staged
    ck = nm.Checkpoint("next", num_files=2)
    ck.save("model", model.state_dict())
    ck.save("optimizer", opt.state_dict())
    expected = _clone(model.state_dict())
    _step(model, opt)
    got = nm.get_latest_checkpoint()
    assert got.tag == "next" and got.list_names() == ["model", "optimizer"]
    for name, t in expected.items():
        assert torch.equal(got.load("model")[name], t), name
