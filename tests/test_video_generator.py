"""The video generator on one process: patches, the training sequence's mask and distances against the
KV-cached generation loop, and a loss that falls on revisit clips.

The central check: for every memory policy, the velocity the training pass predicts for frame t (all
frames at once, under the mask built from the memory's schedule) equals what ``FrameCache`` predicts one
frame at a time from the same noisy input, after appending the true frames 0..t-1 — so what the model is
trained on is what generation runs.
"""

import dataclasses

import pytest
import torch

from hetero.data.video_clips import make_clips
from hetero.models.video.model import (
    FrameCache,
    VideoGenerator,
    context_schedule,
    patchify,
    training_distances,
    unpatchify,
)
from hetero.models.video.config import VideoConfig
from hetero.models.video.memory import FrameMemory, MemoryConfig
from hetero.models.video.router import ImportanceRouter, ema_importance, sparsity
from hetero.models.video.objectives import clip_attention, flow_matching_loss, sequence_tokens

CONFIG = VideoConfig(frame_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=4, max_distance=16)
MEMORIES = {
    "full": MemoryConfig(policy="full"),
    "sliding": MemoryConfig(policy="sliding", budget=3),
    "sink_window": MemoryConfig(policy="sink_window", budget=3, sink=1),
    "slow_fast": MemoryConfig(policy="slow_fast", budget=4, sink=1, window=2, similarity=0.999),
}


def clip_frames(count=1, frames=12, a_len=4, gap=4):
    clips = make_clips(count, frames=frames, size=16, gap=gap, seed=0, a_len=a_len)
    return torch.stack([torch.from_numpy(c["frames"]) for c in clips])  # (B, T, 1, 16, 16)


def test_patchify_round_trips():
    frames = torch.randn(2, 3, 1, 16, 16)
    patches = patchify(frames, 4)
    assert patches.shape == (2, 3, 16, 16)
    assert torch.equal(patches[0, 0, 1], frames[0, 0, 0, 0:4, 4:8].reshape(-1))  # row-major patches
    assert torch.equal(unpatchify(patches, 4, 1), frames)


@pytest.mark.parametrize("policy", list(MEMORIES))
def test_training_pass_is_the_cached_generation_loop(policy):
    torch.manual_seed(0)
    model = VideoGenerator(CONFIG).eval()
    memory = MEMORIES[policy]
    frames = clip_frames()
    patches = patchify(frames, CONFIG.patch_size)[0]  # (T, P, D)
    count, per_frame, _ = patches.shape
    with torch.no_grad():
        schedule = context_schedule(model.frame_summary(patches), memory)
        noisy = torch.randn(count - 1, per_frame, CONFIG.patch_dim, generator=torch.Generator().manual_seed(1))
        tau = torch.rand(1, count - 1, generator=torch.Generator().manual_seed(2))
        tokens = torch.cat([model.embed_clean(patches).reshape(1, count * per_frame, -1),
                            model.embed_noisy(noisy.unsqueeze(0), tau).reshape(1, (count - 1) * per_frame, -1)], 1)
        distances = training_distances(schedule, per_frame, CONFIG.max_distance, policy != "full")
        parallel = model(tokens, distances)[0, count * per_frame :].reshape(count - 1, per_frame, -1)

        cache = FrameCache(model, memory)
        for t in range(1, count):
            cache.append(patches[t - 1 : t])
            assert cache.book.kept == schedule[t]
            velocity, _ = cache._run(model.embed_noisy(noisy[t - 1 : t].unsqueeze(1), tau[:, t - 1 : t]).squeeze(1))
            torch.testing.assert_close(velocity[0], parallel[t - 1], rtol=1e-5, atol=1e-5)
    if policy != "full":
        assert max(len(kept) for kept in schedule) <= memory.budget
        assert cache.kv_bytes() <= memory.budget * CONFIG.num_layers * 2 * per_frame * CONFIG.hidden_size * 4


