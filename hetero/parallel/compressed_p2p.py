"""Compressed links between two pipeline stages of one module: payload bytes over point-to-point.

``CompressedNextLink`` is the upstream stage's link to the next stage (activations out, gradients in);
``CompressedPreviousLink`` the downstream stage's link to the previous one. Each pairs with the other
end's link on the neighbouring rank and carries, per microbatch, one flat byte buffer of the codec's
parts in each direction; both ends know the activation shape and this step's codecs (build the links
after ``EdgeEnd.begin_step``), so the sizes are known in advance::

    upstream = EdgeEnd(config, "upstream"); downstream = EdgeEnd(config, "downstream")
    stage0 = LinkedTransport(None, CompressedNextLink(1, shape, upstream))         # rank 0
    stage1 = LinkedTransport(CompressedPreviousLink(0, shape, downstream), None)   # rank 1
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.payload import pack, unpack
from hetero.parallel.pipeline import P2PTransport


class _CompressedLink:
    def __init__(
        self,
        peer: int,
        shape: Sequence[int],
        end: EdgeEnd,
        upstream: bool,
        group: dist.ProcessGroup | None,
        device: torch.device | str,
    ) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.end = end
        prev, nxt = (None, peer) if upstream else (peer, None)
        # One transport a direction: the two directions' payloads have different sizes.
        self.forward = P2PTransport(prev, nxt, (end.payload_bytes("forward", self.shape),), torch.uint8, group, device)
        self.backward = P2PTransport(prev, nxt, (end.payload_bytes("backward", self.shape),), torch.uint8, group, device)

    def finish(self) -> None:
        self.forward.finish()
        self.backward.finish()

    @property
    def sent_bytes(self) -> dict[str, int]:
        """Payload bytes this link sent, per direction."""
        return {d: self.forward.sent_bytes[d] + self.backward.sent_bytes[d] for d in ("forward", "backward")}


class CompressedNextLink(_CompressedLink):
    """The upstream stage's next link: encoded activations to ``next_rank``, encoded gradients back."""

    def __init__(self, next_rank: int, shape: Sequence[int], end: EdgeEnd,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(next_rank, shape, end, True, group, device)

    def send_forward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self.forward.send_forward(microbatch, pack(self.end.encode_forward(microbatch, tensor)))

    def recv_backward(self, microbatch: int) -> torch.Tensor:
        parts = unpack(self.end.codec("backward"), self.backward.recv_backward(microbatch), self.shape)
        return self.end.decode_backward(microbatch, parts, self.shape[-1])


class CompressedPreviousLink(_CompressedLink):
    """The downstream stage's previous link: activations decoded from ``prev_rank``, gradients encoded back."""

    def __init__(self, prev_rank: int, shape: Sequence[int], end: EdgeEnd,
                 group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(prev_rank, shape, end, False, group, device)

    def recv_forward(self, microbatch: int) -> torch.Tensor:
        parts = unpack(self.end.codec("forward"), self.forward.recv_forward(microbatch), self.shape)
        return self.end.decode_forward(microbatch, parts, self.shape[-1])

    def send_backward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self.backward.send_backward(microbatch, pack(self.end.encode_backward(microbatch, tensor)))
