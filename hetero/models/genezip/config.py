"""GeneZipConfig: the sizes of the model and what its layout must divide."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetero.data.genome import BASES, REGIONS
from hetero.models.gpt.config import GPTConfig
from hetero.kinds.layout_checks import shape_errors, transformer_layout_errors
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions

ROUTINGS = ("dynamic", "fixed")


@dataclass
class GeneZipConfig:
    seq_len: int = 512
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: int | None = None
    encoder_layers: int = 1  # per stage
    main_layers: int = 2
    decoder_layers: int = 1  # per stage
    local_window: int = 32  # positions the encoder and decoder blocks attend to
    stages: int = 1
    routing: str = "dynamic"  # "fixed": a token every target_bpt positions (no router)
    target_bpt: float = 4.0  # stage 1's bases per token, one target for every region (H-Net)
    region_bpt: dict[str, float] = field(default_factory=dict)  # Region-Aware Ratio: a target per region
    # The region budget (``regions.py``), on when the region targets differ: classifier width and the
    # controller's gain per step.
    region_channels: int = 96
    region_gain: float = 0.05
    inner_bpt: float = 2.0  # stage-1 tokens per stage-2 token (stages=2)
    ratio_weight: float = 0.03
    routing_window: int = 64
    min_boundaries: int = 1  # per routing window, stage 1
    max_boundaries: int = 0  # per routing window, stage 1; 0: no ceiling
    out_size: int = 0  # width of the compressed tokens handed to another module (0: no projector)
    norm_eps: float = 1e-5

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def block_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=len(BASES), hidden_size=self.hidden_size, num_heads=self.num_heads,
            ffn_hidden_size=self.ffn_size, norm_eps=self.norm_eps,
        )

    def region_targets(self) -> torch.Tensor:
        """Stage 1's bases-per-token target of every region id (``REGIONS`` order)."""
        return torch.tensor([float(self.region_bpt.get(name, self.target_bpt)) for name in REGIONS], device="cpu")

    def region_budget(self) -> bool:
        """Whether stage 1 routes each region at its own target (the targets differ)."""
        targets = self.region_targets()
        return self.routing == "dynamic" and bool((targets != targets[0]).any())

    @property
    def stride(self) -> int:
        """Positions per token of ``routing=fixed`` at stage 1."""
        return int(self.target_bpt)

    def max_tokens(self) -> int:
        """The most stage-1 tokens a sequence can have (the width of the compressed sequence it hands on)."""
        if self.routing == "fixed":
            return -(-self.seq_len // self.stride)
        if self.max_boundaries:
            return -(-self.seq_len // self.routing_window) * self.max_boundaries
        return self.seq_len

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        """Everything about this model that ``layout`` (and ``options``) cannot run; empty when fine."""
        prefix = f"{module}.model"
        errors = shape_errors(
            module, seq_len=self.seq_len, hidden_size=self.hidden_size, num_heads=self.num_heads,
            main_layers=self.main_layers, local_window=self.local_window, routing_window=self.routing_window,
        )
        if errors:
            return errors
        if self.hidden_size % self.num_heads:
            errors.append(f"{prefix}.num_heads={self.num_heads} does not divide {prefix}.hidden_size={self.hidden_size}")
        elif self.hidden_size // self.num_heads % 2:
            errors.append(
                f"{prefix}: each head is {self.hidden_size // self.num_heads} wide (hidden_size={self.hidden_size} / "
                f"num_heads={self.num_heads}), but rotary embeddings turn pairs of channels; make it even"
            )
        if self.stages not in (1, 2):
            errors.append(f"{prefix}.stages={self.stages}: GeneZip has 1 or 2 chunking stages")
        if self.routing not in ROUTINGS:
            errors.append(f"{prefix}.routing={self.routing!r} is not one of {', '.join(ROUTINGS)}")
        for name, target in [("target_bpt", self.target_bpt), ("inner_bpt", self.inner_bpt)] + [
            (f"region_bpt.{region}", value) for region, value in self.region_bpt.items()
        ]:
            if not target > 1:
                errors.append(f"{prefix}.{name}={target} must be > 1 (bases per token)")
        unknown = sorted(set(self.region_bpt) - set(REGIONS))
        if unknown:
            errors.append(f"{prefix}.region_bpt names unknown regions {unknown}; regions are {list(REGIONS)}")
        whole = self.target_bpt == int(self.target_bpt) and (self.stages == 1 or self.inner_bpt == int(self.inner_bpt))
        if self.routing == "fixed" and (not whole or self.region_bpt):
            errors.append(
                f"{prefix}.routing=fixed places a token every target_bpt (and inner_bpt) positions: they must "
                f"be whole numbers (got {self.target_bpt}, {self.inner_bpt}) and region_bpt empty "
                f"(got {dict(self.region_bpt)})"
            )
        if self.region_channels < 1 or not self.region_gain > 0:
            errors.append(
                f"{prefix}.region_channels={self.region_channels} and region_gain={self.region_gain} must be "
                f">= 1 and > 0"
            )
        if self.min_boundaries < 0 or self.max_boundaries < 0:
            errors.append(f"{prefix}.min_boundaries and max_boundaries must be >= 0")
        elif self.max_boundaries and self.min_boundaries > self.max_boundaries:
            errors.append(
                f"{prefix}.min_boundaries={self.min_boundaries} exceeds max_boundaries={self.max_boundaries}"
            )
        elif self.max_boundaries > self.routing_window:
            errors.append(
                f"{prefix}.max_boundaries={self.max_boundaries} exceeds routing_window={self.routing_window}"
            )
        if layout.cp > 1 or layout.pp > 1:
            errors.append(
                f"{module}: GeneZip runs with cp=1 and pp=1 (got cp={layout.cp}, pp={layout.pp}); spread it "
                "with dp or tp instead"
            )
        if options is not None and options.sequence_parallel:
            errors.append(
                f"{module}.parallel.sequence_parallel=true: chunking gathers across the whole sequence, so "
                "GeneZip keeps it whole on every TP rank; set it to false"
            )
        return errors + transformer_layout_errors(
            module, layout, num_heads=self.num_heads, num_kv_heads=self.num_heads, hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size, num_layers=self.main_layers, seq_len=self.seq_len,
            sequence_parallel=options is not None and options.sequence_parallel,
            fsdp=options is not None and options.fsdp,
        )
