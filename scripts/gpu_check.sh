#!/usr/bin/env bash
# The GPU acceptance check (hetero.bench.gpu_check): every training job at world size 1 in bf16 for 20
# steps, the Triton kernels' GB/s against the memory bandwidth, a ~1B GPT step's TFLOP/s and MFU, and the
# SDPA backend, and the gpt kind's megatron backend against the native one (bf16 losses, tokens/s), as one
# table. One GPU, at most 8 minutes (a hard limit).
#
# It runs from this checkout as it is, hetero not installed, on an image that has a CUDA build of torch (2.11
# or later), torchvision, transformers and triton and no network (the lent GPU machine's):
#   1. here, with network: scripts/gpu_wheels.sh puts the other wheels it needs into gpu_wheels/ (ignored);
#   2. carry gpu_wheels/ with the checkout and run this script there: it installs them into build/gpu_site
#      (pip --no-index --no-deps --target) and runs the check with PYTHONPATH=<checkout>:build/gpu_site under
#      the image's python3 (HETERO_PYTHON to pick another).
# Where hetero is installed already (pip install -e '.[megatron]'), HETERO_GPU_WHEELS=none skips both.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${HETERO_PYTHON:-python3}"
WHEELS="${HETERO_GPU_WHEELS:-gpu_wheels}"
SITE=build/gpu_site
if [[ "$WHEELS" != none ]]; then
  if ! compgen -G "$WHEELS/*.whl" > /dev/null; then
    echo "gpu_check: no wheels in $WHEELS/: run scripts/gpu_wheels.sh where PyPI is reachable and carry $WHEELS/" \
         "with the checkout (or set HETERO_GPU_WHEELS=none where hetero is installed)" >&2
    exit 2
  fi
  if [[ -f "$WHEELS/SHA256SUMS" ]]; then
    (cd "$WHEELS" && sha256sum --check --quiet SHA256SUMS)
  fi
  rm -rf "$SITE"
  mkdir -p "$SITE"
  if "$PYTHON" -m pip --version > /dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
  else  # no pip in the image: a wheel is a zip of what goes on the path (none of these has a .data folder)
    for wheel in "$WHEELS"/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$SITE"; done
  fi
  export PYTHONPATH="$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU')"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
exec timeout 480 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 -m hetero.bench.gpu_check "$@"
