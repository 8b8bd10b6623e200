"""GPTConfig: the sizes of the model and what its layout must divide."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.kinds.layout_checks import shape_errors, transformer_layout_errors
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions


ROPE_SCALINGS = ("none", "llama3", "yarn")


@dataclass
class RopeScaling:
    """RoPE frequencies stretched past the pretraining context: ``llama3`` (Llama 3.1's piecewise
    scaling) or ``yarn`` (YaRN's ramp between interpolated and original frequencies, with cos and sin
    scaled by ``attention_factor``); ``none`` keeps the base frequencies."""

    type: str = "none"
    factor: float = 1.0
    original_max_position: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; default 0.1 * ln(factor) + 1


@dataclass
class GPTConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    seq_len: int = 64
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    head_dim: int | None = None  # default hidden_size // num_heads
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys before RoPE (Qwen3)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        """Everything about this model that ``layout`` (and ``options``) cannot run; empty when fine."""
        errors = shape_errors(
            module,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
        )
        if errors:
            return errors
        if self.rope_scaling.type not in ROPE_SCALINGS:
            errors.append(f"{module}.model.rope_scaling.type={self.rope_scaling.type!r} is not one of "
                          f"{', '.join(ROPE_SCALINGS)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            errors.append(
                f"{module}.model.num_heads={self.num_heads} does not divide "
                f"{module}.model.hidden_size={self.hidden_size}; pick a head count that divides it"
            )
        if self.tie_embeddings and layout.pp > 1:
            errors.append(
                f"{module}.model.tie_embeddings=true needs the embedding and the output layer on one "
                f"pipeline stage, but {module}.layout.pp={layout.pp}; untie them or use pp=1"
            )
        if self.num_heads % self.kv_heads:
            errors.append(
                f"{module}.model.num_kv_heads={self.kv_heads} does not divide "
                f"{module}.model.num_heads={self.num_heads}"
            )
        return errors + transformer_layout_errors(
            module,
            layout,
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size,
            num_layers=self.num_layers,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            sequence_parallel=options is not None and options.sequence_parallel,
            fsdp=options is not None and options.fsdp,
        )
