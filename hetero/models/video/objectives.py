"""Training objectives and measurements of the video generator under a memory policy.

- ``flow_matching_loss``: the generator learns each frame from the clean frames its memory holds
  (teacher forcing on the data).
- ``distillation_loss``: Context Forcing / L2M. A teacher sees the full history; the student only what
  its memory keeps (for the learned policy, the soft memory of ``video_router``), with its context
  optionally corrupted (degradation-aware training); the student matches the teacher's predictions.
- ``rollout``: a clip whose frames after a prompt are the model's own generations, the context the
  student meets when it generates long videos.
- ``next_frame_errors``: each frame sampled from fixed noise given the true earlier frames under the
  policy's memory, against the true frame.

Everything runs the training sequence (``video.training_distances``): one pass predicts every frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hetero.models.video.model import (
    FrameCache,
    euler_step,
    VideoGenerator,
    context_schedule,
    patchify,
    training_bias,
    training_distances,
    unpatchify,
)
from hetero.models.video.memory import MemoryConfig
from hetero.models.video.router import ImportanceRouter, ema_importance, memory_frame_bias, sparsity

FULL = MemoryConfig(policy="full")


def clip_attention(
    model: VideoGenerator,
    summaries: torch.Tensor,
    memory: MemoryConfig,
    router: ImportanceRouter | None = None,
    soft: bool = False,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One clip's (L, L) distances and score bias for the training sequence, and the (T, T) EMA
    importance (learned policy only). The learned policy scores frames with ``router`` (or takes
    ``scores``, e.g. random ones to train the generator on arbitrary keeps, with no bias); ``soft``
    shows every earlier frame weighted by its importance instead of only the kept ones."""
    per_frame = model.config.patches_per_frame
    if memory.policy != "learned":
        schedule = context_schedule(summaries, memory)
        return training_distances(schedule, per_frame, model.config.max_distance, memory.policy != "full"), None, None
    if router is None and scores is None:
        raise ValueError("policy=learned needs a router (or explicit scores) to rank frames")
    biased = scores is None
    if biased:
        scores = router.clip_scores(summaries)
    schedule = context_schedule(summaries, memory, scores.detach())
    distances = training_distances(schedule, per_frame, model.config.max_distance, True, soft)
    if not biased:
        return distances, None, None
    importance = ema_importance(scores, memory.ema)
    return distances, training_bias(memory_frame_bias(importance, memory.window), per_frame), importance


def sequence_tokens(
    model: VideoGenerator, patches: torch.Tensor, noisy: torch.Tensor, tau: torch.Tensor,
    condition: torch.Tensor | None = None,
) -> torch.Tensor:
    """The training sequence's embeddings (B, L, hidden): clean frames ``patches`` (B, T, P, D), then the
    noisy frames 1..T-1 ``noisy`` (B, T-1, P, D) at flow times ``tau`` (B, T-1); ``condition`` (B, hidden)
    from ``model.conditioning``."""
    batch, count, per_frame, _ = patches.shape
    return torch.cat([
        model.embed_clean(patches, condition).reshape(batch, count * per_frame, -1),
        model.embed_noisy(noisy, tau, condition).reshape(batch, (count - 1) * per_frame, -1),
    ], dim=1)


def _noisy_targets(patches: torch.Tensor, generator: torch.Generator | None):
    target = patches[:, 1:]
    noise = torch.randn(target.shape, generator=generator, device=patches.device)
    tau = torch.rand(target.shape[:2], generator=generator, device=patches.device)
    noisy = (1 - tau[..., None, None]) * noise + tau[..., None, None] * target
    return target, noise, noisy, tau


def to_model(frames: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1] -> [-1, 1], nearer the unit-variance noise flow matching starts from."""
    return frames * 2 - 1


def flow_matching_loss(
    model: VideoGenerator,
    frames: torch.Tensor,
    memory: MemoryConfig | Sequence[MemoryConfig],
    generator: torch.Generator | None = None,
    condition: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean squared error of the predicted clean frames 1..T-1 of a batch of clips (B, T, C, S, S), each frame
    predicted from the clean frames its memory holds. ``memory`` may differ per clip (a list); a
    learned policy here keeps random old frames (random router scores), so the generator learns to use
    whatever a router may keep. ``condition``: each clip's conditioning hidden states (B, S, condition_size)
    for a conditioned generator."""
    memories = [memory] * frames.shape[0] if isinstance(memory, MemoryConfig) else list(memory)
    patches = patchify(frames, model.config.patch_size)  # (B, T, P, D)
    count, per_frame = patches.shape[1], patches.shape[2]
    with torch.no_grad():
        summaries = model.frame_summary(patches)
    target, noise, noisy, tau = _noisy_targets(patches, generator)
    tokens = sequence_tokens(model, patches, noisy, tau, model.conditioning(condition))
    losses = []
    for b, clip_memory in enumerate(memories):  # each clip has its own memory schedule
        scores = None
        if clip_memory.policy == "learned":
            # drawn where the generator lives; the memory schedule itself is worked out on the host
            scores = torch.rand(count, count, generator=generator, device=_device_of(generator, frames)).cpu()
        distances, _, _ = clip_attention(model, summaries[b], clip_memory, scores=scores)
        out = model(tokens[b : b + 1], distances.to(frames.device))[:, count * per_frame :]
        losses.append(F.mse_loss(out, target[b].reshape(1, -1, target.shape[-1])))
    return torch.stack(losses).mean()


