"""Per-step data-parallel gradient sync with a compressed payload and error feedback.

Gradients are packed into flat fp32 buckets; each bucket's sum over replicas is computed by a codec.
Error feedback keeps, per parameter, what compression left out:

- ``ef``: send ``C(g + e)`` and keep ``e <- g + e - C(g + e)`` (error feedback as in EF-SGD);
- ``ef21``: keep a running estimate ``h`` of this replica's gradient and ``H`` of the sum; send
  ``c = C(g - h)``, then ``h <- h + c`` and ``H <- H + sum(c)``; the optimizer sees ``H``;
- ``none``: send ``C(g)``.

Every buffer is in ``state_dict()``, so a resumed run continues exactly.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from hetero.parallel.compression.codecs import Codec
from hetero.parallel.compression.collective import Collective
from hetero.parallel.data import AfterBackwardSync, bucketed, local_grad, split_like


class CompressedGradSync(AfterBackwardSync):
    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        comm: Collective,
        codec: Codec,
        feedback: str,
        bucket_bytes: int = 25 * 2**20,
    ):
        if feedback not in ("ef", "ef21", "none"):
            raise ValueError(f"error feedback must be ef, ef21 or none, got {feedback!r}")
        self.params = dict(named_params)
        self.comm, self.codec, self.feedback = comm, codec, feedback
        self.bucket_bytes = bucket_bytes
        self.buffers: dict[str, dict[str, torch.Tensor]] = {"residual": {}, "local": {}, "total": {}}
        self.bucket_state: dict[int, dict] = {}

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    def sync(self) -> None:
        named = [(name, g) for name, g in ((n, local_grad(p)) for n, p in self.params.items()) if g is not None]
        for index, bucket in enumerate(bucketed(named, self.bucket_bytes)):
            grads = [g for _, g in bucket]
            if any(g.dtype != torch.float32 for g in grads):
                raise TypeError("compressed gradient sync needs fp32 gradients (parameters stay fp32 under bf16)")
            flat = torch.cat([g.reshape(-1) for g in grads])
            state = self.bucket_state.setdefault(index, {})
            if self.feedback == "ef":
                residual = self._flat("residual", bucket)
                total = self.codec.exchange_with_feedback(flat, residual, self.comm, state)
                self._unflat("residual", bucket, residual)
            elif self.feedback == "ef21":
                local, total = self._flat("local", bucket), self._flat("total", bucket)
                summed, own = self.codec.exchange(flat - local, self.comm, state)
                self._unflat("local", bucket, local + own)
                total = total + summed
                self._unflat("total", bucket, total)
            else:
                total, _ = self.codec.exchange(flat, self.comm, state)
            for g, piece in zip(grads, split_like(total, grads)):
                g.copy_(piece)

    def residual_norm(self) -> float:
        """L2 norm of every error-feedback residual on this replica (0 without ``ef``)."""
        return math.sqrt(sum(float(r.double().pow(2).sum()) for r in self.buffers["residual"].values()))

    def state_dict(self) -> dict:
        return {
            "buffers": {kind: {n: t.clone() for n, t in b.items()} for kind, b in self.buffers.items()},
            "bucket_state": {i: dict(s) for i, s in self.bucket_state.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.buffers = {kind: {n: t.clone() for n, t in b.items()} for kind, b in state["buffers"].items()}
        self.bucket_state = {int(i): dict(s) for i, s in state["bucket_state"].items()}

    def _flat(self, kind: str, bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
        store = self.buffers[kind]
        return torch.cat([store.get(n, torch.zeros_like(g)).reshape(-1) for n, g in bucket])

    def _unflat(self, kind: str, bucket: list[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
        for (name, _), piece in zip(bucket, split_like(flat, [g for _, g in bucket])):
            self.buffers[kind][name] = piece.clone()
