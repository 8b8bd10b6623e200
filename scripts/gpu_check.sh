#!/usr/bin/env bash
# The GPU acceptance check (hetero.bench.gpu_check): every training job at world size 1 in bf16 for 20
# steps, the Triton kernels' GB/s against the memory bandwidth, a ~1B GPT step's TFLOP/s and MFU, and the
# SDPA backend, and the gpt kind's megatron backend against the native one (bf16 losses, tokens/s), as one
# table. One GPU, at most 8 minutes (a hard limit). Needs an environment with a CUDA build of torch and
# triton, and hetero installed (pip install -e .; the megatron rows also need the extra: '.[megatron]').
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU')"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
exec timeout 480 torchrun --standalone --nproc_per_node 1 -m hetero.bench.gpu_check "$@"
