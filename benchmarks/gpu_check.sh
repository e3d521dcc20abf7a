#!/usr/bin/env bash
# The GPU check in one run, from a copy of the repository on a machine with a CUDA device
# (fits in 8 minutes on one H200 with 16 cores): builds nebulite against the machine's own
# CUDA build of torch, runs the GPU tests (pytest -m gpu) and the GPU benchmark, and prints
# the figures.
#
#   bash benchmarks/gpu_check.sh            # GB=4 STEPS=10 by default
#   GB=10 bash benchmarks/gpu_check.sh
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh
#
# It never runs scripts/setup.sh, which pins the CPU build of torch: the Python used
# (PYTHON, default python3) must already have a CUDA build of torch, pytest and psutil.
# nebulite is built into a virtual environment over that Python's packages (.venv-gpu),
# unless `import nebulite._core` already works (a prebuilt extension on PYTHONPATH), and
# DeepSpeed and Lightning are used where that Python has them.
# Time budget: build ~1 min, tests 30 + 150 + 130 s at most, benchmark 100 s at most.
set -uo pipefail
cd "$(dirname "$0")/.."
GB=${GB:-4}
STEPS=${STEPS:-10}
PY=${PYTHON:-python3}
start=$(date +%s)
phase() { echo "== $1 ($(( $(date +%s) - start )) s)"; }

phase "setup"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  "$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "sees no CUDA device")'
  echo "gpu_check: nothing to check without CUDA"
  exit 0
fi
if ! "$PY" -c 'import nebulite._core' 2>/dev/null; then
  "$PY" -m venv --system-site-packages .venv-gpu || exit 1
  PY=.venv-gpu/bin/python
  # The build's own needs, where an index is reachable (the machine's, else).
  "$PY" -m pip install -q --retries 0 --timeout 10 scikit-build-core nanobind 2>/dev/null || true
  "$PY" -m pip install -q --no-build-isolation --no-deps . || exit 1
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'
"$PY" -c 'import nebulite; print("nebulite from", nebulite.__file__)'
for pkg in deepspeed lightning; do
  "$PY" -c "import $pkg; print('$pkg', $pkg.__version__)" 2>/dev/null || echo "$pkg: not installed"
done

phase "GPU tests"
# Every test marked gpu, and the device staging tests the GPU path shares (on the CPU),
# then DeepSpeed and Lightning on the GPU (each in processes of its own).
timeout 30 "$PY" -m pytest -q tests/test_device.py -p no:cacheprovider
device_rc=$?
timeout 150 "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py tests/test_pinned.py -p no:cacheprovider \
  --timeout 60 --durations 10 \
  -k "not deepspeed and not lightning"
tests_rc=$?
[ "$device_rc" = 0 ] || tests_rc=$device_rc
phase "GPU tests: DeepSpeed and Lightning"
timeout 130 "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 120 \
  --durations 10 -k "deepspeed or lightning"
frameworks_rc=$?
phase "GPU benchmark"
PYTHONUNBUFFERED=1 timeout 100 "$PY" benchmarks/bench_gpu.py --gb "$GB" --steps "$STEPS" --reps 2
bench_rc=$?
phase "done: tests rc=$tests_rc, framework tests rc=$frameworks_rc, benchmark rc=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$frameworks_rc" = 0 ] && [ "$bench_rc" = 0 ]
