"""Expected contents of the format-v1 golden store (tests/golden/v1/store).

FROZEN: scripts/make_golden.py wrote the store from these builders once; tests/test_golden.py
compares what it loads against them. Changing a value here breaks the golden test, by
design. Every value is built from explicit numbers (no random generator), so the builders
give the same tensors with every torch release.
"""

from __future__ import annotations

import torch

#: Tags in commit order (seq 1, 2) and the names each holds, in save order.
COMMITS = [
    ("global_step5", ["model", "optimizer"]),
    ("global_step10", ["model"]),
]


def model_step5() -> dict:
    weight = (torch.arange(12, dtype=torch.float32).reshape(4, 3) - 5.5) / 8  # exact in binary
    base = torch.tensor([0.5, -1.25, 2.0, 3.75, -0.0, 1e-3], dtype=torch.float32)
    return {
        "weight": weight,
        "bias": torch.tensor([0.25, -0.5, 1.0, 1e30], dtype=torch.float32),
        "bf16": torch.tensor([[1.0, -2.5, 0.0078125], [3.0e38, -1.0e-38, 65280.0]], dtype=torch.bfloat16),
        "steps": torch.tensor([0, -1, 2**62, -(2**63)], dtype=torch.int64),
        "mask": torch.tensor([True, False, False, True, True]),
        "base": base,
        "view": base[1:4],  # shares storage with "base" (offset 1)
        "weight_t": weight.t(),  # non-contiguous view of "weight"
        "scalar": torch.tensor(3.5, dtype=torch.float32),  # 0-dim
        "empty": torch.zeros(0, 3, dtype=torch.float32),
        "meta": {
            "lr": 0.125,
            "epoch": 5,
            "name": "golden-v1",
            "unicode": "n\u00e9bulite \u2713",
            "flags": [True, False, None, 1, 2.5, "x"],
            "shape": (4, 3),
            "nested": {"ids": [torch.tensor([7, 8, 9], dtype=torch.int32)], "big": 2**40},
        },
    }


def optimizer_step5() -> dict:
    return {
        "state": {
            0: {
                "step": torch.tensor(5.0),
                "exp_avg": torch.full((4, 3), 0.0625, dtype=torch.float32),
                "exp_avg_sq": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 1024,
            },
        },
        "param_groups": [
            {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": [0, 1]},
        ],
    }


def model_step10() -> dict:
    return {
        "weight": (torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1) / 4,
        "bias": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float32),
        "scalar": torch.tensor(10, dtype=torch.int64),
    }


def expected(tag: str, name: str) -> dict:
    return {
        ("global_step5", "model"): model_step5,
        ("global_step5", "optimizer"): optimizer_step5,
        ("global_step10", "model"): model_step10,
    }[(tag, name)]()


#: (container key path, base key path): pairs that must share one storage after loading.
SHARED_STORAGE = {
    ("global_step5", "model"): [(("view",), ("base",)), (("weight_t",), ("weight",))],
}
