"""What the Qwen-VL tests share: the LLM's logits of an evaluation on its ranks, and transformers' loss of a
Qwen-VL on hetero's rows."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from hetero.data.digits import IGNORE_INDEX
from hetero.parallel.context import zigzag_indices


def llm_logits(runtime, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank: evaluate ``batch``; on the LLM's ranks (module ``llm``) the positions this rank holds
    (its zigzag chunks under CP) and their logits, the microbatches' rows in order; None elsewhere."""
    if "llm" not in runtime.modules:
        runtime.evaluate([batch])
        return None
    seen = []

    def keep(_, __, out):
        logits = out[0] if isinstance(out, tuple) else out
        seen.append((logits.full_tensor() if isinstance(logits, DTensor) else logits).detach().clone())

    hook = runtime.modules["llm"].model.register_forward_hook(keep)
    runtime.evaluate([batch])
    hook.remove()
    mesh = runtime.modules["llm"].mesh
    held = zigzag_indices(runtime.graph.nodes["llm"].config.seq_len, mesh.layout.cp, mesh.coord.cp, device="cpu")
    return held, torch.cat(seen)


def transformers_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A transformers Qwen-VL's loss on hetero's rows, as hetero divides it (summed over the supervised
    labels, over their count): each row with its images' patches and grids."""
    sizes = batch["image_grid"].prod(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), sizes.cumsum(0)])
    total = 0
    for r in range(len(batch["tokens"])):
        mine = torch.nonzero(batch["image_row"] == r).flatten()
        extra = {}
        if len(mine):
            extra = {"pixel_values": torch.cat([batch["image_patches"][offsets[i]:offsets[i + 1]] for i in mine]),
                     "image_grid_thw": batch["image_grid"][mine]}
        ids = batch["tokens"][r]
        types = (ids == model.config.image_token_id).int()
        logits = model(input_ids=ids[None], mm_token_type_ids=types[None], **extra).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, batch["labels"][r], reduction="sum")
    return total / int((batch["labels"] != IGNORE_INDEX).sum())
