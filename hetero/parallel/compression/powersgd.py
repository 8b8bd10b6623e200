"""PowerSGD gradient sync: a rank-r approximation of each weight matrix's gradient, with error feedback.

For a gradient matrix ``M`` (m × n, the parameter viewed as its first dimension by the rest; bias and norm
vectors are all-reduced uncompressed, as are matrices too small to gain), one power-iteration step with
the previous step's ``Q`` (n × r, warm start):

    P = sum_i M_i Q;  P <- orthonormal columns of P;  Q = sum_i M_i^T P;  approximation = P Q^T

Only ``P`` and ``Q`` cross the wire, in one all-reduce each for all matrices. With error feedback each
replica adds its residual to ``M`` first and keeps ``M_i - approximation / n``: the approximation stands
for the sum, so each replica's share of it is one n-th.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable

import torch
from torch import nn

from hetero.parallel.compression.collective import Collective
from hetero.parallel.data import AfterBackwardSync, local_grad, split_like


class PowerSGDGradSync(AfterBackwardSync):
    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        comm: Collective,
        rank: int,
        feedback: str = "ef",
        seed: int = 0,
    ):
        if feedback not in ("ef", "none"):
            raise ValueError(f"PowerSGD error feedback must be ef or none, got {feedback!r}")
        self.params = dict(named_params)
        self.comm, self.rank, self.feedback, self.seed = comm, rank, feedback, seed
        self.residual: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    def compressible(self, grad: torch.Tensor) -> bool:
        if grad.dim() < 2:
            return False
        m, n = grad.shape[0], grad[0].numel()
        return (m + n) * self.rank < m * n

    def sync(self) -> None:
        grads = {n: g for n, g in ((n, local_grad(p)) for n, p in self.params.items()) if g is not None}
        matrices = {n: g for n, g in grads.items() if self.compressible(g)}
        plain = [g for n, g in grads.items() if n not in matrices]
        if plain:
            flat = torch.cat([g.reshape(-1) for g in plain])
            self.comm.all_reduce(flat)
            _copy_pieces(flat, plain)
        if not matrices:
            return
        m = {}
        for name, g in matrices.items():
            m[name] = g.reshape(g.shape[0], -1).clone()
            if self.feedback == "ef" and name in self.residual:
                m[name] += self.residual[name]
            if name not in self.q:
                self.q[name] = initial_q(name, m[name].shape[1], self.rank, self.seed).to(g.device)
        ps = [m[n] @ self.q[n] for n in matrices]
        flat = torch.cat([p.reshape(-1) for p in ps])
        self.comm.all_reduce(flat)
        _copy_pieces(flat, ps)
        ps = [torch.linalg.qr(p).Q for p in ps]
        qs = [m[n].T @ p for n, p in zip(matrices, ps)]
        flat = torch.cat([q.reshape(-1) for q in qs])
        self.comm.all_reduce(flat)
        _copy_pieces(flat, qs)
        for (name, g), p, q in zip(matrices.items(), ps, qs):
            approximation = p @ q.T
            if self.feedback == "ef":
                self.residual[name] = m[name] - approximation / self.comm.size
            self.q[name] = q
            g.copy_(approximation.view_as(g))

    def residual_norm(self) -> float:
        return math.sqrt(sum(float(r.double().pow(2).sum()) for r in self.residual.values()))

    def state_dict(self) -> dict:
        return {"residual": {n: t.clone() for n, t in self.residual.items()}, "q": {n: t.clone() for n, t in self.q.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {n: t.clone() for n, t in state["residual"].items()}
        self.q = {n: t.clone() for n, t in state["q"].items()}


def initial_q(name: str, columns: int, rank: int, seed: int) -> torch.Tensor:
    """The warm start's first ``Q`` (columns × rank) of parameter ``name``: the same on every replica, and
    different for every name (a hash of the name, not a sum of its characters, which anagrams share)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(columns, rank, generator=generator, device="cpu")


def _copy_pieces(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    for t, piece in zip(tensors, split_like(flat, tensors)):
        t.copy_(piece)
