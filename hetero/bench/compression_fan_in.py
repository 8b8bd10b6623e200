"""Bytes each worker sends per sync as workers are added, from the collective model (no training).

    hetero bench compression --fan-in [--params 1000000]

Each codec runs one exchange of a vector of ``params`` fp32 entries over ``ModelledReplicas``: a collective
of n replicas that moves nothing and counts what one replica would send in NCCL's ring algorithms
(``compression.collective``). Top-k all-gathers every replica's entries, so its bytes grow with n; shared
top-k sends one replica's indices and everyone's values at them in all-reduces, so they do not.
"""

from __future__ import annotations

import torch

from hetero.parallel.compression.build import build_codec
from hetero.parallel.compression.collective import all_gather_wire_bytes, all_reduce_wire_bytes, all_to_all_wire_bytes
from hetero.parallel.compression.config import CompressorConfig

WORKERS = (4, 8, 16, 64)
CODECS = {
    "fp32 all-reduce": CompressorConfig(method="none"),
    "int4": CompressorConfig(method="int4"),
    "top-k 1%": CompressorConfig(method="topk", ratio=0.01),
    "shared top-k 1%": CompressorConfig(method="shared_topk", ratio=0.01),
    "shared top-k 1% int4": CompressorConfig(method="shared_topk", ratio=0.01, value_bits=4),
    "shared top-k 1% 2-bit": CompressorConfig(method="shared_topk", ratio=0.01, value_bits=2),
    "shared top-k 3% 2-bit": CompressorConfig(method="shared_topk", ratio=0.03, value_bits=2),
    "SparseLoCo's payload": CompressorConfig(method="topk", ratio=64 / 4096, segment=4096, value_bits=2),
}


class ModelledReplicas:
    """A collective of ``size`` replicas that moves nothing: sums hold this replica's part alone, gathers
    its tensor in every slot; ``bytes_sent`` counts what this replica would send."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank, self.bytes_sent = size, rank, 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.bytes_sent += all_reduce_wire_bytes(_nbytes(tensor), self.size)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_sent += all_gather_wire_bytes(_nbytes(tensor), self.size)
        return tensor.unsqueeze(0).expand(self.size, *tensor.shape)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_sent += all_to_all_wire_bytes(_nbytes(tensor), self.size)
        return tensor.clone()

    def start_round(self) -> None:
        pass

    def commit_round(self) -> bool:
        return True


def bytes_per_worker(config: CompressorConfig, params: int, workers: int, seed: int = 0) -> int:
    """What one worker sends for one sync of ``params`` fp32 entries among ``workers``."""
    codec = build_codec(config)
    if codec is None:  # the plain fp32 all-reduce
        return all_reduce_wire_bytes(4 * params, workers)
    comm = ModelledReplicas(workers)
    codec.exchange(torch.randn(params, generator=torch.Generator().manual_seed(seed), device="cpu"), comm, {})
    return comm.bytes_sent


def print_fan_in(params: int) -> dict[str, list[int]]:
    """The table of bytes per worker per sync at ``WORKERS``, and each codec's bits per parameter."""
    table = {name: [bytes_per_worker(config, params, n) for n in WORKERS] for name, config in CODECS.items()}
    print(f"\nbytes per worker per sync of {params:,} fp32 parameters (ring model); bits per parameter in brackets")
    print(f"{'codec':<24}" + "".join(f"{f'{n} workers':>26}" for n in WORKERS))
    for name, row in table.items():
        print(f"{name:<24}" + "".join(f"{b:>15,} ({8 * b / params:7.3f})" for b in row))
    return table


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
