"""ViTConfig: the sizes of the model, the variant it is (hetero's own, or a SigLIP or CLIP tower), and
what its layout must divide."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.kinds.layout_checks import patch_model_errors, shape_errors, transformer_layout_errors
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions

ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")
TOWERS = ("vit", "qwen2.5-vl", "qwen3-vl")


@dataclass
class ViTConfig:
    image_size: int = 32
    patch_size: int = 4
    channels: int = 1
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int | None = None
    feature_layer: int = -1
    out_size: int = 64
    # The variant. The defaults are hetero's own encoder; a SigLIP tower has no class token, CLIP's a
    # LayerNorm before the blocks and no patch bias; both have a key bias and their own activation.
    class_token: bool = True
    patch_bias: bool = True
    key_bias: bool = False  # softmax cancels it exactly; kept where a checkpoint has one
    pre_norm: bool = False
    activation: str = "gelu"
    norm_eps: float = 1e-5
    feature_norm: bool = True  # a LayerNorm of the features (SigLIP's post_layernorm)
    class_feature: bool = False  # the class token handed on before the patches' features (LLaVA's "full")
    # An MLP projector into the LLM's width (out_size) inside the encoder; without it the encoder hands
    # on its features (out_size = hidden_size), e.g. to a module of kind projector.
    projector: bool = True
    # Native resolution: > 0 takes images at their own sizes, each at most this many patches, packed
    # (``image_*`` columns); the learned positions (an image_size grid) are interpolated to each image's.
    max_patches: int = 0
    # Spatial merging (Qwen2-VL's PatchMerger): > 1 merges each merge × merge block of neighbouring
    # patches into one token, a LayerNorm and an MLP (merge² · hidden -> merge² · hidden -> out_size) in
    # place of the projector: an image hands on num_patches / merge² tokens.
    merge: int = 1
    # Images as items (LLaVA-style: any number per row, each at its own placeholders): ``image_pixels``
    # (one image_size image per item) with ``image_row`` and ``image_start``. Native resolution takes
    # items whatever this says.
    items: bool = False
    # The tower: hetero's ViT and its SigLIP/CLIP variants (``vit``), or Qwen2.5-VL's or Qwen3-VL's
    # (``qwen_tower.py``): native resolution (max_patches), image_grid (t, h, w) in patches, patches in
    # merge-block order, 2-D RoPE, merge into out_size; none of the ViT's class token, projector, feature norm.
    tower: str = "vit"
    temporal_patch: int = 1  # frames per patch (the Qwen towers: 2, a still image's frame repeated)
    rope_theta: float = 10000.0  # the Qwen towers' 2-D RoPE
    window_size: int = 0  # qwen2.5-vl: window side in pixels (a multiple of merge * patch_size)
    full_attention_blocks: list[int] = field(default_factory=list)  # qwen2.5-vl: blocks attending to the whole image
    position_grid: int = 0  # qwen3-vl: side of the learned position table, resized to each image
    deepstack_layers: list[int] = field(default_factory=list)  # qwen3-vl: blocks whose features go on as taps

    @property
    def per_item(self) -> bool:
        """Whether the encoder takes images as items (``image_*`` columns) rather than one per row."""
        return self.items or self.max_patches > 0

    @property
    def qwen(self) -> bool:
        return self.tower != "vit"

    @property
    def patch_values(self) -> int:
        """Values of one patch: channels × temporal_patch × patch_size²."""
        return self.channels * self.temporal_patch * self.patch_size**2

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Encoder sequence: the patches, and the class token where there is one."""
        return self.num_patches + int(self.class_token)

    @property
    def feature_tokens(self) -> int:
        """Features handed on per image: the patches', after the class token's where it is kept."""
        return self.num_patches // self.merge**2 + int(self.class_token and self.class_feature)

    @property
    def used_layers(self) -> int:
        """The blocks up to the feature layer: those after it never run, and are not built."""
        return self.feature_layer % self.num_layers + 1

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        """Everything about this model that ``layout`` (and ``options``) cannot run; empty when fine."""
        errors = shape_errors(
            module,
            image_size=self.image_size,
            patch_size=self.patch_size,
            channels=self.channels,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            out_size=self.out_size,
        )
        if errors:
            return errors
        if self.tower not in TOWERS:
            return [f"{module}.model.tower={self.tower!r} is not one of {', '.join(TOWERS)}"]
        if self.qwen:
            return self._qwen_errors(module, layout, options)
        errors += patch_model_errors(
            module, layout, "the vision encoder", size_field="image_size", size=self.image_size,
            patch_size=self.patch_size, hidden_size=self.hidden_size, num_heads=self.num_heads, pipeline=True,
        )
        if not -self.num_layers <= self.feature_layer < self.num_layers:
            errors.append(
                f"{module}.model.feature_layer={self.feature_layer} is not a layer of a "
                f"{self.num_layers}-layer encoder; use -{self.num_layers}..{self.num_layers - 1}"
            )
        elif layout.pp > self.used_layers and layout.pp <= self.num_layers:
            errors.append(
                f"{module}.layout.pp={layout.pp} is larger than the {self.used_layers} blocks up to "
                f"{module}.model.feature_layer={self.feature_layer}; every pipeline stage needs one: use pp <= "
                f"{self.used_layers}"
            )
        if self.activation not in ACTIVATIONS:
            errors.append(f"{module}.model.activation={self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.max_patches < 0:
            errors.append(f"{module}.model.max_patches={self.max_patches} must be >= 0 (0: every image image_size wide)")
        if self.class_feature and not self.class_token:
            errors.append(f"{module}.model.class_feature=true hands on a class token, but class_token=false")
        if self.max_patches and self.class_token:
            errors.append(f"{module}.model.max_patches={self.max_patches} (native resolution) takes images without a "
                          f"class token; set {module}.model.class_token=false")
        if self.max_patches and layout.pp > 1:
            errors.append(f"{module}.model.max_patches={self.max_patches} (native resolution) runs on one pipeline "
                          f"stage; set {module}.layout.pp=1 and spread it with dp or tp")
        side = self.image_size // self.patch_size
        if self.merge < 1:
            errors.append(f"{module}.model.merge={self.merge} must be >= 1 (1: no merging)")
        elif self.merge > 1:
            if side % self.merge:
                errors.append(f"{module}.model.merge={self.merge} does not divide the {side}×{side} patch grid "
                              f"(image_size / patch_size); choose a merge that divides {side}")
            if self.projector:
                errors.append(f"{module}.model.merge={self.merge}: the merger projects into out_size in place of "
                              f"the projector; set {module}.model.projector=false")
            if self.class_feature or self.max_patches:
                errors.append(f"{module}.model.merge={self.merge} merges a fixed grid of patches: set "
                              f"{module}.model.class_feature=false and max_patches=0")
        if not self.projector and self.merge == 1 and self.out_size != self.hidden_size:
            errors.append(
                f"{module}.model.out_size={self.out_size} is the projector's width, but projector=false hands on "
                f"the features (hidden_size={self.hidden_size}); set {module}.model.out_size={self.hidden_size}"
            )
        return errors + transformer_layout_errors(
            module,
            layout,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size,
            num_layers=self.num_layers,
            seq_len=self.seq_len,
            sequence_parallel=options is not None and options.sequence_parallel,
            fsdp=options is not None and options.fsdp,
        )

    def _qwen_errors(self, module: str, layout: Layout, options: ParallelOptions | None) -> list[str]:
        field_, errors = f"{module}.model", []
        for name in ("class_token", "projector", "feature_norm", "pre_norm", "class_feature", "items"):
            if getattr(self, name):
                errors.append(f"{field_}.tower={self.tower} has no {name}: set {field_}.{name}=false")
        if self.max_patches <= 0:
            errors.append(f"{field_}.tower={self.tower} takes images at native resolution: set {field_}.max_patches "
                          f"to the most patches an image may have")
        if self.merge < 2:
            errors.append(f"{field_}.tower={self.tower} merges merge x merge patches into one token: set {field_}.merge (2)")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            errors.append(f"{field_}: heads of hidden_size / num_heads = {self.hidden_size}/{self.num_heads} channels; "
                          f"the 2-D RoPE turns height and width on a quarter each: make it a multiple of 4")
        if self.feature_layer != -1:
            errors.append(f"{field_}.feature_layer={self.feature_layer}: the {self.tower} tower hands on its last block")
        qwen3 = self.tower == "qwen3-vl"
        if qwen3 and self.position_grid <= 0:
            errors.append(f"{field_}.tower=qwen3-vl adds a learned grid of positions: set {field_}.position_grid > 0")
        if not qwen3 and (self.position_grid or self.deepstack_layers):
            errors.append(f"{field_}.tower=qwen2.5-vl has no learned position grid or DeepStack taps: set "
                          f"{field_}.position_grid=0 and deepstack_layers=[]")
        if qwen3 and (self.window_size or self.full_attention_blocks):
            errors.append(f"{field_}.tower=qwen3-vl attends to whole images: set {field_}.window_size=0 and "
                          f"full_attention_blocks=[]")
        if not qwen3 and self.window_size % (self.merge * self.patch_size or 1):
            errors.append(f"{field_}.window_size={self.window_size} is not a multiple of merge x patch_size="
                          f"{self.merge * self.patch_size}")
        blocks = [b for b in [*self.full_attention_blocks, *self.deepstack_layers] if not 0 <= b < self.num_layers]
        if blocks:
            errors.append(f"{field_}: blocks {blocks} named by full_attention_blocks or deepstack_layers are not "
                          f"blocks 0..{self.num_layers - 1}")
        if layout.pp > 1 or layout.cp > 1:
            errors.append(f"{module}.layout: the {self.tower} tower runs on one pipeline stage without context "
                          f"parallelism, not cp={layout.cp}, pp={layout.pp}; spread it with dp and tp")
        if options is not None and options.sequence_parallel and layout.tp > 1:
            errors.append(f"{module}.parallel.sequence_parallel: the {self.tower} tower's TP ranks hold every patch "
                          f"(its images are not one sequence to split); set it false")
        return errors + transformer_layout_errors(
            module, layout, num_heads=self.num_heads, num_kv_heads=self.num_heads, hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size, num_layers=self.num_layers, seq_len=self.seq_len,
            fsdp=options is not None and options.fsdp)
