"""The links between a module's pipeline stages on this rank: activations to the next stage, gradients
to the previous one, as fp32 or, in training under the module's ``compression.pipeline``, as codec
payloads through this rank's ends of the compressed stage edges (``EdgeEnd``)."""

from __future__ import annotations

import torch

from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.compression.payload import pack, unpack
from hetero.parallel.mesh import STAGE_GROUPS, ModuleMesh
from hetero.parallel.pipeline import StageLink


class StageLinks:
    def __init__(self, mesh: ModuleMesh, compression: EdgeCompressionConfig, device: torch.device):
        layout, coord = mesh.layout, mesh.coord
        activations, gradients = (mesh.groups.get(kind) for kind in STAGE_GROUPS)
        # activations go to the next stage and gradients to the previous one, each on its own group
        self.previous = (StageLink(layout.rank_at(coord._replace(pp=coord.pp - 1)), gradients, activations, device)
                         if coord.pp > 0 else None)
        self.next = (StageLink(layout.rank_at(coord._replace(pp=coord.pp + 1)), activations, gradients, device)
                     if coord.pp < layout.pp - 1 else None)
        self.ends: dict[str, EdgeEnd] = {}  # "previous" / "next": this rank's ends of compressed stage edges
        if compression.enabled and layout.pp > 1:
            if self.previous is not None:
                self.ends["previous"] = EdgeEnd(compression, "downstream", f"{mesh.name} stage edge")
            if self.next is not None:
                self.ends["next"] = EdgeEnd(compression, "upstream", f"{mesh.name} stage edge")
        self.compressed = False  # this pass sends payloads (a training step with ends)

    def begin(self, compressed: bool, rows: list[torch.Tensor], fresh: bool, sample_ids: torch.Tensor | None) -> None:
        """A pass starts, through the codecs or not (training passes with ends do); ``rows`` key the
        compensation stores."""
        self.compressed = compressed and bool(self.ends)
        if self.compressed:
            for end in self.ends.values():
                end.begin_step(rows, fresh, sample_ids)

    def recv_activation(self, m: int, shape: tuple[int, ...]) -> torch.Tensor:
        buffer = self.previous.recv(*self._incoming("previous", "forward", shape))
        return self._decode("previous", "forward", m, buffer, shape)

    def send_activation(self, m: int, x: torch.Tensor) -> None:
        self.next.send(self._outgoing("next", "forward", m, x), "forward")

    def recv_grad(self, m: int, shape: tuple[int, ...]) -> torch.Tensor:
        buffer = self.next.recv(*self._incoming("next", "backward", shape))
        return self._decode("next", "backward", m, buffer, shape)

    def send_grad(self, m: int, grad: torch.Tensor) -> None:
        self.previous.send(self._outgoing("previous", "backward", m, grad), "backward")

    def _end(self, side: str) -> EdgeEnd | None:
        return self.ends.get(side) if self.compressed else None

    def _outgoing(self, side: str, direction: str, m: int, x: torch.Tensor) -> torch.Tensor:
        # The residual stream stays fp32 under bf16 autocast, so stages exchange fp32 activations.
        end = self._end(side)
        if end is None:
            return x.float()
        encode = end.encode_forward if direction == "forward" else end.encode_backward
        return pack(encode(m, x.float()))

    def _incoming(self, side: str, direction: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of what arrives from ``side`` for a tensor of ``shape``."""
        end = self._end(side)
        return (shape, torch.float32) if end is None else ((end.payload_bytes(direction, shape),), torch.uint8)

    def _decode(self, side: str, direction: str, m: int, buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        end = self._end(side)
        if end is None:
            return buffer
        decode = end.decode_forward if direction == "forward" else end.decode_backward
        return decode(m, unpack(end.codec(direction), buffer, shape), shape[-1])

    def finish(self) -> None:
        for link in (self.previous, self.next):
            if link is not None:
                link.finish()

    @property
    def sent_bytes(self) -> dict[str, int]:
        totals = dict.fromkeys(("forward", "backward"), 0)
        for link in (self.previous, self.next):
            for direction, sent in (link.sent_bytes.items() if link is not None else ()):
                totals[direction] += sent
        return totals
