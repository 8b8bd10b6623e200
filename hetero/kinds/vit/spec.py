"""The ``vit`` kind: a vision encoder (ViT, with or without its projector) of the rows that carry an
image, trained from scratch or imported from a SigLIP or CLIP checkpoint (``init.hf``, ``hf.py``).

Reads ``images`` of the rows with ``has_image`` (every row when a batch has no such flag); output
``embeddings``: ``num_patches`` tokens of width ``out_size`` per image (the features, ``hidden_size``
wide, without a projector). It has no loss of its own: it learns from the gradients its consumers return.
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

    def pretrained_config(self, module, path, fields):
        from hetero.interop.hf_checkpoint import HFCheckpoint
        from hetero.kinds.vit.hf import check_weights, vit_config

        checkpoint = HFCheckpoint(path)
        config = vit_config(checkpoint.config, fields, module)
        self.check_given(module, config, fields, {"feature_layer"})
        check_weights(checkpoint, config, module)
        return config

    def hf_export(self, config, source):
        from hetero.kinds.vit.hf import vit_export

        return vit_export(config, source)

    def load_pretrained(self, model, path):
        from hetero.kinds.vit.hf import load_vit

        return load_vit(model, path)

    def data_keys(self, config: ViTConfig) -> tuple[str, ...]:
        return ("images",)

    def outputs(self, config: ViTConfig) -> dict[str, Port]:
        return {"embeddings": Port(config.out_size, tokens=config.num_patches, field="out_size")}

    def has_loss(self, config: ViTConfig) -> bool:
        return False

    def stage_shape(self, config: ViTConfig, rows: int, layout, options) -> tuple[int, ...]:
        """The residual stream a later pipeline stage receives: every token of each image."""
        return (rows, config.seq_len, config.hidden_size)

    def stage(self, model: VisionEncoder, step: StageStep) -> StageResult:
        out = model(step.data["images"] if step.mesh.is_first_stage else step.activation)
        if not step.mesh.is_last_stage:
            return StageResult(activation=out)
        return StageResult(outputs={"embeddings": out})
