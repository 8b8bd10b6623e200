"""The ``projector`` kind: a LLaVA-style MLP (Linear-GELU-Linear) of a vision tower's features into the
LLM's width, a module with a layout of its own between the tower and the LLM.

Reads no batch columns; input ``features`` (``tokens`` × ``in_size``): one edge from the tower, on the
rows that carry an image; output ``embeddings`` (``tokens`` × ``out_size``), e.g. into the LLM's
placeholders. It has no loss of its own: it learns from the gradients its consumers return, and returns
the features' gradients to the tower.

With ``items`` it takes images as items from a tower of items (``vit`` with ``items``): any number per
row, ``tokens`` each, which it hands on as items (routed to the LLM's placeholders, ``image_row`` from
``image_start``). It reads no column but ``image_row``, for the item count; its DP replicas split the
items evenly.
"""

from __future__ import annotations

import torch

from hetero.kinds.columns import INTEGER, Column
from hetero.kinds.flops import projector_forward_flops_per_image
from hetero.kinds.registry import Kind, Port, StageResult, StageStep
from hetero.models.projector.config import ProjectorConfig
from hetero.models.projector.model import MLPProjector
from hetero.models.projector.plan import parallelize_projector


class ProjectorKind(Kind):
    name = "projector"
    config = ProjectorConfig
    modality = "image"

    def build(self, config: ProjectorConfig) -> MLPProjector:
        model = MLPProjector(config.in_size, config.out_size)
        model.reset_parameters()
        return model

    def parallelize(self, model, mesh, options):
        return parallelize_projector(model, mesh, options)

    def pretrained_config(self, module, path, fields):
        from hetero.interop.parts import open_part
        from hetero.models.projector.hf import projector_config

        config = projector_config(open_part(path, "projector"), fields, module)
        self.check_given(module, config, fields, {"items"})
        return config

    def hf_export(self, config, source):
        from hetero.models.projector.hf import projector_export

        return projector_export(source)

    def load_pretrained(self, model, path):
        from hetero.models.projector.hf import load_projector

        return load_projector(model, path)

    def per_item(self, config: ProjectorConfig) -> bool:
        return config.items

    def forward_flops(self, config: ProjectorConfig) -> float:
        return projector_forward_flops_per_image(config.in_size, config.out_size, config.tokens)

    def item_costs(self, config: ProjectorConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.ones(len(batch["image_row"]), dtype=torch.long, device="cpu")

    def item_tokens(self, config: ProjectorConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.full((len(batch["image_row"]),), config.tokens, dtype=torch.long, device="cpu")

    def columns(self, config: ProjectorConfig) -> tuple[Column, ...]:
        return (Column("image_row", (), INTEGER, rows=False),) if config.items else ()

    def inputs(self, config: ProjectorConfig) -> dict[str, Port]:
        return {"features": Port(config.in_size, tokens=config.tokens, field="in_size")}

    def outputs(self, config: ProjectorConfig) -> dict[str, Port]:
        return {"embeddings": Port(config.out_size, tokens=config.tokens, field="out_size")}

    def has_loss(self, config: ProjectorConfig) -> bool:
        return False

    def stage(self, model: MLPProjector, step: StageStep) -> StageResult:
        (arrival,) = step.inputs
        return StageResult(outputs={"embeddings": model(arrival.tensor)})
