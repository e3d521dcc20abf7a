"""The states the suite saves: synthetic state dicts and GPT-2 with its AdamW state.

Every workload is built the same way in every process that builds it (fixed seeds), so
that each candidate saves exactly the same bytes. A state is a dict of top-level objects
(``model``, ``optimizer``, ``meta``): torch.save and DCP save the whole dict, nebulite saves
each top-level object under its own name in one checkpoint, as a training script would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "synthetic" or "gpt2"
    description: str
    target_bytes: int = 0  # synthetic: the state's size
    n_layer: int = 0  # gpt2
    n_embd: int = 0
    n_head: int = 0
    vocab_size: int = 50257
    n_positions: int = 1024
    smoke: bool = False  # only for the smoke test


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("syn-256m", "synthetic", "synthetic state dict, 256 MiB", target_bytes=256 * MiB),
        Workload("syn-1g", "synthetic", "synthetic state dict, 1 GiB", target_bytes=GiB),
        Workload("syn-4g", "synthetic", "synthetic state dict, 4 GiB", target_bytes=4 * GiB),
        Workload("gpt2-124m", "gpt2", "GPT-2 124M + AdamW state", n_layer=12, n_embd=768, n_head=12),
        Workload("gpt2-355m", "gpt2", "GPT-2 355M + AdamW state", n_layer=24, n_embd=1024, n_head=16),
        # Tiny workloads for the smoke test: the same code paths in seconds.
        Workload("syn-tiny", "synthetic", "synthetic state dict, 8 MiB", target_bytes=8 * MiB, smoke=True),
        Workload("gpt2-tiny", "gpt2", "GPT-2 tiny (2 layers, d=128) + AdamW state", n_layer=2,
                 n_embd=128, n_head=4, vocab_size=1024, n_positions=64, smoke=True),
    ]
}

DEFAULT_WORKLOADS = ["syn-256m", "syn-1g", "syn-4g", "gpt2-124m", "gpt2-355m"]
QUICK_WORKLOADS = ["syn-256m", "gpt2-124m"]


def get(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise SystemExit(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}") from None


# --------------------------------------------------------------------------- synthetic


# The dtypes of the model's layers, in turn: a state dict as mixed-precision training and
# partially quantised fine-tuning leave it (the optimizer state is float32 throughout).
_LAYER_DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float16]


def _layer_shapes(d: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of one transformer block of width d (12 d^2 + 13 d values)."""
    return [
        ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
        ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
        ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
        ("mlp.fc.weight", (4 * d, d)), ("mlp.fc.bias", (4 * d,)),
        ("mlp.proj.weight", (d, 4 * d)), ("mlp.proj.bias", (d,)),
    ]


def _width(nbytes: int) -> int:
    if nbytes <= 64 * MiB:
        return 128
    if nbytes <= 512 * MiB:
        return 512
    if nbytes <= 2 * GiB:
        return 768
    return 1024


def _fill(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if t.dtype.is_floating_point:
        t.normal_(0.0, 0.02, generator=g)
    elif t.dtype == torch.bool:
        t.copy_(torch.randint(0, 2, t.shape, generator=g, dtype=torch.uint8).bool())
    else:
        t.random_(0, 127, generator=g)
    return t


def synthetic_state(nbytes: int, seed: int = 0) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """A state dict of about `nbytes` shaped like a transformer's with its AdamW state:
    parameters of many sizes (biases of a few KiB to an embedding of hundreds of MiB)
    in float32, bfloat16 and float16; bool and int64 buffers; float32 exp_avg /
    exp_avg_sq and a scalar step per parameter; and plain Python values.

    The optimizer state belongs to a real (never stepped with gradients) AdamW over the
    parameters, so that what nebulite's asynchronous staging learns from optimizers
    applies to it as to a real training job's state."""
    g = torch.Generator().manual_seed(seed)
    d = _width(nbytes)
    per_value = [t.itemsize + 8 for t in _LAYER_DTYPES]  # parameter + two float32 moments
    layer_numel = sum(math.prod(s) for _, s in _layer_shapes(d))
    layer_bytes = layer_numel * sum(per_value) / len(per_value)
    # About 85% in the blocks, the rest in the embedding (float32, plus its two moments).
    n_layer = max(1, int(0.85 * nbytes // layer_bytes))
    vocab = max(1024, int((nbytes - n_layer * layer_bytes) // (d * 12)))

    model: dict[str, torch.Tensor] = {}
    params: list[torch.Tensor] = []
    model["wte.weight"] = torch.empty(vocab, d)
    params.append(model["wte.weight"])
    model["wpe.position_ids"] = torch.arange(2048, dtype=torch.int64).unsqueeze(0)
    for i in range(n_layer):
        dtype = _LAYER_DTYPES[i % len(_LAYER_DTYPES)]
        for name, shape in _layer_shapes(d):
            t = torch.empty(shape, dtype=dtype)
            model[f"h.{i}.{name}"] = t
            params.append(t)
        model[f"h.{i}.attn.causal_mask"] = torch.ones(128, 128, dtype=torch.bool).tril()
        model[f"h.{i}.attn.rotary_inv_freq"] = torch.empty(d // 8)
    model["ln_f.weight"] = torch.empty(d)
    params.append(model["ln_f.weight"])
    for name, t in model.items():
        if name.endswith(("causal_mask", "position_ids")):
            continue
        _fill(t, g)

    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    for p in params:
        opt.state[p] = {
            "step": torch.tensor(float(3)),
            "exp_avg": _fill(torch.empty(p.shape, dtype=torch.float32), g),
            "exp_avg_sq": _fill(torch.empty(p.shape, dtype=torch.float32), g).abs_(),
        }
    meta = {
        "epoch": 3, "global_step": 1500, "rng_state": torch.get_rng_state(),
        "config": {"n_layer": n_layer, "n_embd": d, "vocab_size": vocab, "dtypes": "f32/bf16/f16"},
    }
    return {"model": model, "optimizer": opt.state_dict(), "meta": meta}, opt


# --------------------------------------------------------------------------- GPT-2


def gpt2_model_and_optimizer(w: Workload, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    try:
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit(f"the `transformers` package is required for {w.name} ({e}); run `make setup`")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=w.n_layer, n_embd=w.n_embd, n_head=w.n_head, vocab_size=w.vocab_size,
                     n_positions=w.n_positions)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, batch: int = 1,
                seq: int = 16, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def gpt2_state(w: Workload, steps: int = 3) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    model, opt = gpt2_model_and_optimizer(w)
    train_steps(model, opt, steps)
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "meta": {"global_step": steps, "rng_state": torch.get_rng_state()}}, opt


# --------------------------------------------------------------------------- common


def build(name: str) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """The workload's state and the optimizer whose state it holds."""
    w = get(name)
    if w.kind == "synthetic":
        return synthetic_state(w.target_bytes)
    return gpt2_state(w)


def tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return out


def state_bytes(state: Any) -> int:
    """Bytes of distinct tensor storages (tied weights counted once), as torch.save writes them."""
    seen: set[int] = set()
    total = 0
    for t in tensors(state):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def describe(state: Any) -> dict[str, Any]:
    ts = tensors(state)
    dtypes: dict[str, int] = {}
    for t in ts:
        key = str(t.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + t.numel() * t.element_size()
    sizes = sorted(t.numel() * t.element_size() for t in ts)
    return {"bytes": state_bytes(state), "tensors": len(ts), "bytes_by_dtype": dtypes,
            "smallest_tensor": sizes[0] if sizes else 0, "largest_tensor": sizes[-1] if sizes else 0}
