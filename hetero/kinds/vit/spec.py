"""The ``vit`` kind: a vision encoder (ViT and projector) of the rows that carry an image.

Reads ``images`` of the rows with ``has_image`` (every row when a batch has no such flag); output
``embeddings``: ``num_patches`` tokens of width ``out_size`` per image. It has no loss of its own: it
learns from the gradients its consumers return.
"""

from __future__ import annotations

from hetero.kinds.registry import Kind, Port, StageResult, StageStep
from hetero.kinds.vit.config import ViTConfig
from hetero.kinds.vit.model import VisionEncoder
from hetero.kinds.vit.plan import parallelize_vision


class ViTKind(Kind):
    name = "vit"
    config = ViTConfig
    modality = "image"

    def build(self, config: ViTConfig) -> VisionEncoder:
        return VisionEncoder(config)

    def parallelize(self, model, mesh, options):
        return parallelize_vision(model, mesh, options)

    def data_keys(self, config: ViTConfig) -> tuple[str, ...]:
        return ("images",)

    def outputs(self, config: ViTConfig) -> dict[str, Port]:
        return {"embeddings": Port(config.out_size, tokens=config.num_patches, field="out_size")}

    def has_loss(self, config: ViTConfig) -> bool:
        return False

    def stage(self, model: VisionEncoder, step: StageStep) -> StageResult:
        return StageResult(outputs={"embeddings": model(step.data["images"])})
