"""The ``video`` kind: the autoregressive video generator of the rows that carry a clip, under its memory
policy, optionally conditioned on another module's hidden states.

Reads ``clips`` (pixels in [0, 1]) and ``index`` (the sample's index: each clip draws its noise from a
generator of ``(seed, step, index)`` alone, so the loss does not depend on the rank or microbatch holding
it) of the rows with ``has_clip``; input ``condition`` (width ``condition_size``, when > 0): one edge, on
every row it processes. Loss per clip: flow matching under the memory's schedule; under the ``learned``
policy also L2M's distillation of the soft memory (the router's importance) from the same generator with
the full context, and the router's sparsity penalty; summed, over the global count of clips. Evaluation
adds, where a batch marks ``revisit`` frames, the next-frame error on revisited and on all frames.
"""

from __future__ import annotations

import torch
from torch import nn

from hetero.kinds.columns import BOOL, FLOATING, INTEGER, Column, Dim
from hetero.kinds.registry import Kind, Metric, Port, StageResult, StageStep
from hetero.models.video.config import VideoConfig
from hetero.models.video.model import VideoGenerator
from hetero.models.video.objectives import distillation_loss, flow_matching_loss, next_frame_errors, to_model
from hetero.models.video.plan import parallelize_video
from hetero.models.video.router import ImportanceRouter

ROUTER_SPARSITY = 0.002  # weight of the learned memory's sparsity penalty


class VideoModule(nn.Module):
    """The generator and, under the ``learned`` memory, the importance router trained alongside it."""

    def __init__(self, config: VideoConfig):
        super().__init__()
        self.generator = VideoGenerator(config)
        self.router = ImportanceRouter(config.hidden_size) if config.memory.policy == "learned" else None


def clip_generator(seed: int, step: int, index: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The noise of sample ``index``'s clip at ``step``: a function of these alone (and of the device the
    generator lives on, the clip's: CUDA's generator draws other numbers than the CPU's)."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) * 1_000_033 + index)


def clip_losses(model: VideoModule, config: VideoConfig, clips: torch.Tensor, indices: list[int],
                condition: torch.Tensor | None, seed: int, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum over clips (B, T, C, S, S) of each clip's loss, and its named parts (sums)."""
    frames = to_model(clips)
    memory = config.memory
    parts = {"flow": frames.new_zeros(())}
    if model.router is not None:
        parts |= {"distill": frames.new_zeros(()), "sparsity": frames.new_zeros(())}
    total = frames.new_zeros(())
    for k, index in enumerate(indices):
        generator = clip_generator(seed, step, index, clips.device)
        clip = frames[k : k + 1]
        cond = None if condition is None else condition[k : k + 1]
        flow = flow_matching_loss(model.generator, clip, memory, generator, cond)
        total = total + flow
        parts["flow"] = parts["flow"] + flow.detach()
        if model.router is not None:
            distill, penalty = distillation_loss(model.generator, model.generator, clip, memory, model.router,
                                                 generator, condition=cond)
            total = total + distill + ROUTER_SPARSITY * penalty
            parts["distill"] = parts["distill"] + distill.detach()
            parts["sparsity"] = parts["sparsity"] + penalty.detach()
    return total, parts


class VideoKind(Kind):
    name = "video"
    config = VideoConfig
    modality = "clip"

    def build(self, config: VideoConfig) -> VideoModule:
        return VideoModule(config)

    def parallelize(self, model: VideoModule, mesh, options):
        model.generator = parallelize_video(model.generator, mesh, options)
        return model

    def data_keys(self, config: VideoConfig) -> tuple[str, ...]:
        return ("clips", "index")

    def evaluation_keys(self, available) -> tuple[str, ...]:
        return ("revisit",) if "revisit" in available else ()

    def columns(self, config: VideoConfig) -> tuple[Column, ...]:
        # frame 0 is the first frame's context: the loss predicts frames 1.., so a clip needs two
        frames, side = Dim("frames", minimum=2), Dim("frame_size", config.frame_size)
        return (Column("clips", (frames, Dim("channels", config.channels), side, side), FLOATING),
                Column("index", (), INTEGER), Column("revisit", (frames,), BOOL, optional=True))

    def loss_parts(self, config: VideoConfig) -> tuple[str, ...]:
        return ("flow", "distill", "sparsity") if config.memory.policy == "learned" else ("flow",)

    def metric_names(self, config: VideoConfig, available) -> list[tuple[str, str]]:
        return [("revisit_mse", "mean"), ("all_mse", "mean")] if "revisit" in available else []

    def inputs(self, config: VideoConfig) -> dict[str, Port]:
        return {"condition": Port(config.condition_size, field="condition_size")}

    def stage(self, model: VideoModule, step: StageStep) -> StageResult:
        config, data = step.config, step.data
        condition = step.inputs[0].tensor if step.inputs else None
        indices = step.host["index"].tolist()
        total, parts = clip_losses(model, config, data["clips"], indices, condition, step.seed, step.step)
        result = StageResult(loss=total, parts=parts)
        if not step.training and "revisit" in data:
            result.metrics = _next_frame_errors(model, config, data, indices, condition, step.seed)
        return result


def _next_frame_errors(model: VideoModule, config: VideoConfig, data, indices: list[int], condition,
                       seed: int) -> dict[str, Metric]:
    """Each frame denoised from half noise given the true earlier frames the memory keeps; mean squared
    error of pixels in [0, 1] (hence the 1/4 of [-1, 1]) on revisited and on all frames."""
    errors = []
    for k, index in enumerate(indices):
        cond = None if condition is None else condition[k : k + 1]
        errors.append(next_frame_errors(model.generator, to_model(data["clips"][k : k + 1]), config.memory, model.router,
                                        clip_generator(seed, -1, index, data["clips"].device), start=0.5,
                                        condition=cond)[0] / 4)
    errors = torch.stack(errors).double()
    revisit = data["revisit"][:, 1:]
    return {"revisit_mse": Metric(errors[revisit].sum(), revisit.sum().double()),
            "all_mse": Metric(errors.sum(), torch.ones_like(errors).sum())}
