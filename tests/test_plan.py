"""Saves of an object of the same structure reuse its flattening (nebulite._plan); what
they save is always the object as it is."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nebulite as nm
from nebulite import _plan

Tensor, Parameter, strided = torch.Tensor, torch.nn.Parameter, torch.strided
OrderedDict, NoneType = collections.OrderedDict, type(None)


def _state(scale: float) -> dict:
    base = torch.arange(64, dtype=torch.float32) * scale
    return {
        "model": collections.OrderedDict(w=base.view(8, 8), t=base.view(8, 8).t(), b=base[8:16]),
        "half": torch.ones(3, dtype=torch.float16) * scale,
        "groups": [{"lr": 0.1 * scale, "betas": (0.9, 0.999), "params": [0, 1], "flag": True}],
        "step": int(scale),
    }


def _roundtrip(tag: str, obj: dict) -> dict:
    nm.Checkpoint(tag).save("state", obj)
    return nm.get_checkpoint(tag=tag).load("state")


def _assert_same(got: dict, want: dict) -> None:
    assert got["groups"] == want["groups"] and got["step"] == want["step"]
    assert torch.equal(got["half"], want["half"]) and got["half"].dtype == torch.float16
    for k, t in want["model"].items():
        assert torch.equal(got["model"][k], t) and got["model"][k].stride() == t.stride(), k
    # views still share one storage
    assert got["model"]["w"].untyped_storage().data_ptr() == got["model"]["b"].untyped_storage().data_ptr()


# What nebulite._core.walk computes, written out in Python: the reference it is checked
# against, object by object.
def _reference_walk(obj: Any) -> _plan.Structure:
    out: list[Any] = []
    put = out.append
    storages: dict[torch.UntypedStorage, int] = {}
    views: dict[int, list[tuple[torch.Tensor, int]]] = {}
    sizes: list[int] = []  # of each storage
    seen: dict[int, int] = {}  # id of a container or tensor met already -> its order
    keyed = True

    def visit(x: Any, depth: int) -> None:
        nonlocal keyed
        t = type(x)
        if t is Tensor or t is Parameter or isinstance(x, Tensor):  # the most frequent first
            if id(x) in seen:  # the pickler writes a reference to it
                put(("again", seen[id(x)]))
                return
            seen[id(x)] = len(seen)
            if x.layout is not strided or x.is_meta:
                keyed = False
                return
            s = x.untyped_storage()
            j = storages.get(s)
            if j is None:
                j = storages[s] = len(storages)
                sizes.append(s.nbytes())
                views[id(s)] = []
            views[id(s)].append((x, x._version))
            cpu = x.is_cpu
            if (t is not Tensor and t is not Parameter) or not (cpu or x.is_cuda) \
                    or x.__dict__ or x._backward_hooks or x.is_quantized or x.is_conj() \
                    or x.is_neg():
                keyed = False
                return
            put((t, x.dtype, x.shape, x.stride(), x.storage_offset(), x.requires_grad, j,
                 sizes[j]) if cpu else (t, x.device, x.dtype, x.shape, x.stride(),
                                        x.storage_offset(), x.requires_grad, j, sizes[j]))
            return
        if t is str or t is int or t is bool or t is NoneType or t is bytes:
            put(t)
            put(x)
            return
        if t is float:
            put(t)
            put(x.hex())  # -0.0 and 0.0 pickle differently; NaN never equals itself
            return
        if (t is dict or t is OrderedDict or t is list or t is tuple) and depth < _plan.MAX_DEPTH:
            if id(x) in seen:
                put(("again", seen[id(x)]))
                return
            seen[id(x)] = len(seen)
            put(t)
            put(len(x))
            if t is dict or t is OrderedDict:
                for k, v in x.items():
                    visit(k, depth + 1)
                    visit(v, depth + 1)
            else:
                for v in x:
                    visit(v, depth + 1)
            return
        keyed = False  # anything else: its own reduction decides what is pickled

    visit(obj, 0)
    return _plan.Structure(tuple(out) if keyed else None, list(storages), views)


class _Sub(torch.Tensor):
    pass


def _leaves(draw: Any, pool: list[torch.Tensor]) -> Any:
    kind = draw(st.integers(0, 12))
    base = pool[draw(st.integers(0, len(pool) - 1))]
    if kind == 0:
        return base
    if kind == 1:
        return base[1:]
    if kind == 2:
        return base.view(-1)[::2] if base.numel() > 1 else base
    if kind == 3:
        return torch.nn.Parameter(base.detach().clone(), requires_grad=draw(st.booleans()))
    if kind == 4:
        return base.detach().clone().as_subclass(_Sub)
    if kind == 5:
        return draw(st.one_of(st.integers(), st.booleans(), st.none(), st.text(max_size=3),
                              st.binary(max_size=3)))
    if kind == 6:
        return draw(st.floats(allow_nan=True))
    if kind == 7:
        return base.to(draw(st.sampled_from([torch.float16, torch.int64, torch.bool])))
    if kind == 8:
        t = base.detach().clone()
        t.tag = "own attribute"
        return t
    if kind == 9:
        return torch.zeros(2, 2).to_sparse()
    if kind == 10:
        return object()
    if kind == 11:
        return torch.empty(3, device="meta")
    return base.t() if base.dim() == 2 else base


@st.composite
def _objects(draw: Any) -> Any:
    pool = [torch.arange(12, dtype=torch.float32).view(3, 4), torch.ones(5), torch.zeros(0)]
    shared: list[Any] = []

    def node(depth: int) -> Any:
        if shared and draw(st.integers(0, 9)) == 0:
            return shared[draw(st.integers(0, len(shared) - 1))]  # met again
        if depth > 3 or draw(st.integers(0, 2)) == 0:
            return _leaves(draw, pool)
        kind = draw(st.sampled_from(["dict", "odict", "list", "tuple"]))
        n = draw(st.integers(0, 4))
        if kind in ("dict", "odict"):
            d: Any = {} if kind == "dict" else OrderedDict()
            for i in range(n):
                d[draw(st.sampled_from([f"k{i}", i, (i, "t")]))] = node(depth + 1)
            if kind == "odict" and n > 1 and draw(st.booleans()):
                d.move_to_end(next(iter(d)))  # an order of its own, not the dict's
            out = d
        else:
            items = [node(depth + 1) for _ in range(n)]
            out = items if kind == "list" else tuple(items)
        shared.append(out)
        return out

    return node(0)


def _same_views(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(
        [(id(t), v) for t, v in got[k]] == [(id(t), v) for t, v in want[k]] for k in want)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_objects())
def test_the_walk_finds_what_the_reference_walk_finds(obj):
    got, want = _plan.walk(obj), _reference_walk(obj)
    assert got.key == want.key
    assert [id(s) for s in got.storages] == [id(s) for s in want.storages]
    assert _same_views(got.views, want.views)


def test_the_walk_stops_at_its_depth_and_raises_what_an_attribute_raises():
    deep: Any = torch.ones(1)
    for _ in range(_plan.MAX_DEPTH + 2):
        deep = [deep]
    got, want = _plan.walk(deep), _reference_walk(deep)
    assert got.key is None and want.key is None and got.storages == want.storages == []

    class Broken(torch.Tensor):
        @property
        def layout(self):  # type: ignore[override]
            raise RuntimeError("no layout here")

    with pytest.raises(RuntimeError, match="no layout here"):
        _plan.walk({"x": torch.ones(2).as_subclass(Broken)})


def test_a_second_save_of_a_structure_reuses_its_plan_and_saves_the_new_values(store):
    nm.init(persistent_storage_path=store, agent=False)
    _plan.forget()
    first = _state(1.0)
    _assert_same(_roundtrip("a", first), first)
    key = _plan.walk(first).key
    assert key is not None and _plan.find("state", key) is not None
    second = _state(2.0)  # same structure, other tensor bytes and scalars
    assert _plan.walk(second).key != key  # the scalars are part of the key
    third = _state(2.0)
    assert _plan.walk(third).key == _plan.walk(second).key
    _assert_same(_roundtrip("b", second), second)
    with torch.no_grad():
        third["model"]["w"].add_(5)  # only bytes differ from `second`: its plan is reused
    assert _plan.find("state", _plan.walk(third).key) is not None
    _assert_same(_roundtrip("c", third), third)
    nm.flush_persistence()
    nm.api._reset_for_tests()
    _assert_same(nm.get_checkpoint(tag="c", persist_path=store).load("state"), third)


@pytest.mark.parametrize("change", ["dtype", "shape", "sharing", "zero sign", "bool for int", "again"])
def test_any_change_that_pickles_differently_changes_the_key(change):
    a = torch.zeros(4)
    one = {"x": a, "y": a[:2], "z": 0.0, "n": 1, "l": [1]}
    other = dict(one)
    if change == "dtype":
        other["x"] = a.double()
    elif change == "shape":
        other["x"] = a.view(2, 2)
    elif change == "sharing":
        other["y"] = a[:2].clone()
    elif change == "zero sign":
        other["z"] = -0.0
    elif change == "bool for int":
        other["n"] = True
    else:
        other["m"] = other["l"]  # the same list twice pickles as a reference
        one["m"] = [1]
    assert _plan.walk(one).key != _plan.walk(other).key


def test_objects_outside_the_plain_types_have_no_key():
    class Box:
        def __init__(self) -> None:
            self.t = torch.zeros(2)

    assert _plan.walk({"box": Box()}).key is None
    p = torch.zeros(2)
    p.note = "mine"  # an attribute of its own is pickled with it
    assert _plan.walk({"p": p}).key is None
    assert _plan.walk({"p": torch.zeros(2).to_sparse()}).key is None
    assert _plan.walk({"c": torch.zeros(2, dtype=torch.complex64).conj()}).key is None
    assert _plan.walk({"q": torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8)}).key is None
