"""Writes the seed corpus of every fuzz target into fuzz/corpus/<target>/.

The seeds are what nebulite itself writes and sends during a short run through the node
agent: the data files and the manifests and commit markers of the store, and the messages
the trainer sent to the agent (the whole session, and each kind of request on its own
after a ``hello``). Run it with nebulite installed (``make setup``):

    .venv/bin/python fuzz/make_corpus.py
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import nebulite
from nebulite.agent import protocol

CORPUS = Path(__file__).resolve().parent / "corpus"
BUDGET = 1 << 20  # the agent's memory: the larger state below streams past it (``adopt``)
# The data files kept: payloads are 4 KiB-aligned, so even a small one is tens of KiB
# (mostly zeros, under 1 KiB in git); one with tensors is enough to start from.
ARCHIVES = {"model"}


def _record_trainer_messages() -> list[dict[str, Any]]:
    """Makes protocol.send keep a copy of every message this process sends."""
    sent: list[dict[str, Any]] = []
    send = protocol.send

    def recording_send(sock, message, fds=None):
        sent.append(message)
        send(sock, message, fds)

    protocol.send = recording_send
    return sent


def _run(store: str) -> None:
    nebulite.init(persistent_storage_path=store, agent=True, memory_buffer_size=BUDGET,
                  num_of_version_in_retention=0, agent_idle_exit=0.5)
    pid = nebulite.session_info()["agent_pid"]
    try:
        ckpt = nebulite.Checkpoint("global_step1", num_files=2)
        ckpt.save("model", {"w": torch.arange(4, dtype=torch.float32), "b": torch.zeros(2)})
        ckpt.save("optimizer", {"step": 1, "lr": 0.1})
        # A tag that needs escaping in manifests; tensors sharing a storage.
        base = torch.arange(6, dtype=torch.int64)
        ckpt = nebulite.Checkpoint("step 2 é%", -2)
        ckpt.save("state", {"all": base, "view": base[2:4]})
        ckpt.commit()
        nebulite.get_latest_checkpoint().load("state")
        nebulite.get_checkpoint(tag="global_step1").load("model")
        # Larger than the agent's memory: streamed to the store, then adopted by the agent.
        nebulite.Checkpoint("big", num_files=1).save("x", torch.ones(BUDGET // 2))
        nebulite.flush_persistence()
        nebulite.list_checkpoints()
        nebulite.history()
    finally:
        nebulite.shutdown()
    while True:  # the agent leaves once idle; then the store is left alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)


def _write(target: str, files: dict[str, bytes]) -> None:
    d = CORPUS / target
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    print(f"{d}: {len(files)} files, {sum(map(len, files.values()))} bytes")


def _frame(messages: list[dict[str, Any]]) -> bytes:
    return b"".join(protocol.encode(m) for m in messages)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="nbcorpus-") as tmp:
        os.environ["NEBULITE_RUNTIME_DIR"] = os.path.join(tmp, "rt")
        store = os.path.join(tmp, "store")
        sent = _record_trainer_messages()
        _run(store)

        archives, records = {}, {}
        for path in sorted(Path(store).rglob("*")):
            if not path.is_file() or path.name.startswith((".", "checkpointHistories")):
                continue
            rel = path.relative_to(store).parts
            label = re.sub(r"[^0-9A-Za-z]+", "_", rel[0]).strip("_") + "-" + rel[-1]
            if path.name == "COMMITTED" or path.name.endswith(".manifest"):
                records[label] = path.read_bytes()
            elif rel[-2].startswith("rank") and path.name in ARCHIVES:
                archives[label] = path.read_bytes()

    hello = sent[0]
    assert hello["op"] == "hello", hello
    sessions = {"session": _frame(sent)}
    for m in sent[1:]:
        name = f"hello-{m['op']}"
        if name not in sessions:
            sessions[name] = _frame([hello, m])
    _write("archive_index_fuzz", archives)
    _write("manifest_fuzz", records)
    _write("agent_protocol_fuzz", sessions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