def corrupt(frames: torch.Tensor, probability: float, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """Degradation-aware context: each frame, with ``probability``, gets Gaussian noise of ``std`` (the
    errors a generated context carries)."""
    if probability <= 0 or std <= 0:
        return frames
    hit = torch.rand(frames.shape[:2], generator=generator, device=frames.device) < probability
    noise = torch.randn(frames.shape, generator=generator, device=frames.device) * std
    return frames + noise * hit[..., None, None, None]


def distillation_loss(
    student: VideoGenerator,
    teacher: VideoGenerator,
    frames: torch.Tensor,
    memory: MemoryConfig,
    router: ImportanceRouter | None = None,
    generator: torch.Generator | None = None,
    corruption: tuple[float, float] = (0.0, 0.0),
    condition: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(distillation loss, sparsity) on a batch of clips (B, T, C, S, S): the student, seeing only its
    memory of a possibly corrupted context (``corruption`` = (probability, std) per frame), matches the
    clean frames the teacher predicts from the full clean history on the same noisy frames. Under the
    learned policy the student's memory is the router's soft memory and ``sparsity`` is the mean
    importance of old frames (0 otherwise). ``condition``: the clips' conditioning hidden states, for
    teacher and student alike, when the generators are conditioned."""
    config = student.config
    patches = patchify(frames, config.patch_size)
    count, per_frame = patches.shape[1], patches.shape[2]
    _, _, noisy, tau = _noisy_targets(patches, generator)
    seen = patchify(corrupt(frames, *corruption, generator), config.patch_size)
    with torch.no_grad():
        teacher_tokens = sequence_tokens(teacher, patches, noisy, tau, teacher.conditioning(condition))
        student_summaries = student.frame_summary(seen)
        teacher_summaries = teacher.frame_summary(patches)
    student_tokens = sequence_tokens(student, seen, noisy, tau, student.conditioning(condition))
    losses, penalties = [], []
    for b in range(frames.shape[0]):
        with torch.no_grad():
            distances, _, _ = clip_attention(teacher, teacher_summaries[b], FULL)
            target = teacher(teacher_tokens[b : b + 1], distances)[:, count * per_frame :]
        distances, bias, importance = clip_attention(student, student_summaries[b], memory, router, soft=True)
        out = student(student_tokens[b : b + 1], distances, bias)[:, count * per_frame :]
        losses.append(F.mse_loss(out, target))
        penalties.append(sparsity(importance, memory.window) if importance is not None else out.new_zeros(()))
    return torch.stack(losses).mean(), torch.stack(penalties).mean()


@torch.no_grad()
def rollout(
    model: VideoGenerator,
    frames: torch.Tensor,
    memory: MemoryConfig,
    prompt: int,
    router: ImportanceRouter | None = None,
    generator: torch.Generator | None = None,
    condition: torch.Tensor | None = None,
) -> torch.Tensor:
    """One clip (T, C, S, S) whose frames from ``prompt`` on are generated, each from the memory of the
    frames before it (true ones up to the prompt, generated ones after); ``condition`` (1, S, c): its
    conditioning hidden states for a conditioned generator."""
    config = model.config
    patches = patchify(frames, config.patch_size)
    cache = FrameCache(model, memory, router, condition)
    out = [patches[t] for t in range(min(prompt, patches.shape[0]))]
    for t in range(patches.shape[0]):
        if t >= prompt:
            noise = torch.randn((1, config.patches_per_frame, config.patch_dim), generator=generator,
                                device=_device_of(generator, frames)).to(frames.device)
            out.append(cache.predict(noise)[0])
        cache.append(out[t][None])
    return unpatchify(torch.stack(out), config.patch_size, config.channels)


@torch.no_grad()
def next_frame_errors(
    model: VideoGenerator,
    frames: torch.Tensor,
    memory: MemoryConfig,
    router: ImportanceRouter | None = None,
    generator: torch.Generator | None = None,
    start: float = 0.0,
    condition: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, T-1) mean squared error of each frame 1..T-1 of clips (B, T, C, S, S), sampled in Euler steps
    given the true earlier frames the memory keeps: from pure noise (``start`` 0), or from the true frame
    noised to flow time ``start`` (rounded down to a step; e.g. 0.5: half noise, a coarse view of the
    frame whose details the model must restore, from memory where it holds them). ``condition``: the
    clips' conditioning hidden states for a conditioned generator."""
    config = model.config
    steps = config.sample_steps
    first = int(start * steps)
    patches = patchify(frames, config.patch_size)
    batch, count, per_frame, _ = patches.shape
    summaries = model.frame_summary(patches)
    offsets = model.conditioning(condition)
    noise = torch.randn(patches[:, 1:].shape, generator=generator, device=frames.device)
    noise = (1 - first / steps) * noise + first / steps * patches[:, 1:]
    errors = []
    for b in range(batch):
        distances, bias, _ = clip_attention(model, summaries[b], memory, router)
        x = noise[b : b + 1]
        for i in range(first, steps):
            tau = torch.full((1, count - 1), i / steps, device=frames.device)
            offset = None if offsets is None else offsets[b : b + 1]
            tokens = sequence_tokens(model, patches[b : b + 1], x, tau, offset)
            clean = model(tokens, distances, bias)[:, count * per_frame :].reshape(x.shape)
            x = euler_step(x, clean, i, steps)
        errors.append(((x - patches[b : b + 1, 1:]) ** 2).mean((-1, -2))[0])
    return torch.stack(errors)


def _device_of(generator: torch.Generator | None, like: torch.Tensor) -> torch.device:
    return like.device if generator is None else generator.device
