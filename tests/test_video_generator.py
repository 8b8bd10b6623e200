"""The video generator on one process: patches, the training sequence's mask and distances against the
KV-cached generation loop, and a loss that falls on revisit clips.

The central check: for every memory policy, the velocity the training pass predicts for frame t (all
frames at once, under the mask built from the memory's schedule) equals what ``FrameCache`` predicts one
frame at a time from the same noisy input, after appending the true frames 0..t-1 — so what the model is
trained on is what generation runs.
"""

import pytest
import torch

from hetero.data.video_clips import make_clips
from hetero.models.video import (
    FrameCache,
    VideoConfig,
    VideoGenerator,
    context_schedule,
    flow_matching_loss,
    patchify,
    training_distances,
    unpatchify,
)
from hetero.models.video_memory import MemoryConfig

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
