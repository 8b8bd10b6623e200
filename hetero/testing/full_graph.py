"""The four-module graph as one process: vision and DNA encoders feed an LLM, whose hidden states
condition a video generator; the single-process reference of the runtime on that graph
(``tests/test_graph_parity.py``), written with the models and objectives directly, not the kinds' stages:

- samples carry optional modalities (``hetero.data.multimodal``): an encoder reads only the rows that
  carry its input, and its embeddings replace the placeholder tokens of those rows alone (the other rows
  keep the placeholders' own token embeddings);
- ``text``: next-token cross-entropy summed over the batch, over the count of supervised tokens;
- ``dna``: GeneZip's next-base and ratio losses summed over the rows with DNA, over their count;
- ``video``: the flow-matching loss of each clip, conditioned on the LLM's final hidden states of its
  row, summed over the rows with a clip, over their count. Each clip draws its noise from its own
  generator (``clip_generator``), so the loss does not depend on which rank or microbatch holds the clip;
- the combined loss weights each of the three by its module's ``loss_weight``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hetero.models.genezip.model import GeneZip, padded_tokens
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.objectives import genezip_loss
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.config import GPTConfig
from hetero.models.video.config import VideoConfig
from hetero.models.video.objectives import flow_matching_loss, to_model
from hetero.models.video.spec import VideoModule, clip_generator
from hetero.models.vit.model import VisionEncoder
from hetero.models.vit.config import ViTConfig

LOSSES = ("text", "dna", "video")  # the graph's own losses, in this order wherever they are listed
SEED_OFFSETS = {"vision": 0, "llm": 1, "dna": 2, "video": 3}  # each module's weights from its own seed


@dataclass(frozen=True)
class GraphConfigs:
    vision: ViTConfig
    dna: GeneZipConfig
    llm: GPTConfig
    video: VideoConfig

    def embedding_shape(self, encoder: str) -> tuple[int, int]:
        """(tokens, width) one sample's embeddings from ``encoder`` take in the LLM's sequence."""
        if encoder == "vision":
            return self.vision.num_patches, self.vision.out_size
        return self.dna.max_tokens(), self.dna.out_size

    def placeholder_start(self, encoder: str) -> int:
        """Where ``encoder``'s embeddings begin in the sequence: the image's first, then the DNA's."""
        return 0 if encoder == "vision" else self.vision.num_patches


def merge_rows(text: torch.Tensor, start: int, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``text`` (batch, seq, hidden) with positions ``start:start + values.shape[1]`` of rows ``rows``
    replaced by ``values`` (len(rows), tokens, hidden); other rows unchanged. Differentiable in both."""
    out = text.clone()
    out[rows, start : start + values.shape[1]] = values.to(text.dtype)
    return out


def clip_loss_sum(
    video: nn.Module, config: VideoConfig, clips: torch.Tensor, condition: torch.Tensor, indices: Sequence[int],
    seed: int, step: int,
) -> torch.Tensor:
    """Sum over clips (B, T, C, S, S) in [0, 1] of each clip's flow-matching loss given its conditioning
    hidden states (B, L, condition_size); clip ``k`` draws noise from ``clip_generator(.., indices[k])``."""
    frames = to_model(clips)
    losses = [
        flow_matching_loss(video, frames[k : k + 1], config.memory, clip_generator(seed, step, index),
                           condition[k : k + 1])
        for k, index in enumerate(indices)
    ]
    return torch.stack(losses).sum() if losses else condition.sum() * 0


def dna_loss_sum(dna: nn.Module, config: GeneZipConfig, bases: torch.Tensor, regions: torch.Tensor):
    """GeneZip's output on windows ``bases`` and the sum over them of its next-base plus ratio losses."""
    output = dna(bases)
    return output, genezip_loss(config, output, bases, regions).total(config).sum()


class FullGraphModel(nn.Module):
    """Every module of the graph in one process, with the weights the runtime starts from (each module from seed + its position)."""

    def __init__(self, configs: GraphConfigs, seed: int = 0):
        super().__init__()
        self.configs = configs
        builders = {"vision": lambda: VisionEncoder(configs.vision), "llm": lambda: GPT(configs.llm),
                    "dna": lambda: GeneZip(configs.dna), "video": lambda: VideoModule(configs.video)}
        for name, offset in SEED_OFFSETS.items():
            torch.manual_seed(seed + offset)
            setattr(self, name, builders[name]())

    def losses(self, batch: Mapping[str, torch.Tensor], seed: int, step: int) -> dict[str, torch.Tensor]:
        """The three losses (``LOSSES``) of a global batch from ``hetero.data.multimodal``."""
        configs = self.configs
        image_rows = torch.nonzero(batch["has_image"]).flatten()
        dna_rows = torch.nonzero(batch["has_dna"]).flatten()
        clip_rows = torch.nonzero(batch["has_clip"]).flatten()
        h = self.llm.embed(batch["tokens"])
        if len(image_rows):
            h = merge_rows(h, 0, self.vision(batch["images"][image_rows]), image_rows)
        dna_sum = torch.zeros(())
        if len(dna_rows):
            output, dna_sum = dna_loss_sum(self.dna, configs.dna, batch["dna"][dna_rows], batch["dna_regions"][dna_rows])
            h = merge_rows(h, configs.placeholder_start("dna"), padded_tokens(output, configs.dna), dna_rows)
        logits, hidden = self.llm(h, return_hidden=True)
        labels = batch["labels"]
        text = token_loss_sum(logits, labels) / int((labels != -100).sum())
        video_sum = clip_loss_sum(self.video.generator, configs.video, batch["clips"][clip_rows], hidden[clip_rows],
                                  batch["index"][clip_rows].tolist(), seed, step)
        return {"text": text, "dna": dna_sum / max(len(dna_rows), 1), "video": video_sum / max(len(clip_rows), 1)}


def combined_loss(losses: Mapping[str, torch.Tensor | float], weights: Mapping[str, float]):
    """Σ weight × loss over ``LOSSES``."""
    return sum(weights[name] * losses[name] for name in LOSSES)
