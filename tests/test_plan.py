"""Saves of an object of the same structure reuse its flattening (nebulite._plan); what
they save is always the object as it is."""

from __future__ import annotations

import collections

import pytest
import torch

import nebulite as nm
from nebulite import _plan


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
