"""One end of a compressed edge: encode what this rank sends, decode what it receives, compensate errors.

An edge has an upstream end (it sends activations forward and receives their gradients) and a downstream
end (the reverse). Both ends of the forward direction keep the same reference for each row, so only the
compressed *change* needs to cross; the gradient's sender keeps the error it left out. Rows are the
batch entries of the tensor (dim 0), named by a key per row that the runtime gives at each step.

Why not per-sample memory. AQ-SGD makes activation compression converge by sending, for every training
sample, the compressed difference to that sample's activation from its previous visit, so both ends
keep one activation per sample of the dataset: memory that grows with the dataset and pays off only after
many epochs. Clapping's observation is that the reference only has to outlive the gap between two visits
of a sample: with *lazy sampling*, where each batch is reused for ``train.sample_reuse`` consecutive
steps, consecutive visits are one step apart, the weights have moved by a single optimizer step, and the
change is small enough for 2 bits to carry it. The reference (forward) and the left-out error (backward)
therefore live only for the rows of the current batch and are dropped when a fresh batch is drawn: their
memory is one step's activations at this edge, whatever the dataset size.

- ``lazy`` (Clapping-style): forward sends ``C(x - ref)`` and both ends set ``ref += D(C(x - ref))``;
  backward sends ``C(g + e)`` and keeps ``e = g + e - D(C(g + e))`` (error feedback). Keys: the row's
  position in the global batch; both stores are cleared when a fresh batch begins.
- ``per_sample`` (AQ-SGD-style, the memory-hungry reference): the forward reference is keyed by the
  sample's id and never cleared (memory grows with the samples seen); backward is compressed directly.
- ``none``: each tensor is compressed on its own.

A lossless codec (identity) skips compensation, so the edge passes its tensors through unchanged. The
first visit of a row has a zero reference, so it is compressed directly; under ``lazy`` that is the
fresh batch's first step, which may use a codec of more bits (``refresh``).
"""

from __future__ import annotations

from typing import Literal

import torch

from hetero.parallel.compression.activation_codecs import (
    ActivationCodec,
    Parts,
    build_activation_codec,
    payload_bytes,
)
from hetero.parallel.compression.edge_config import EdgeCompressionConfig

Role = Literal["upstream", "downstream"]


