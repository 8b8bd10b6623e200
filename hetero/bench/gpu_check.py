"""The GPU acceptance check: one table of what a single GPU does with hetero's jobs and kernels.

    scripts/gpu_check.sh                      (torchrun --nproc_per_node 1 -m hetero.bench.gpu_check)
    torchrun --nproc_per_node 1 -m hetero.bench.gpu_check --device cpu --steps 2 --gpt-layers 2   (dry run)

Rows, each measured in this run:

- every shipped training job (LLM, VLM, ``moe_vlm``, ``dna_vlm``, video, GeneZip, the full graph) at world size 1 in
  bf16 (autocast, fp32 master weights) for ``--steps`` steps: its loss at the first and the last step
  and the median step time;
- the Triton int8 block quantizer and the segmented top-k (with its error-feedback update) on 2^26
  fp32 values: GB/s moved, next to a device-to-device copy's GB/s (the memory bandwidth reached in the
  same run) and the datasheet HBM bandwidth (``device_peaks``);
- one training step of a GPT of about 1B parameters (hidden 2048, 18 layers, sequence 2048) in bf16:
  TFLOP/s (Megatron's count, ``hetero.kinds.flops``) and MFU against the datasheet dense bf16 peak;
- the scaled-dot-product attention backend that step ran on (flash or memory-efficient; math means no
  fused kernel took it);
- the gpt kind's megatron backend (megatron-core's local layer spec) against the native one on the LLM
  job at 1024 wide, 8 layers and 1024 tokens a row: the largest relative difference of a step's bf16 loss
  and tokens/s side by side (where megatron-core is installed).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetero.bench.device_peaks import hbm_bandwidth_gbs, local_device_peak_tflops
from hetero.bench.throughput import absolute_paths
from hetero.config import load_experiment
from hetero.graph import build_graph
from hetero.models import default_registry

JOBS = {"LLM": "text_lm", "VLM": "colocated_vlm", "MoE-VLM": "moe_vlm", "DNA-VLM": "dna_vlm", "video": "video",
        "GeneZip": "genezip", "full graph": "full_graph"}
KERNEL_NUMEL = 2**26
MEGATRON_JOB = "text_lm"  # at a size where the step is the GPU's work, not the launches'
MEGATRON_SIZE = ["llm.model.hidden_size=1024", "llm.model.num_layers=8", "llm.model.num_heads=8",
                 "llm.model.seq_len=1024"]


@dataclass
class Row:
    what: str
    figure: str
    detail: str = ""


def one_rank_overrides(name: str, precision: str) -> list[str]:
    """``name``'s experiment on one rank: every module's degrees 1, at rank 0, under ``precision``, each
    microbatch as many rows as all its replicas' were."""
    experiment = load_experiment(name)
    layouts = build_graph(experiment, default_registry()).placement.layouts
    overrides = ["world_size=1"]
    for module in experiment.modules:
        overrides += [f"{module}.layout.{axis}=1" for axis in ("tp", "cp", "dp", "pp", "ep")]
        overrides.append(f"{module}.micro_batch_size={experiment.micro_batch_size(module) * layouts[module].dp}")
        overrides += [f"{module}.layout.offset=0", f"{module}.layout.size=null", f"{module}.layout.ranks=null",
                      f"{module}.parallel.precision={precision}", f"{module}.parallel.sequence_parallel=false"]
    return overrides


def train_job(name: str, steps: int, device: torch.device, overrides: Sequence[str] = ()) -> tuple[list[float], float]:
    """``name``'s experiment on one rank in bf16 (with ``overrides``) for ``steps`` steps: each step's loss
    and the median step's seconds (the first step's left out)."""
    from hetero.runtime import build_runtime
    from hetero.data.splits import load_splits

    experiment = absolute_paths(load_experiment(name, one_rank_overrides(name, "bf16") + list(overrides)))
    # on the device the backend serves: cuda:LOCAL_RANK under NCCL
    runtime = build_runtime(experiment, default_registry())
    assert runtime.device.type == device.type, f"the runtime is on {runtime.device}, the check asked for {device}"
    data = load_splits(experiment, runtime.graph, ("train",))["train"]
    losses, times = [], []
    for step in range(steps):
        tick = time.perf_counter()
        losses.append(runtime.train_step(data.batch(step))["loss"])  # the loss's .tolist() waits for the step
        times.append(time.perf_counter() - tick)
    return losses, statistics.median(times[1:] or times)


def job_row(label: str, name: str, steps: int, device: torch.device) -> Row:
    losses, seconds = train_job(name, steps, device)
    return Row(f"{label} ({name}), {steps} bf16 steps", f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
               f"{seconds * 1e3:.1f} ms/step")


