"""``nebulite history --plot``: a PNG of a run's checkpoints (matplotlib, imported only
here): blocking and persistence time per checkpoint over the run, and the throughput of
each persist to the store."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._history import CheckpointHistory


def plot_history(checkpoints: list["CheckpointHistory"], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
    x = list(range(len(checkpoints)))
    labels = [c.tag for c in checkpoints]
    fig, (times, rate) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    times.plot(x, [c.blocking_seconds for c in checkpoints], "o-", label="blocking (training stalled)")
    times.plot(x, [c.persist_seconds if c.persist_seconds is not None else float("nan")
                   for c in checkpoints], "s-", label="persisting (to committed in the store)")
    times.set_ylabel("seconds")
    times.set_title("nebulite checkpoints")
    times.legend()
    times.grid(alpha=0.3)
    mbs = [c.throughput_mb_s if c.throughput_mb_s is not None else float("nan")
           for c in checkpoints]
    rate.bar(x, mbs, color="tab:green", label="throughput to the store")
    known = sorted(v for v in mbs if v == v)
    if known:
        rate.axhline(known[len(known) // 2], color="gray", linestyle="--",
                     label=f"median {known[len(known) // 2]:.0f} MB/s")
    rate.set_ylabel("MB/s")
    rate.legend()
    rate.grid(alpha=0.3)
    rate.set_xticks(x)
    rate.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    fig.tight_layout()
    tmp = f"{path}.tmp{os.getpid()}.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