def test_flow_matching_loss_falls_on_revisit_clips():
    torch.manual_seed(0)
    model = VideoGenerator(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    frames = clip_frames(count=2, frames=7, a_len=2, gap=2)
    memory = MemoryConfig(policy="sliding", budget=3)
    losses = []
    for step in range(25):
        optimizer.zero_grad()
        loss = flow_matching_loss(model, frames, memory, torch.Generator().manual_seed(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses


def test_generation_predicts_frames_of_the_right_shape_under_a_flat_kv_budget():
    torch.manual_seed(0)
    model = VideoGenerator(CONFIG).eval()
    memory = MemoryConfig(policy="sliding", budget=3)
    cache = FrameCache(model, memory)
    sizes = []
    for _ in range(15):  # 5x the budget
        frame = cache.predict(torch.randn(1, CONFIG.patches_per_frame, CONFIG.patch_dim))
        assert frame.shape == (1, CONFIG.patches_per_frame, CONFIG.patch_dim)
        cache.append(frame)
        sizes.append(cache.kv_bytes())
    assert max(sizes) == sizes[2] == sizes[-1]  # flat once the budget is full


def test_ema_importance_is_what_the_memory_tracks():
    scores = torch.rand(9, 9, generator=torch.Generator().manual_seed(3))
    memory = MemoryConfig(policy="learned", budget=9, window=2, ema=0.8)
    book = FrameMemory(memory)
    importance = ema_importance(scores, memory.ema)
    for t in range(9):
        book.update_importance({j: float(scores[j, t]) for j in book.kept})
        book.admit(t, torch.ones(2), float(scores[t, t]))
        for j, value in book.importance.items():
            assert abs(value - importance[j, t].item()) < 1e-6, (j, t)


def test_learned_memory_training_pass_is_the_cached_generation_loop():
    """The router's scores pick the frames; kept frames older than the fast window get their
    log-importance as a score bias; both the same in the training pass and the KV-cached loop."""
    torch.manual_seed(0)
    model = VideoGenerator(CONFIG).eval()
    router = ImportanceRouter(CONFIG.hidden_size)
    memory = MemoryConfig(policy="learned", budget=4, window=2)
    frames = clip_frames()
    patches = patchify(frames, CONFIG.patch_size)
    count, per_frame = patches.shape[1], patches.shape[2]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        summaries = model.frame_summary(patches)[0]
        distances, bias, importance = clip_attention(model, summaries, memory, router)
        noisy = torch.randn(1, count - 1, per_frame, CONFIG.patch_dim, generator=gen)
        tau = torch.rand(1, count - 1, generator=gen)
        parallel = model(sequence_tokens(model, patches, noisy, tau), distances, bias)[0, count * per_frame :]
        parallel = parallel.reshape(count - 1, per_frame, -1)
        cache = FrameCache(model, memory, router)
        evictions = 0
        for t in range(1, count):
            cache.append(patches[0, t - 1 : t])
            evictions += t - len(cache.book.kept)
            velocity, _ = cache._run(model.embed_noisy(noisy[:, t - 1 : t], tau[:, t - 1 : t]).squeeze(1))
            torch.testing.assert_close(velocity[0], parallel[t - 1], rtol=1e-5, atol=1e-5)
    assert evictions > 0 and len(cache.book.kept) == memory.budget
    assert bias.min() < -0.1  # old frames were down-weighted, so the bias took part in the comparison


def test_soft_memory_sees_every_earlier_frame_and_fades_the_unimportant():
    torch.manual_seed(0)
    model = VideoGenerator(CONFIG)
    router = ImportanceRouter(CONFIG.hidden_size)
    memory = MemoryConfig(policy="learned", budget=4, window=2)
    patches = patchify(clip_frames(), CONFIG.patch_size)[0]
    per_frame = patches.shape[1]
    distances, bias, importance = clip_attention(model, model.frame_summary(patches), memory, router, soft=True)
    clean_rows = distances[: patches.shape[0] * per_frame : per_frame, : patches.shape[0] * per_frame : per_frame]
    assert bool((clean_rows.tril() >= 0).all())  # clean frame t sees every frame j <= t
    assert bias.requires_grad
    (bias.sum() + sparsity(importance, memory.window)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in router.parameters())


def test_a_conditioned_generator_trains_and_generates_with_the_same_condition():
    """Another module's hidden states (mean over positions, projected) add to every token of the clip: the
    training sequence and the cached generation loop agree under it, it changes the prediction, the loss's
    gradient reaches the hidden states, and a mismatch between config and call is refused."""
    config = dataclasses.replace(CONFIG, condition_size=24)
    torch.manual_seed(0)
    model = VideoGenerator(config).eval()
    frames = clip_frames()
    hidden = torch.randn(1, 5, 24)  # e.g. an LLM's hidden states over a caption
    patches = patchify(frames, config.patch_size)
    count, per_frame = patches.shape[1], patches.shape[2]
    noisy = torch.randn(1, count - 1, per_frame, config.patch_dim, generator=torch.Generator().manual_seed(1))
    tau = torch.rand(1, count - 1, generator=torch.Generator().manual_seed(2))
    memory = MemoryConfig(policy="full")
    with torch.no_grad():
        distances = training_distances(context_schedule(model.frame_summary(patches[0]), memory), per_frame,
                                       config.max_distance, False)
        condition = model.conditioning(hidden)
        parallel = model(sequence_tokens(model, patches, noisy, tau, condition), distances)[0, count * per_frame :]
        unconditioned = model(sequence_tokens(model, patches, noisy, tau), distances)[0, count * per_frame :]
        assert (parallel - unconditioned).abs().max() > 1e-3
        cache = FrameCache(model, memory, condition=hidden)
        for t in range(1, count):
            cache.append(patches[0, t - 1 : t])
            velocity, _ = cache._run(model.embed_noisy(noisy[:, t - 1 : t], tau[:, t - 1 : t], cache.condition).squeeze(1))
            torch.testing.assert_close(velocity[0], parallel.reshape(count - 1, per_frame, -1)[t - 1], rtol=1e-5, atol=1e-5)

    hidden.requires_grad_()
    flow_matching_loss(model.train(), frames, memory, torch.Generator().manual_seed(3), condition=hidden).backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0 and torch.isfinite(hidden.grad).all()
    with pytest.raises(ValueError, match="condition_size=24"):
        flow_matching_loss(model, frames, memory)
    with pytest.raises(ValueError, match="condition_size=0"):
        VideoGenerator(CONFIG).conditioning(hidden)
    assert VideoGenerator(CONFIG).condition is None  # unconditioned checkpoints keep their keys
