"""A module kind defined outside hetero: a small 1-D convolutional encoder of a signal.

It reads the batch column ``signal`` (B, length) of the rows with ``has_signal``, and hands another
module ``tokens`` = length / stride embeddings of width ``out_size``: a strided 1-D convolution, GELU, a
linear projection. Nothing here imports hetero's built-in kinds; the runtime learns everything it needs
from the ``Kind`` below, registered by user code::

    from hetero.models import default_registry
    from signal_encoder.kind import SignalKind

    registry = default_registry()
    registry.register(SignalKind())
    runtime = build_runtime(experiment, registry)       # or hetero.train.job.train(experiment, registry)

In YAML: ``audio: {kind: signal, model: {length: 32, stride: 4, channels: 16, out_size: 32}, layout: {dp: 2}}``
and an edge ``{src: audio, dst: llm}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetero.kinds.columns import FLOATING, Column, Dim
from hetero.kinds.registry import Kind, Port, StageResult, StageStep
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions


@dataclass
class SignalConfig:
    length: int = 32  # samples per signal
    stride: int = 4  # samples per token
    channels: int = 16
    out_size: int = 64

    @property
    def tokens(self) -> int:
        return self.length // self.stride

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        errors = []
        if self.stride < 1 or self.length % self.stride:
            errors.append(f"{module}.model.stride={self.stride} does not divide {module}.model.length={self.length}")
        if layout.tp > 1 or layout.cp > 1 or layout.pp > 1:
            errors.append(f"{module}: the signal encoder runs data-parallel only (got tp={layout.tp}, cp={layout.cp}, "
                          f"pp={layout.pp}); set them to 1")
        if options is not None and options.fsdp:
            errors.append(f"{module}.parallel.fsdp=true: the signal encoder is too small to shard; set fsdp=false")
        return errors


class SignalEncoder(nn.Module):
    def __init__(self, config: SignalConfig):
        super().__init__()
        self.config = config
        self.conv = nn.Conv1d(1, config.channels, kernel_size=config.stride, stride=config.stride)
        self.proj = nn.Linear(config.channels, config.out_size)

    def forward(self, signal: torch.Tensor) -> torch.Tensor:
        """(batch, length) -> (batch, length / stride, out_size)."""
        features = F.gelu(self.conv(signal[:, None, :]))  # (batch, channels, tokens)
        return self.proj(features.transpose(1, 2))


class SignalKind(Kind):
    name = "signal"
    config = SignalConfig
    modality = "signal"

    def build(self, config: SignalConfig) -> SignalEncoder:
        return SignalEncoder(config)

    def data_keys(self, config: SignalConfig) -> tuple[str, ...]:
        return ("signal",)

    def columns(self, config: SignalConfig) -> tuple[Column, ...]:
        """What ``signal`` must look like, checked on every rank before a step."""
        return (Column("signal", (Dim("length", config.length),), FLOATING),)

    def outputs(self, config: SignalConfig) -> dict[str, Port]:
        return {"embeddings": Port(config.out_size, tokens=config.tokens, field="out_size")}

    def has_loss(self, config: SignalConfig) -> bool:
        return False

    def stage(self, model: SignalEncoder, step: StageStep) -> StageResult:
        return StageResult(outputs={"embeddings": model(step.data["signal"])})
