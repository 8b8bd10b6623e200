"""From a module's ``compression:`` block to the object that moves its gradients or pseudo-gradients."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from hetero.parallel.compression.codecs import BlockQuant, Codec, RandomK, SharedTopK, TopK
from hetero.parallel.compression.collective import Collective, GroupCollective
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig
from hetero.parallel.compression.diloco import DiLoCo
from hetero.parallel.compression.grad_sync import CompressedGradSync
from hetero.parallel.compression.powersgd import PowerSGDGradSync
from hetero.parallel.data import AllReduceGradSync, GradSync


def build_codec(config: CompressorConfig, seed: int = 0) -> Codec | None:
    """The codec of ``config.method`` (None for plain fp32 sums; PowerSGD is a sync of its own)."""
    values = None if config.value_bits == 32 else BlockQuant(config.value_bits, config.block_size)
    if config.method == "topk":
        return TopK(config.ratio, config.segment, values)
    if config.method == "shared_topk":
        return SharedTopK(config.ratio, config.segment, values, union=config.indices == "union")
    if config.method == "randomk":
        return RandomK(config.ratio, seed)
    if config.method in ("int8", "int4"):
        return BlockQuant(int(config.method[3:]), config.block_size)
    if config.method in ("none", "powersgd"):
        return None
    raise ValueError(f"unknown compression method {config.method!r}")


def build_grad_sync(
    config: CompressorConfig,
    named_params: Iterable[tuple[str, nn.Parameter]],
    comm: Collective,
    bucket_bytes: int,
    seed: int = 0,
    reduce_dtype: torch.dtype | None = None,
    before_launch: Callable[[nn.Parameter], None] | None = None,
) -> GradSync:
    """``reduce_dtype`` and ``before_launch``: the plain all-reduce's (``AllReduceGradSync``)."""
    if config.method == "none":
        assert isinstance(comm, GroupCollective), "the plain all-reduce runs over a process group"
        return AllReduceGradSync(named_params, comm, bucket_bytes, reduce_dtype, before_launch)
    if config.method == "powersgd":
        return PowerSGDGradSync(named_params, comm, config.rank, config.feedback, seed)
    codec = build_codec(config, seed)
    assert codec is not None
    return CompressedGradSync(named_params, comm, codec, config.feedback, bucket_bytes)


def build_diloco(
    config: CompressionConfig, named_params: Iterable[tuple[str, nn.Parameter]], comm: Collective, seed: int = 0
) -> DiLoCo:
    pseudo = config.diloco.pseudo_grad
    return DiLoCo(named_params, comm, config.diloco, build_codec(pseudo, seed), config.diloco.feedback)