def megatron_rows(device: torch.device, steps: int) -> list[Row]:
    """The gpt kind's two backends side by side on ``MEGATRON_JOB`` (bf16, one rank, the same weights and
    batches): the largest relative difference of a step's loss, and tokens/s of each."""
    experiment = load_experiment(MEGATRON_JOB, MEGATRON_SIZE)
    model = experiment.modules["llm"].model
    what = (f"megatron backend against native ({MEGATRON_JOB}, {model['hidden_size']} wide, {model['num_layers']} "
            f"layers, {model['seq_len']} tokens a row)")
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return [Row(what, "not run", "megatron-core is not installed: pip install -e '.[megatron]'")]
    if device.type != "cuda":
        return [Row(what, "not run", "megatron-core's model code needs CUDA (the tests run it on CPU)")]
    runs = {backend: train_job(MEGATRON_JOB, steps, device, MEGATRON_SIZE + [f"+llm.model.backend={backend}"])
            for backend in ("native", "megatron")}
    (native, native_s), (megatron, megatron_s) = runs["native"], runs["megatron"]
    worst = max(abs(m - n) / abs(n) for n, m in zip(native, megatron))
    tokens = experiment.batch.global_batch_size * model["seq_len"]
    return [Row(f"{what}, {steps} bf16 steps", f"loss rel diff {worst:.1e}",
                f"native {native[0]:.4f} -> {native[-1]:.4f}, megatron {megatron[0]:.4f} -> {megatron[-1]:.4f}"),
            Row("tokens/s: native | megatron", f"{tokens / native_s:,.0f} | {tokens / megatron_s:,.0f}",
                f"megatron {native_s / megatron_s:.2f}x native")]


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int = 10) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, after one untimed call that compiles)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            tick = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - tick)
    return statistics.median(samples)


def kernel_rows(device: torch.device, numel: int) -> list[Row]:
    from hetero.kernels.dispatch import use_triton
    from hetero.kernels.quantize import quantize_blocks
    from hetero.kernels.segment_topk import segment_topk

    x = torch.randn(numel, device=device)
    residual = torch.zeros_like(x)
    copy = torch.empty_like(x)
    copy_s = _seconds(lambda: copy.copy_(x), device)
    copy_gbs = 2 * x.numel() * 4 / copy_s / 1e9  # read and write
    datasheet = hbm_bandwidth_gbs(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    rows = [Row("device-to-device copy", f"{copy_gbs:.0f} GB/s",
                f"datasheet HBM {datasheet:.0f} GB/s" if datasheet else "no datasheet bandwidth for this device")]
    path = "Triton" if use_triton(x) else "torch, no Triton here"
    block = 64
    quant_s = _seconds(lambda: quantize_blocks(x, 8, block), device)
    moved = x.numel() * 4 + x.numel() + x.numel() // block * 2  # fp32 in; int8 codes and bf16 scales out
    rows.append(Row(f"int8 block quantize ({path})", f"{moved / quant_s / 1e9:.0f} GB/s",
                    f"{moved / quant_s / 1e9 / copy_gbs:.2f} of the copy's"))
    segment, k = 1024, 32
    topk_s = _seconds(lambda: segment_topk(x, residual, k, segment), device)
    moved = 3 * x.numel() * 4 + x.numel() // segment * k * 6  # grad and residual in, residual out; values, indices
    rows.append(Row(f"segmented top-{k}/{segment} + error feedback ({path})",
                    f"{moved / topk_s / 1e9:.0f} GB/s", f"{moved / topk_s / 1e9 / copy_gbs:.2f} of the copy's"))
    return rows


def gpt_rows(device: torch.device, layers: int) -> list[Row]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hetero.kinds.flops import TRAINING_MULTIPLIER
    from hetero.models.gpt.flops import gpt_forward_flops_per_token
    from hetero.models.gpt.config import GPTConfig
    from hetero.models.gpt.model import GPT, token_loss_sum

    config = GPTConfig(vocab_size=32000, hidden_size=2048, num_layers=layers, num_heads=16, ffn_hidden_size=5632,
                       seq_len=2048)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    batch = 4 if device.type == "cuda" else 1
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = token_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        optimizer.step()

    backend = "math"
    for name, choice in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel([choice]):
                seconds = _seconds(step, device, repeats=5)
            backend = name
            break
        except RuntimeError:  # this backend cannot take the call
            continue
    if backend == "math":
        seconds = _seconds(step, device, repeats=5)
    flops = TRAINING_MULTIPLIER * gpt_forward_flops_per_token(config) * batch * config.seq_len
    tflops = flops / seconds / 1e12
    peak, name = local_device_peak_tflops()
    mfu = f"MFU {tflops / peak:.1%} of {peak:g} TFLOP/s ({name})" if peak else "MFU n/a (no datasheet peak)"
    return [Row(f"GPT {params / 1e9:.2f}B params, {batch}x{config.seq_len} tokens, bf16 step",
                f"{tflops:.1f} TFLOP/s", f"{seconds * 1e3:.0f} ms; {mfu}"),
            Row("SDPA backend of that step", backend, "" if backend != "math" else "no fused kernel took the call")]


def main(argv: list[str] | None = None) -> int:
    from hetero.parallel.mesh import init_distributed

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run of the code paths)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per job")
    parser.add_argument("--gpt-layers", type=int, default=18, help="layers of the ~1B GPT (2 for a dry run)")
    parser.add_argument("--kernel-numel", type=int, default=KERNEL_NUMEL, help="values per kernel call")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device(args.device)
    started = time.perf_counter()
    experiment = load_experiment("text_lm", one_rank_overrides("text_lm", "bf16"))
    init_distributed(build_graph(experiment, default_registry()).placement)
    rows = [job_row(label, name, args.steps, device) for label, name in JOBS.items()]
    rows += kernel_rows(device, args.kernel_numel)
    rows += gpt_rows(device, args.gpt_layers)
    rows += megatron_rows(device, args.steps)
    what = max(len(r.what) for r in rows)
    figure = max(len(r.figure) for r in rows)
    print(f"\nhetero GPU check on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    for row in rows:
        print(f"{row.what:<{what}}  {row.figure:>{figure}}  {row.detail}")
    print(f"total {time.perf_counter() - started:.0f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
