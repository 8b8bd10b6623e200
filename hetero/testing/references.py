"""Multimodal models as one module, the single-process references of the runtime on vision (and DNA)
-> LLM graphs: encoder embeddings take the places of the first tokens of the sequence."""

from __future__ import annotations

import torch
from torch import nn

from hetero.config import OptimizerConfig
from hetero.models.genezip.model import GeneZip, GeneZipOutput, padded_tokens
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.gpt.model import GPT
from hetero.models.gpt.config import GPTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.models.vit.config import ViTConfig

IMAGE_TOKEN = 0  # byte 0 (NUL) never occurs in captions; it marks the image's places in the sequence


def merge_image_embeddings(text: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """Token embeddings (batch, seq, hidden) with the first ``images.shape[1]`` positions replaced."""
    return torch.cat([images.to(text.dtype), text[:, images.shape[1] :]], dim=1)


class VisionLanguageModel(nn.Module):
    def __init__(self, vision: ViTConfig, llm: GPTConfig, seed: int = 0):
        super().__init__()
        # Each module draws its weights from its own seed, as on ranks that hold only one of them.
        torch.manual_seed(seed)
        self.vision = VisionEncoder(vision)
        torch.manual_seed(seed + 1)
        self.llm = GPT(llm)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        assert self.llm.tok_embeddings is not None
        return self.llm(merge_image_embeddings(self.llm.embed(tokens), self.vision(images)))


class VisionDnaLanguageModel(nn.Module):
    """An LLM reading an image and a DNA window: the image embeddings, then GeneZip's compressed tokens
    (zero-padded to its most tokens), then the text."""

    def __init__(self, vision: ViTConfig, dna: GeneZipConfig, llm: GPTConfig, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.vision = VisionEncoder(vision)
        torch.manual_seed(seed + 1)
        self.llm = GPT(llm)
        torch.manual_seed(seed + 2)
        self.dna = GeneZip(dna)

    def forward(self, images: torch.Tensor, bases: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, GeneZipOutput]:
        """The LLM's logits and GeneZip's own output (for its next-base and ratio losses)."""
        assert self.llm.tok_embeddings is not None
        dna = self.dna(bases)
        embeddings = torch.cat([self.vision(images), padded_tokens(dna, self.dna.config)], dim=1)
        return self.llm(merge_image_embeddings(self.llm.embed(tokens), embeddings)), dna


class RegionBudgetSteps:
    """A one-process reference's side of GeneZip's region budget: ``record`` each forward's counts, and
    pass the object as ``record_reference``'s ``before_step`` (then call it once more after the last step)
    to update the budget after every optimizer step from that step's counts at the step's ``decay_at``, as
    the runtime does."""

    def __init__(self, model: GeneZip, optim: OptimizerConfig):
        self.model, self.optim, self.pending, self.calls = model, optim, [], 0

    def record(self, output: GeneZipOutput, regions: torch.Tensor) -> None:
        if self.model.budget is not None:
            self.pending.append(self.model.budget.statistics(output.region_logits, output.routings[0].boundary, regions))

    def __call__(self, step: int | None = None) -> None:
        if self.pending:
            finished = self.calls - 1  # the first call comes before step 0
            self.model.budget.update(torch.stack(self.pending).sum(0), self.optim.decay_at(finished))
            self.pending = []
        self.calls += 1
