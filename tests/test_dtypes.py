"""Round trips through both tiers: every CPU dtype, views, layouts, nested objects."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nebulite
import nebulite.api


def _round_trip(store, obj, *, weights_only=True):
    """Saves `obj`, returns (loaded from memory, loaded from the store in a fresh session)."""
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("rt").save("obj", obj)
    latest = nebulite.get_latest_checkpoint()
    assert latest.tag == "rt"
    from_memory = latest.load("obj", weights_only=weights_only)
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    assert stored.tag == "rt"
    from_store = stored.load("obj", weights_only=weights_only)
    return from_memory, from_store


def _assert_tensor_equal(a: torch.Tensor, b: torch.Tensor, *, same_layout: bool = True) -> None:
    assert isinstance(a, torch.Tensor)
    assert type(a) is type(b)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.device == b.device
    assert a.requires_grad == b.requires_grad
    if same_layout:
        assert a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
    if a.dtype.is_floating_point and a.element_size() == 1:
        # float8 has no torch.equal kernel on every build: compare the bits.
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    else:
        assert torch.equal(a.detach(), b.detach())


def _assert_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        _assert_tensor_equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b)
        assert list(a) == list(b)
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b)
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_equal(x, y)
    else:
        assert a == b and type(a) is type(b)


# -- dtypes -------------------------------------------------------------------------

_DTYPE_NAMES = [
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "complex64", "complex128",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
]
DTYPES = [getattr(torch, n) for n in _DTYPE_NAMES if hasattr(torch, n)]


def _sample(dtype: torch.dtype, shape=(5, 7), seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        if dtype.itemsize == 1:
            # Arbitrary bit patterns (NaNs included) must survive bit-exactly.
            return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    bits = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return bits.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_round_trip(store, dtype):
    t = _sample(dtype)
    obj = {"t": t, "scalar": _sample(dtype, ()), "vec": _sample(dtype, (3,))}
    for loaded in _round_trip(store, obj):
        _assert_tensor_equal(loaded["t"], t)
        _assert_tensor_equal(loaded["scalar"], obj["scalar"])
        _assert_tensor_equal(loaded["vec"], obj["vec"])
        assert loaded["t"].is_contiguous()


def test_all_dtypes_in_one_object(store):
    obj = {str(d): _sample(d, (2, 3)) for d in DTYPES}
    for loaded in _round_trip(store, obj):
        _assert_equal(loaded, obj)


def test_special_float_values(store):
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, 3.4e38])
    for loaded in _round_trip(store, {"t": t, "h": t.half(), "b": t.bfloat16(), "d": t.double()}):
        for key, ref in (("t", t), ("h", t.half()), ("b", t.bfloat16()), ("d", t.double())):
            out = loaded[key]
            assert out.dtype == ref.dtype
            # bit-exact (NaN payloads, signed zero)
            width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
            assert torch.equal(out.view(width), ref.view(width))


# -- storage sharing and layouts ---------------------------------------------------------


def test_views_keep_sharing_storage(store):
    base = torch.arange(24, dtype=torch.float32)
    obj = {
        "base": base,
        "view": base.view(4, 6),
        "slice": base[5:17],
        "transposed": base.view(4, 6).t(),
        "other": torch.ones(3),
    }
    for loaded in _round_trip(store, obj):
        ptr = loaded["base"].untyped_storage().data_ptr()
        for key in ("view", "slice", "transposed"):
            assert loaded[key].untyped_storage().data_ptr() == ptr
            _assert_tensor_equal(loaded[key], obj[key])
        assert loaded["other"].untyped_storage().data_ptr() != ptr
        assert loaded["slice"].storage_offset() == 5
        # Writes through one view show through the others.
        loaded["base"][5] = -1.0
        assert loaded["slice"][0].item() == -1.0
        assert loaded["view"][0, 5].item() == -1.0


def test_shared_storage_across_list_and_dict(store):
    base = torch.randn(10, 10)
    obj = {"a": [base, base[2]], "b": (base.t(),), "c": base}
    for loaded in _round_trip(store, obj):
        ptr = loaded["c"].untyped_storage().data_ptr()
        assert loaded["a"][0].untyped_storage().data_ptr() == ptr
        assert loaded["a"][1].untyped_storage().data_ptr() == ptr
        assert loaded["b"][0].untyped_storage().data_ptr() == ptr
        assert loaded["a"][0] is loaded["c"]  # the same tensor object saved twice
        _assert_equal(loaded, obj)


def test_non_contiguous_tensors(store):
    m = torch.randn(8, 6, dtype=torch.float64)
    obj = {
        "t": m.t(),
        "strided": m[::2, 1::3],
        "neg_dims": m.unsqueeze(0).expand(3, 8, 6),
        "permuted": torch.randn(2, 3, 4).permute(2, 0, 1),
        "channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "int_strided": torch.arange(100, dtype=torch.int32)[3:90:7],
    }
    for loaded in _round_trip(store, obj):
        for key, ref in obj.items():
            _assert_tensor_equal(loaded[key], ref)
        assert not loaded["t"].is_contiguous()
        assert loaded["channels_last"].is_contiguous(memory_format=torch.channels_last)


def test_zero_dim_and_empty(store):
    obj = {
        "scalar": torch.tensor(3.5),
        "int_scalar": torch.tensor(-7, dtype=torch.int64),
        "bool_scalar": torch.tensor(True),
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0, dtype=torch.int16),
        "empty_bf16": torch.zeros(0, 4, dtype=torch.bfloat16),
    }
    for loaded in _round_trip(store, obj):
        _assert_equal(loaded, obj)
        assert loaded["scalar"].dim() == 0
        assert loaded["empty2d"].shape == (3, 0)


def test_only_empty_tensors(store):
    obj = [torch.empty(0), torch.empty(0, 3)]
    for loaded in _round_trip(store, obj):
        _assert_equal(loaded, obj)


def test_object_without_tensors(store):
    obj = {"epoch": 3, "lr": 0.1, "name": "run", "none": None, "list": [1, 2, (3, "x")]}
    for loaded in _round_trip(store, obj):
        assert loaded == obj


def test_nested_containers(store):
    obj = {
        "ints": [1, 2, 3],
        "strings": ("a", "bé", ""),
        "none": None,
        "float": 1.25,
        "bool": False,
        "bytes": b"\x00\x01",
        "nested": {"deep": [{"x": torch.ones(2)}, (torch.zeros(1, dtype=torch.int8), None)]},
        "ordered": collections.OrderedDict([("b", torch.tensor([1])), ("a", 2)]),
        1: "int key",
        (1, 2): "tuple key",
    }
    for loaded in _round_trip(store, obj):
        _assert_equal(loaded, obj)


# -- real training state ---------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 5)
        self.bn = torch.nn.BatchNorm1d(5)
        self.fc2 = torch.nn.Linear(5, 2)
        self.register_buffer("counter", torch.tensor([3], dtype=torch.int64))

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def test_module_and_optimizer_state(store):
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(4, 6)).sum().backward()
        opt.step()
    model_sd, opt_sd = net.state_dict(), opt.state_dict()
    assert "bn.num_batches_tracked" in model_sd and "counter" in model_sd

    nebulite.init(persistent_storage_path=store)
    ckpt = nebulite.Checkpoint("train", num_files=2)
    ckpt.save("model", model_sd)
    ckpt.save("optimizer", opt_sd)
    latest = nebulite.get_latest_checkpoint()
    results = [(latest.load("model"), latest.load("optimizer"))]
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    results.append((stored.load("model"), stored.load("optimizer")))

    for m, o in results:
        _assert_equal(m, model_sd)
        _assert_equal(o, opt_sd)
        assert o["state"][0]["step"].item() == 2
        net2 = _Net()
        net2.load_state_dict(m)
        opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-2)
        opt2.load_state_dict(o)
        for p, q in zip(net.parameters(), net2.parameters()):
            assert torch.equal(p, q)


def test_large_tensor(store):
    big = torch.randn(5 * 1024 * 1024)  # 20 MiB
    big[-1] = 42.0
    for loaded in _round_trip(store, {"big": big, "small": torch.ones(3)}):
        _assert_tensor_equal(loaded["big"], big)
        assert loaded["big"][-1].item() == 42.0


def test_odd_sized_tensor(store):
    t = torch.randint(0, 255, (4096 * 3 + 17,), dtype=torch.uint8)
    for loaded in _round_trip(store, t):
        _assert_tensor_equal(loaded, t)


def test_many_small_tensors(store):
    obj = {f"p{i}": torch.full((i % 7 + 1,), float(i)) for i in range(1000)}
    for loaded in _round_trip(store, obj):
        assert len(loaded) == 1000
        for k in ("p0", "p1", "p500", "p999"):
            _assert_tensor_equal(loaded[k], obj[k])
        assert all(torch.equal(loaded[k], v) for k, v in obj.items())


def test_parameter_round_trip(store):
    p = torch.nn.Parameter(torch.randn(3, 4))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    grad_tensor = torch.randn(5, requires_grad=True)
    obj = {"p": p, "frozen": frozen, "leaf": grad_tensor}
    for loaded in _round_trip(store, obj):
        assert isinstance(loaded["p"], torch.nn.Parameter)
        assert loaded["p"].requires_grad
        assert torch.equal(loaded["p"].detach(), p.detach())
        assert isinstance(loaded["frozen"], torch.nn.Parameter)
        assert not loaded["frozen"].requires_grad
        assert loaded["leaf"].requires_grad
        assert torch.equal(loaded["leaf"].detach(), grad_tensor.detach())


def test_saved_tensor_is_snapshot(store):
    """save() returns once the bytes are copied: later in-place changes don't leak in."""
    t = torch.zeros(1000)
    nebulite.init(persistent_storage_path=store)
    nebulite.Checkpoint("snap").save("obj", {"t": t})
    t.fill_(7.0)
    assert torch.equal(nebulite.get_latest_checkpoint().load("obj")["t"], torch.zeros(1000))
    nebulite.flush_persistence()
    nebulite.api._reset_for_tests()
    stored = nebulite.get_latest_checkpoint(persist_path=store)
    assert torch.equal(stored.load("obj")["t"], torch.zeros(1000))


# -- property test ---------------------------------------------------------------------

_PROP_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]


@st.composite
def _tensors(draw):
    dtype = draw(st.sampled_from(_PROP_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    t = _sample(dtype, shape, seed)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]
    return t


_leaves = st.one_of(
    _tensors(),
    st.integers(-(2**40), 2**40),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
)
_nested = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.tuples(children, children),
        st.dictionaries(st.text(min_size=1, max_size=6), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(obj=_nested)
def test_property_random_nested_round_trip(tmp_path_factory, obj):
    store = str(tmp_path_factory.mktemp("prop") / "ckpt")
    try:
        for loaded in _round_trip(store, obj):
            _assert_equal(loaded, obj)
    finally:
        nebulite.api._reset_for_tests()
