"""A boundary whose activations and gradients cross as codec payloads, between any two layouts.

A ``CompressedBoundary`` joins the same two module stages as a ``Boundary`` for one activation
``(..., hidden)``, but what crosses is the codec's parts (integer codes, scales, values, indices). Codecs
work along the hidden dim, which no layout shards, so each part is resharded by an ordinary ``Boundary``
carrying a dict of non-differentiable tensors with the activation's sharding: one boundary forward
(source to destination) and one running the other way for the gradients. The upstream end (source
ranks) encodes activations and decodes gradients; the downstream end (destination ranks) the reverse;
a colocated rank is both. The ends compensate errors as ``EdgeEnd`` describes.

Gradients. Compressed payloads cannot be summed, so the reverse boundary copies rather than reduces:
every destination replica of a shard (e.g. the LLM's TP ranks) must hand in the *full* gradient of its
shard, bit for bit the same on each (TP ranks hold exactly that after their all-reduce), and the source
gets it once. This differs from ``Boundary.backward``, where replicas hand in parts of a sum.

    edge = CompressedBoundary("vision->llm", Side(vision), Side(llm), spec, hidden, config)
    edge.begin_step(source_rows, destination_rows, fresh)   # once a step: row keys per microbatch
    out = edge.forward(m, x, shape)      # destination ranks: the decoded shard of microbatch m
    grad = edge.backward(m, grad_out)    # source ranks: the decoded gradient of their x

Built with ``async_sends=True``, send-only crossings return before delivery, as ``Boundary``'s do (the
graph pipeline's stages call the two sides in different orders); ``wait_sends()`` once a step.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hetero.errors import ConfigError
from hetero.parallel.boundary import Boundary, Rows, Side, TensorSpec
from hetero.parallel.compression.activation_codecs import ActivationCodec
from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.compression.payload import part_shapes
from hetero.parallel.layout import Layout


class CompressedBoundary:
    """One activation edge between two modules' stages, compressed per ``config`` (see the module docstring).

    Construct it on every rank of the world, in the same order as every other boundary: it builds its
    boundaries (and their process groups) there. ``hidden`` is the activation's last dim."""

    def __init__(
        self,
        name: str,
        source: Side | Layout,
        destination: Side | Layout,
        spec: TensorSpec,
        hidden: int,
        config: EdgeCompressionConfig,
        *,
        timeout_s: float = 300.0,
        async_sends: bool = False,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
    ) -> None:
        source = source if isinstance(source, Side) else Side(source)
        destination = destination if isinstance(destination, Side) else Side(destination)
        source = source.resolve(source.layout.pp - 1, f"boundary {name!r} source")
        destination = destination.resolve(0, f"boundary {name!r} destination")
        if not spec.differentiable:
            raise ConfigError(f"compressed boundary {name!r}: the activation must be floating point, got {spec.dtype}")
        last = spec.ndim - 1
        for side in (spec.source, spec.destination):
            if last in (side.batch_dim, side.seq_dim):
                raise ConfigError(
                    f"compressed boundary {name!r}: codecs work along the last dim ({last}), so no side may "
                    f"shard it; got {side}"
                )
        errors = config.errors(f"boundary {name!r}", hidden=hidden)
        if errors:
            raise ConfigError("\n".join(errors))
        self.name, self.config, self.hidden = name, config, hidden
        # Separate ends for the two roles: a colocated rank is both, with other rows on each side.
        self.upstream = EdgeEnd(config, "upstream", name)
        self.downstream = EdgeEnd(config, "downstream", name)

        def parts_spec(codec: ActivationCodec, src, dst) -> dict[str, TensorSpec]:
            return {key: TensorSpec(spec.ndim, dtype, src, dst) for key, (dtype, _) in codec.widths(hidden).items()}

        common = dict(timeout_s=timeout_s, async_sends=async_sends, device=device, group=group)
        # One forward boundary per payload signature: the refresh codec may send other parts.
        self.forward_boundaries: dict[tuple, Boundary] = {}
        for label, codec in (("forward", self.upstream.forward_codec), ("refresh", self.upstream.refresh_codec)):
            if _signature(codec, hidden) not in self.forward_boundaries:
                self.forward_boundaries[_signature(codec, hidden)] = Boundary(
                    f"{name}:{label}", source, destination,
                    parts_spec(codec, spec.source, spec.destination), **common,
                )
        self.backward_boundary = Boundary(
            f"{name}:backward", destination, source,
            parts_spec(self.upstream.backward_codec, spec.destination, spec.source), **common,
        )
        self.is_source = self.backward_boundary.is_destination
        self.is_destination = self.backward_boundary.is_source

    def begin_step(
        self,
        source_rows: list[torch.Tensor],
        destination_rows: list[torch.Tensor],
        fresh: bool,
        sample_ids: torch.Tensor | None = None,
    ) -> None:
        """Row keys of this step on each side (see ``EdgeEnd.begin_step``); a side this rank is not on is
        ignored."""
        if self.is_source:
            self.upstream.begin_step(source_rows, fresh, sample_ids)
        if self.is_destination:
            self.downstream.begin_step(destination_rows, fresh, sample_ids)

    def memory_bytes(self) -> int:
        return self.upstream.memory_bytes() + self.downstream.memory_bytes()

    def forward(
        self, microbatch: int, x: torch.Tensor | None, shape: Sequence[int], rows: Rows = Rows()
    ) -> torch.Tensor | None:
        """Move microbatch ``microbatch``'s activation (source ranks pass it) to the destination layout;
        ``rows``: each side's DP rows, as for ``Boundary.forward``."""
        shape = tuple(int(n) for n in shape)
        codec = (self.upstream if self.is_source else self.downstream).codec("forward")
        parts = self.upstream.encode_forward(microbatch, x) if self.is_source else None  # type: ignore[arg-type]
        boundary = self.forward_boundaries[_signature(codec, self.hidden)]
        transfer = boundary.forward(parts, part_shapes(codec, shape), rows)
        if not self.is_destination:
            return None
        return self.downstream.decode_forward(microbatch, transfer.output, shape[-1])  # type: ignore[arg-type]

    def backward(
        self, microbatch: int, grad: torch.Tensor | None, shape: Sequence[int], rows: Rows = Rows()
    ) -> torch.Tensor | None:
        """Route the full gradient of the destination shard (destination ranks) back to the source ranks;
        ``rows`` as the forward call's."""
        shape = tuple(int(n) for n in shape)
        codec = self.upstream.codec("backward")
        parts = self.downstream.encode_backward(microbatch, grad) if self.is_destination else None  # type: ignore[arg-type]
        transfer = self.backward_boundary.forward(parts, part_shapes(codec, shape), Rows(rows.destination, rows.source))
        if not self.is_source:
            return None
        return self.upstream.decode_backward(microbatch, transfer.output, shape[-1])  # type: ignore[arg-type]

    def wait_sends(self) -> None:
        for boundary in (*self.forward_boundaries.values(), self.backward_boundary):
            boundary.wait_sends()

    def counters(self) -> dict[str, int]:
        """Wire bytes as ``Boundary.counters`` names them: ``forward.*`` activations, ``backward.*`` gradients."""
        out: dict[str, int] = {}
        directions = [("forward", b) for b in self.forward_boundaries.values()] + [("backward", self.backward_boundary)]
        for direction, boundary in directions:
            for key, value in boundary.counters().items():
                if key.startswith("forward."):
                    name = f"{direction}.{key.removeprefix('forward.')}"
                    out[name] = out.get(name, 0) + value
        return out


def _signature(codec: ActivationCodec, hidden: int) -> tuple:
    return tuple(sorted((name, dtype) for name, (dtype, _) in codec.widths(hidden).items()))