class RowStore:
    """Tensors kept per row key (one row of an activation each), gathered and updated by key lists."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def get(self, keys: list[int], like: torch.Tensor) -> torch.Tensor:
        if not self.rows or not keys:  # nothing kept yet, or no rows (a replica with none this microbatch)
            return torch.zeros_like(like)
        zero = torch.zeros_like(like[0])
        return torch.stack([self.rows.get(key, zero) for key in keys])

    def put(self, keys: list[int], values: torch.Tensor) -> None:
        for key, row in zip(keys, values.detach()):
            self.rows[key] = row.clone()

    def clear(self) -> None:
        self.rows.clear()

    def state_dict(self) -> dict[int, torch.Tensor]:
        return dict(self.rows)

    def load_state_dict(self, rows: dict[int, torch.Tensor]) -> None:
        self.rows = {int(key): row.clone() for key, row in rows.items()}

    def nbytes(self) -> int:
        return sum(row.numel() * row.element_size() for row in self.rows.values())


class EdgeEnd:
    """This rank's end of one compressed edge, with its codecs, compensation state and byte counts."""

    def __init__(self, config: EdgeCompressionConfig, role: Role, name: str = "edge"):
        self.config, self.role, self.name = config, role, name
        self.forward_codec: ActivationCodec = build_activation_codec(config.forward)
        self.backward_codec: ActivationCodec = build_activation_codec(config.backward)
        self.refresh_codec = (
            build_activation_codec(config.refresh) if config.refresh.method != "none" else self.forward_codec
        )
        self.compensation = config.compensation
        self.fresh = False
        self.reference = RowStore()  # forward: the reconstruction both ends share
        self.residual = RowStore()  # backward, on the downstream end: the error left out so far
        self._keys: list[list[int]] = []
        self.sent_bytes = {"forward": 0, "backward": 0}  # payload bytes this end encoded
        self.raw_bytes = {"forward": 0, "backward": 0}  # what the same tensors take in fp32

    def begin_step(self, rows: list[torch.Tensor], fresh: bool, sample_ids: torch.Tensor | None = None) -> None:
        """Set this step's row keys: ``rows[m]`` holds the global-batch row of each local row of microbatch
        ``m``. ``fresh``: the batch was just drawn (not a reuse), which ends the lazy stores' lifetime."""
        if self.compensation == "per_sample":
            if sample_ids is None:
                raise ValueError(
                    f"{self.name}: compensation=per_sample keys its cache by sample id; the batch must carry "
                    f"sample ids (e.g. the digits batches' 'index')"
                )
            self._keys = [sample_ids[r].tolist() for r in rows]
        else:
            self._keys = [r.tolist() for r in rows]
        self.fresh = fresh
        if fresh and self.compensation == "lazy":
            self.reference.clear()
            self.residual.clear()

    def codec(self, direction: str) -> ActivationCodec:
        """The codec this step's tensors of ``direction`` travel in: both ends agree, since both know
        whether the batch is fresh."""
        if direction == "backward":
            return self.backward_codec
        return self.refresh_codec if self.fresh and self.compensation == "lazy" else self.forward_codec

    # forward: upstream encodes, downstream decodes

    def encode_forward(self, microbatch: int, x: torch.Tensor) -> Parts:
        codec = self.codec("forward")
        if codec.lossless or self.compensation == "none":
            parts = codec.encode(x)
        else:
            keys = self._keys[microbatch]
            reference = self.reference.get(keys, x)
            parts = codec.encode(x - reference)
            self.reference.put(keys, reference + codec.decode(parts, x.shape[-1]))
        self._count("forward", parts, x)
        return parts

    def decode_forward(self, microbatch: int, parts: Parts, hidden: int) -> torch.Tensor:
        codec = self.codec("forward")
        delta = codec.decode(parts, hidden)
        if codec.lossless or self.compensation == "none":
            return delta
        keys = self._keys[microbatch]
        x = self.reference.get(keys, delta) + delta
        self.reference.put(keys, x)
        return x

    # backward: downstream encodes, upstream decodes

    def encode_backward(self, microbatch: int, grad: torch.Tensor) -> Parts:
        codec = self.backward_codec
        if codec.lossless or self.compensation != "lazy":
            parts = codec.encode(grad)
        else:
            keys = self._keys[microbatch]
            target = grad + self.residual.get(keys, grad)
            parts = codec.encode(target)
            self.residual.put(keys, target - codec.decode(parts, grad.shape[-1]))
        self._count("backward", parts, grad)
        return parts

    def decode_backward(self, microbatch: int, parts: Parts, hidden: int) -> torch.Tensor:
        return self.backward_codec.decode(parts, hidden)

    def state_dict(self) -> dict:
        """The compensation state: a resumed run sends exactly what the uninterrupted one would."""
        return {"reference": self.reference.state_dict(), "residual": self.residual.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reference.load_state_dict(state["reference"])
        self.residual.load_state_dict(state["residual"])

    def memory_bytes(self) -> int:
        """Bytes held for error compensation on this rank's end."""
        return self.reference.nbytes() + self.residual.nbytes()

    def payload_bytes(self, direction: str, shape: tuple[int, ...]) -> int:
        return payload_bytes(self.codec(direction), shape)

    def _count(self, direction: str, parts: Parts, x: torch.Tensor) -> None:
        self.sent_bytes[direction] += sum(p.numel() * p.element_size() for p in parts.values())
        self.raw_bytes[direction] += x.numel() * 4
