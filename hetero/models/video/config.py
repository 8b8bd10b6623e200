"""VideoConfig: the sizes of the model and what its layout must divide."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.kinds.layout_checks import patch_model_errors, shape_errors, transformer_layout_errors
from hetero.models.video.memory import MemoryConfig
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions


@dataclass
class VideoConfig:
    frame_size: int = 16
    patch_size: int = 4
    channels: int = 1
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int | None = None
    max_distance: int = 32  # slot distances the attention bias tells apart; farther ones share the last
    sample_steps: int = 4  # Euler steps from noise to a frame
    memory: MemoryConfig = field(default_factory=MemoryConfig)  # which past frames the KV cache keeps
    condition_size: int = 0  # width of another module's hidden states that condition every frame (0: none)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def patches_per_frame(self) -> int:
        return (self.frame_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        """Everything about this model that ``layout`` (and ``options``) cannot run; empty when fine."""
        errors = shape_errors(
            module, frame_size=self.frame_size, patch_size=self.patch_size, channels=self.channels,
            hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            max_distance=self.max_distance, sample_steps=self.sample_steps,
        )
        errors += self.memory.errors(f"{module}.model.memory")
        if self.condition_size < 0:
            errors.append(f"{module}.model.condition_size={self.condition_size} must be >= 0 (0: unconditioned)")
        if errors:
            return errors
        errors += patch_model_errors(
            module, layout, "the video generator", size_field="frame_size", size=self.frame_size,
            patch_size=self.patch_size, hidden_size=self.hidden_size, num_heads=self.num_heads,
        )
        if options is not None and options.fsdp:
            # FSDP2 unshards a module's parameters in hooks around forward(); the objectives also call
            # frame_summary and the embeddings directly, which would meet sharded parameters.
            errors.append(
                f"{module}.parallel.fsdp=true: the video generator's objectives call its embeddings outside "
                f"forward(), where FSDP2 has not gathered its parameters; set fsdp=false (dp replicates it)"
            )
        return errors + transformer_layout_errors(
            module, layout, num_heads=self.num_heads, num_kv_heads=self.num_heads, hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size, num_layers=self.num_layers, seq_len=self.patches_per_frame,
            sequence_parallel=options is not None and options.sequence_parallel,
            fsdp=options is not None and options.fsdp,
        )
