"""The ``vit`` kind: a vision encoder (ViT, with or without its projector) of the rows that carry an
image, trained from scratch or imported from a SigLIP or CLIP checkpoint (``init.hf``, ``hf.py``).

Reads ``images`` of the rows with ``has_image`` (every row when a batch has no such flag); output
``embeddings``: ``num_patches`` tokens of width ``out_size`` per image (the features, ``hidden_size``
wide, without a projector). It has no loss of its own: it learns from the gradients its consumers return.

At native resolution (``max_patches`` > 0) it reads images instead of rows, any number per row and
each at its own size (``hetero.data.native_images``): ``image_patches`` (every image's patches, image
after image), ``image_grid`` (each image's height and width in patches); its DP replicas split the
images by patch count. Its output is each image's tokens, one per patch, which the edge routes to the
image's placeholders (``image_row``, from ``image_start``) in the consumer's rows.

The Qwen towers (``tower``: ``qwen2.5-vl``, ``qwen3-vl``; ``qwen_tower.py``) read the same two columns at
native resolution, ``image_grid`` then (t, h, w) per image and each patch ``temporal_patch`` frames deep, and
hand on one token per merge block.

With ``items`` (LLaVA-style conversations: any number of fixed-size images per row) it reads images
as items too: ``image_pixels`` (channels × image_size × image_size per image) with ``image_row`` and
``image_start``; its DP replicas split them (every image costs its ``num_patches``) and its output is
``num_patches`` tokens per image, to a projector module of items or routed to the placeholders.
"""

from __future__ import annotations

import torch

from hetero.kinds.columns import FLOATING, INTEGER, Column, Dim
from hetero.kinds.registry import Kind, Port, StageResult, StageStep
from hetero.models.vit.config import TOWERS, ViTConfig
from hetero.models.vit.flops import vit_forward_flops_per_image
from hetero.models.vit.model import VisionEncoder
from hetero.models.vit.plan import parallelize_vision
from hetero.models.vit.qwen_tower import QwenVisionTower


