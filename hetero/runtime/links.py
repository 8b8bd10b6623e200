"""The links between a module's pipeline stages on this rank: activations to the next stage, gradients
to the previous one, as fp32 or, in training under the module's ``compression.pipeline``, as codec
payloads through this rank's ends of the compressed stage edges (``EdgeEnd``)."""

from __future__ import annotations

import torch

from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.compression.payload import pack, unpack
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.pipeline import StageLink


class StageLinks:
    def __init__(self, mesh: ModuleMesh, compression: EdgeCompressionConfig, device: torch.device):
        layout, coord = mesh.layout, mesh.coord
        self.previous = StageLink(layout.rank_at(coord._replace(pp=coord.pp - 1)), device=device) if coord.pp > 0 else None
        self.next = (StageLink(layout.rank_at(coord._replace(pp=coord.pp + 1)), device=device)
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
        end = self.ends.get("previous") if self.compressed else None
        if end is None:
            return self.previous.recv(shape, torch.float32)
        buffer = self.previous.recv((end.payload_bytes("forward", shape),), torch.uint8)
        return end.decode_forward(m, unpack(end.codec("forward"), buffer, shape), shape[-1])

    def send_activation(self, m: int, x: torch.Tensor) -> None:
        end = self.ends.get("next") if self.compressed else None
        # The residual stream stays fp32 under bf16 autocast, so stages exchange fp32 activations.
        self.next.send(x.float() if end is None else pack(end.encode_forward(m, x.float())), "forward")

    def recv_grad(self, m: int, shape: tuple[int, ...]) -> torch.Tensor:
        end = self.ends.get("next") if self.compressed else None
        if end is None:
            return self.next.recv(shape, torch.float32)
        buffer = self.next.recv((end.payload_bytes("backward", shape),), torch.uint8)
        return end.decode_backward(m, unpack(end.codec("backward"), buffer, shape), shape[-1])

    def send_grad(self, m: int, grad: torch.Tensor) -> None:
        end = self.ends.get("previous") if self.compressed else None
        self.previous.send(grad.float() if end is None else pack(end.encode_backward(m, grad.float())), "backward")

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
