"""Calibrate the cost model on the machine it runs on: time the ops it prices, fit its constants.

Every rank of a small gloo world measures at the same time (so ranks share cores and memory bandwidth
as they do in training), each op forward and backward under autograd, as training runs it:

- GEMMs of several shapes        -> matmul_overhead_us and matmul_tflops (time = overhead + FLOPs / rate)
- causal attention (SDPA)         -> attention_tflops
- an elementwise op (GELU)        -> elementwise_overhead_us and memory_gb_s
- all-reduces of several sizes    -> the link's latency_us and bandwidth_gb_s (ring formula)
- a tiny GPT block, tensor-parallel over the world (hetero's DTensor plan) and whole
                                  -> tp_layer_overhead_us: what tensor parallelism adds to a layer
                                     beyond its all-reduces (DTensor's dispatch, redistributions)
- a 1024 x 768 JPEG decoded and preprocessed at native resolution (hetero's ImagePipeline)
                                  -> host.decode_ms_per_megapixel (one data worker per rank)

Forward-plus-backward times are divided by 3, the cost model's training multiplier, so the fitted
constants are forward-equivalents. Rank 0's fit is the result.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from PIL import Image

from hetero.models.gpt.model import Block
from hetero.models.gpt.rope import rope_tables
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.plan import block_plan
from hetero.data.images import ImagePipeline
from hetero.plan.cluster import ClusterSpec, DeviceSpec, HostSpec, LinkSpec
from hetero.plan.cost import allreduce_s
from hetero.testing.multiprocess import run_ranks

GEMMS = [(m, k, n) for m in (64, 256, 1024) for k, n in ((64, 64), (128, 512), (256, 256), (512, 128), (512, 512))]
ATTENTION = [(b, h, s, 32) for b, h, s in ((1, 4, 64), (2, 4, 128), (2, 8, 256), (1, 8, 512))]
ELEMENTWISE = [2**p for p in range(10, 21, 2)]  # elements
ALLREDUCE = [2**p for p in range(10, 23, 2)]  # bytes
TINY_BLOCK = GPTConfig(hidden_size=64, num_heads=4, seq_len=16)  # compute is negligible next to overheads
TINY_BATCH = 2
PHOTO = (768, 1024)  # height, width of the decoded image


def photo_jpeg(seed: int = 0) -> bytes:
    """A photo-like JPEG (smooth colour gradients and grain, quality 90) of PHOTO's size."""
    height, width = PHOTO
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)], -1)
    grain = np.random.default_rng(seed).integers(-20, 20, (height, width, 3))
    out = io.BytesIO()
    Image.fromarray((rgb + grain).clip(0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def _median_s(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of y = a + b x minimizing the squared *relative* error (small and large ops
    count alike), both clamped at >= 0."""
    w = [1 / y**2 for y in ys]
    sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    slope = max((sw * sxy - sx * sy) / (sw * sxx - sx * sx), 1e-30)
    return max((sy - slope * sx) / sw, 0.0), slope


def _training_s(make: Callable[[], tuple[torch.Tensor, ...]], op: Callable[..., torch.Tensor], repeats: int) -> float:
    inputs = make()

    def run() -> None:
        out = op(*inputs)
        out.backward(torch.ones_like(out))
        for x in inputs:
            x.grad = None

    return _median_s(run, repeats) / 3


def measure(rank: int, world_size: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    torch.manual_seed(rank)
    rand = lambda *shape: torch.randn(*shape, requires_grad=True)  # noqa: E731
    gemm = [(2.0 * m * k * n, _training_s(lambda: (rand(m, k), rand(k, n)), torch.matmul, repeats)) for m, k, n in GEMMS]
    attention = [
        (4.0 * b * h * s * s * d * 0.5,
         _training_s(lambda: (rand(b, h, s, d), rand(b, h, s, d), rand(b, h, s, d)),
                     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats))
        for b, h, s, d in ATTENTION
    ]
    elementwise = [(2.0 * 4 * n, _training_s(lambda: (rand(n),), F.gelu, repeats)) for n in ELEMENTWISE]
    allreduce = []
    for nbytes in ALLREDUCE:
        tensor = torch.zeros(nbytes // 4)
        dist.barrier()
        allreduce.append((float(nbytes), _median_s(lambda: dist.all_reduce(tensor), repeats)))
    config, batch = TINY_BLOCK, TINY_BATCH
    cos, sin = rope_tables(config.hidden_size // config.num_heads, torch.arange(config.seq_len), config.rope_theta)
    whole = Block(config)
    sharded = parallelize_module(Block(config), init_device_mesh("cpu", (world_size,)), block_plan())
    blocks = []
    for block in (whole, sharded):
        dist.barrier()
        blocks.append(3 * _training_s(lambda: (rand(batch, config.seq_len, config.hidden_size),),
                                      lambda x: block(x, cos, sin), repeats))
    data, pipeline = photo_jpeg(rank), ImagePipeline.for_vision(PHOTO[1], 3, patch_size=16, max_patches=4096)
    dist.barrier()
    decode = _median_s(lambda: pipeline(pipeline.decode(data, "calibration image")), repeats)
    return {"gemm": gemm, "attention": attention, "elementwise": elementwise, "allreduce": allreduce,
            "tp_block": [tuple(blocks)], "decode": [(PHOTO[0] * PHOTO[1] / 1e6, decode)]}


def fit(samples: dict[str, list[tuple[float, float]]], world_size: int, name: str, memory_gib: float) -> ClusterSpec:
    overhead, per_flop = _fit(*zip(*samples["gemm"]))
    matmul_tflops = 1 / per_flop / 1e12
    attention_tflops = 1 / _fit(*zip(*samples["attention"]))[1] / 1e12
    elementwise_overhead, per_byte = _fit(*zip(*samples["elementwise"]))
    latency, per_byte_link = _fit(*zip(*samples["allreduce"]))
    n = world_size
    link = LinkSpec(bandwidth_gb_s=2 * (n - 1) / n / per_byte_link / 1e9, latency_us=latency / (2 * (n - 1)) * 1e6)
    # Beyond the layer's four all-reduces (two forward, two backward) of its activations.
    (whole_s, sharded_s), = samples["tp_block"]
    activation = TINY_BATCH * TINY_BLOCK.seq_len * TINY_BLOCK.hidden_size * 4
    tp_overhead = max(0.0, sharded_s - whole_s - 4 * allreduce_s(activation, n, link))
    device = DeviceSpec(
        memory_gib=memory_gib,
        peak_tflops=matmul_tflops,  # no datasheet: the measured GEMM rate is the peak MFU divides by
        matmul_tflops=matmul_tflops,
        matmul_overhead_us=overhead * 1e6,
        attention_tflops=attention_tflops,
        memory_gb_s=1 / per_byte / 1e9,
        elementwise_overhead_us=elementwise_overhead * 1e6,
        tp_layer_overhead_us=tp_overhead * 1e6,
        activation_bytes=4,
        precision="fp32",
    )
    (megapixels, decode_s), = samples["decode"]
    host = HostSpec(decode_ms_per_megapixel=decode_s * 1e3 / megapixels, loader_workers=1)
    return ClusterSpec(name=name, nodes=1, gpus_per_node=n, device=device, intra_node=link, inter_node=link, host=host)


def calibrate(ranks: int = 2, repeats: int = 7, name: str = "this-machine") -> ClusterSpec:
    """This machine as ``ranks`` gloo ranks on one node, every constant measured."""
    samples = run_ranks(measure, ranks, repeats, timeout_s=600)[0]
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3 / ranks
    return fit(samples, ranks, name, round(memory_gib, 1))