class ViTKind(Kind):
    name = "vit"
    config = ViTConfig
    modality = "image"

    def build(self, config: ViTConfig) -> VisionEncoder | QwenVisionTower:
        return QwenVisionTower(config) if config.qwen else VisionEncoder(config)

    def parallelize(self, model, mesh, options):
        return parallelize_vision(model, mesh, options)

    def pretrained_config(self, module, path, fields):
        from hetero.interop.parts import open_part
        from hetero.models.vit.hf import check_weights, vit_config

        checkpoint = open_part(path, "vision")
        if checkpoint.config.get("architectures", [""])[0] in TOWERS[1:]:  # a whole Qwen-VL's tower
            from hetero.models.vit.qwen_tower_hf import check_tower_weights, qwen_vit_config

            config = qwen_vit_config(checkpoint.config, fields, module, path)
            self.check_given(module, config, fields, {"max_patches"})
            check_tower_weights(checkpoint, config, module)
            return config
        llava = getattr(checkpoint, "llava", None)  # a whole LLaVA's tower takes its feature layer from it
        config = vit_config(checkpoint.config, fields, module, llava)
        self.check_given(module, config, fields, {"items"} if llava else {"feature_layer", "items"})
        check_weights(checkpoint, config, module)
        return config

    def hf_export(self, config, source):
        from hetero.models.vit.hf import vit_export

        if config.qwen:
            from hetero.models.vit.qwen_tower_hf import tower_export

            return tower_export(config, source)

        return vit_export(config, source)

    def load_pretrained(self, model, path):
        from hetero.models.vit.hf import load_vit

        if model.config.qwen:
            from hetero.interop.parts import open_part
            from hetero.models.vit.qwen_tower_hf import load_tower

            return load_tower(model, open_part(path, "vision"))

        return load_vit(model, path)

    def data_keys(self, config: ViTConfig) -> tuple[str, ...]:
        if config.max_patches:
            return ("image_patches", "image_grid")
        return ("image_pixels",) if config.items else ("images",)

    def per_item(self, config: ViTConfig) -> bool:
        return config.per_item

    def forward_flops(self, config: ViTConfig) -> float:
        return vit_forward_flops_per_image(config)

    def item_costs(self, config: ViTConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each image's patches (what the blocks run over, merged or not)."""
        if config.max_patches:
            return batch["image_grid"].cpu().prod(1)
        return torch.full((len(batch["image_row"]),), config.num_patches, dtype=torch.long, device="cpu")

    def item_tokens(self, config: ViTConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if config.qwen:  # one per merge block
            return batch["image_grid"].cpu().prod(1) // config.merge**2
        if config.max_patches:
            return batch["image_grid"].cpu().prod(1)
        return torch.full((len(batch["image_row"]),), config.feature_tokens, dtype=torch.long, device="cpu")

    def host_columns(self, config, batch, keys, local):
        """Images ``local`` (global numbers); a batch with ``image_held`` holds the pixels of those images
        alone (a loader that reads only the rank's own)."""
        if not config.per_item:
            return super().host_columns(config, batch, keys, local)
        held = _held_positions(batch, local)
        if not config.max_patches:
            return {"image_pixels": batch["image_pixels"][held]}
        grids = batch["image_grid"].cpu()
        sizes = grids[batch["image_held"].cpu()].prod(1) if "image_held" in batch else grids.prod(1)
        starts = sizes.cumsum(0) - sizes
        patches = torch.cat([torch.arange(int(starts[i]), int(starts[i] + sizes[i]), device="cpu") for i in held.tolist()]
                            or [torch.zeros(0, dtype=torch.long, device="cpu")])
        return {"image_patches": batch["image_patches"][patches], "image_grid": grids[local]}

    def columns(self, config: ViTConfig) -> tuple[Column, ...]:
        side = Dim("image_size", config.image_size)
        image = (Dim("channels", config.channels), side, side)
        if not config.per_item:
            return (Column("images", image, FLOATING),)
        items = dict(dtype=INTEGER, rows=False)
        places = (Column("image_row", (), **items), Column("image_start", (), **items))
        if not config.max_patches:
            return (Column("image_pixels", image, FLOATING, rows=False),) + places
        return (Column("image_patches", (Dim("patch values"),), FLOATING, rows=False),
                Column("image_grid", (Dim("", 3 if config.qwen else 2),), **items)) + places

    def batch_errors(self, module: str, config: ViTConfig, batch: dict[str, torch.Tensor]) -> list[str]:
        missing = [c.name for c in self.columns(config) if c.name not in batch] if config.per_item else []
        if missing and config.max_patches:
            return [f"{module}: native-resolution images (max_patches={config.max_patches}) need the batch columns "
                    f"{', '.join(missing)} (hetero.data.native_images.image_places)"]
        if missing:
            return [f"{module}: images as items ({module}.model.items=true) need the batch columns "
                    f"{', '.join(missing)}: per image its pixels, its row and its first placeholder's position"]
        errors = super().batch_errors(module, config, batch)
        if errors or not config.per_item:
            return errors
        held = batch.get("image_held")  # pixels of these images alone: a loader reading only the rank's own
        counted = "image_grid" if config.max_patches else "image_pixels" if held is None else "image_row"
        images = len(batch[counted])
        errors = [f"{module}: the batch holds {images} images ({counted}) but {len(batch[key])} {key} entries; give "
                  f"every image one" for key in ("image_row", "image_start") if len(batch[key]) != images]
        if not errors and held is not None and not config.max_patches and len(batch["image_pixels"]) != len(held):
            errors = [f"{module}: the batch holds the pixels of {len(batch['image_pixels'])} images but image_held "
                      f"names {len(held)}; give the pixels of each image it names"]
        if errors or not config.max_patches:
            return errors
        sizes = batch["image_grid"].cpu().prod(1)
        errors = [f"{module}: image {i} holds {int(sizes[i])} patches ({'×'.join(map(str, batch['image_grid'][i].tolist()))}), more than {module}.model.max_patches={config.max_patches}; "
                  f"shrink it to fit (hetero.data.native_images.fit_to_patches keeps its aspect ratio) or raise "
                  f"{module}.model.max_patches" for i in torch.nonzero(sizes > config.max_patches).flatten().tolist()[:1]]
        if config.qwen:
            spatial = batch["image_grid"].cpu()[:, 1:]
            odd = torch.nonzero((spatial % config.merge).any(1)).flatten().tolist()
            errors += [f"{module}: image {i}'s grid {batch['image_grid'][i].tolist()} (t, h, w) does not split into "
                       f"{config.merge}×{config.merge} merge blocks; resize it to multiples of merge × patch_size="
                       f"{config.merge * config.patch_size} pixels" for i in odd[:1]]
        width = config.patch_values
        if held is not None:
            sizes = sizes[held.cpu()]
        if tuple(batch["image_patches"].shape) != (int(sizes.sum()), width):
            errors.append(f"{module}: image_patches has shape {tuple(batch['image_patches'].shape)} but image_grid "
                          f"counts {int(sizes.sum())} patches of {width} values (channels × temporal_patch × patch_size²)"
                          + (" in the images image_held names" if held is not None else ""))
        return errors

    def outputs(self, config: ViTConfig) -> dict[str, Port]:
        tokens = None if config.max_patches else config.feature_tokens
        width = config.out_size * (1 + len(config.deepstack_layers))  # Qwen3-VL's taps beside the tokens
        return {"embeddings": Port(width, tokens=tokens, field="out_size")}

    def has_loss(self, config: ViTConfig) -> bool:
        return False

    def stage_shape(self, config: ViTConfig, rows: int, layout, options) -> tuple[int, ...]:
        """The residual stream a later pipeline stage receives: every token of each image."""
        return (rows, config.seq_len, config.hidden_size)

    def stage(self, model: VisionEncoder, step: StageStep) -> StageResult:
        if step.config.max_patches:
            grids = [tuple(g) for g in step.host["image_grid"].tolist()]
            out = model(step.data["image_patches"], grids)
            if step.config.qwen:  # the merged tokens, then each DeepStack tap beside them
                out = torch.cat([out[0], *out[1]], -1)
            return StageResult(outputs={"embeddings": out})
        images = step.data["image_pixels" if step.config.items else "images"]
        out = model(images if step.mesh.is_first_stage else step.activation)
        if not step.mesh.is_last_stage:
            return StageResult(activation=out)
        return StageResult(outputs={"embeddings": out})


def _held_positions(batch: dict[str, torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """Where images ``local`` (global numbers) sit among the batch's pixels: themselves, or, in a batch
    holding only ``image_held``'s images, their places in it."""
    held = batch.get("image_held")
    if held is None:
        return local
    positions = torch.searchsorted(held.cpu(), local).clamp(max=max(len(held) - 1, 0))
    missing = local[held.cpu()[positions] != local] if len(held) else local
    if len(missing):
        raise RuntimeError(f"the batch lacks the pixels of images {missing.tolist()[:8]} that this rank's replica "
                           f"encodes; its loader read only {held.tolist()[:8]}… (hetero.runtime.rows.RankReads)")
    return positions
