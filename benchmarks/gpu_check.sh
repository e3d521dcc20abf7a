#!/usr/bin/env bash
# The GPU check in one run, from a fresh copy of the repository on a machine with a CUDA
# device (fits in 8 minutes on one H200 with 16 cores): sets up (scripts/setup.sh; without
# network, a virtual environment over the system's CUDA build of torch instead), builds
# nebulite, runs the GPU tests (pytest -m gpu) and the GPU benchmark, and prints the figures.
#
#   bash benchmarks/gpu_check.sh            # GB=4 STEPS=10 by default
#   GB=10 bash benchmarks/gpu_check.sh
# Time budget: setup and build ~1 min, tests 30 + 150 + 130 s at most, benchmark 100 s at most.
set -uo pipefail
cd "$(dirname "$0")/.."
GB=${GB:-4}
STEPS=${STEPS:-10}
start=$(date +%s)
phase() { echo "== $1 ($(( $(date +%s) - start )) s)"; }

phase "setup"
if [ ! -x .venv/bin/python ]; then
  if ! timeout 240 bash scripts/setup.sh; then
    # No package index reachable: the system's torch (a CUDA build) and what it has.
    echo "gpu_check: scripts/setup.sh failed; using the system's packages"
    rm -rf .venv
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install -q --no-build-isolation --no-deps . || exit 1
  fi
else
  .venv/bin/python -m pip install -q --no-build-isolation --no-deps . || exit 1
fi
PY=.venv/bin/python
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  "$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "sees no CUDA device")'
  echo "gpu_check: nothing to check without CUDA"
  exit 0
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'

phase "GPU tests"
# Every test marked gpu, and the device staging tests the GPU path shares (on the CPU),
# then DeepSpeed and Lightning on the GPU (each in processes of its own).
timeout 30 "$PY" -m pytest -q tests/test_device.py -p no:cacheprovider
device_rc=$?
timeout 150 "$PY" -m pytest -q -rs -m gpu tests/ -p no:cacheprovider -k "not deepspeed and not lightning"
tests_rc=$?
[ "$device_rc" = 0 ] || tests_rc=$device_rc
phase "GPU tests: DeepSpeed and Lightning"
timeout 130 "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py -p no:cacheprovider -k "deepspeed or lightning"
frameworks_rc=$?
phase "GPU benchmark"
PYTHONUNBUFFERED=1 timeout 100 "$PY" benchmarks/bench_gpu.py --gb "$GB" --steps "$STEPS" --reps 2
bench_rc=$?
phase "done: tests rc=$tests_rc, framework tests rc=$frameworks_rc, benchmark rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$frameworks_rc" = 0 ] && [ "$bench_rc" = 0 ]
