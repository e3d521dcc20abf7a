#!/usr/bin/env bash
# Installs everything the demo and the tests need, idempotently:
# Debian build packages, a virtual environment in .venv, and nebulite itself.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v g++ >/dev/null || need+=(g++)
command -v make >/dev/null || need+=(make)
[ -f /usr/include/zlib.h ] || need+=(zlib1g-dev)
[ -d /usr/src/googletest ] || [ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
# The fuzz targets: clang with libFuzzer (make fuzz).
command -v clang++ >/dev/null || need+=(clang)
compgen -G '/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a' >/dev/null ||
  need+=(libclang-rt-14-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q -c constraints.txt)
stamp=.venv/.deps-$(sha1sum scripts/setup.sh constraints.txt | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  echo "setup: installing Python packages"
  "${PIP[@]}" torch==2.13.0 numpy pytest pytest-timeout hypothesis psutil transformers \
    "lightning==2.6.*" matplotlib "nanobind>=2.0" "scikit-build-core>=0.10" cmake ninja atheris
  # DeepSpeed builds against the torch above; its CUDA ops are not built (they are
  # compiled just in time where a GPU needs them).
  DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation deepspeed
  # Object stores (az://, s3://, gs://) and the emulators their tests start.
  "${PIP[@]}" obstore google-cloud-storage "moto[server]" gcp-storage-emulator azure-storage-blob boto3
  touch "$stamp"
fi
echo "setup: building nebulite"
"${PIP[@]}" --no-build-isolation --no-deps .

# DeepSpeed compiles the shared-memory op of its CPU collectives the first time a process
# starts its distributed backend: compile it here, once, where the tests look for it
# (tests/conftest.py), rather than in the ranks of the first test that starts DeepSpeed.
export TORCH_EXTENSIONS_DIR="$PWD/build/torch_extensions"
if [ ! -f "$TORCH_EXTENSIONS_DIR/deepspeed_shm_comm/deepspeed_shm_comm.so" ]; then
  echo "setup: building DeepSpeed's CPU collectives op"
  # (importing DeepSpeed makes torch's inductor cache: in build/ too, not in /tmp)
  DS_ACCELERATOR=cpu TORCHINDUCTOR_CACHE_DIR="$PWD/build/torchinductor" .venv/bin/python -c \
    "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()" \
    >/dev/null
fi
