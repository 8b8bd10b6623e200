"""Training objectives of the video generator: Context Forcing / L2M distillation, rollouts, and the
parallel next-frame sampling the benchmark measures against the KV-cached generation loop."""

import torch

from hetero.models.video.model import FrameCache, VideoGenerator, euler_step, patchify
from hetero.models.video.memory import MemoryConfig
from hetero.models.video.objectives import distillation_loss, next_frame_errors, rollout
from hetero.models.video.router import ImportanceRouter
from test_video_generator import CONFIG, clip_frames

LEARNED = MemoryConfig(policy="learned", budget=4, window=2)


def test_parallel_sampling_is_the_cached_generation_loop():
    """``next_frame_errors`` samples every frame in one pass per Euler step; generating frame by frame
    from the KV cache (true frames appended) gives the same frames, for the learned policy too."""
    torch.manual_seed(0)
    model, router = VideoGenerator(CONFIG).eval(), ImportanceRouter(CONFIG.hidden_size)
    frames = clip_frames(frames=9)
    patches = patchify(frames, CONFIG.patch_size)[0]
    errors = next_frame_errors(model, frames, LEARNED, router, torch.Generator().manual_seed(4), start=0.5)
    noise = torch.randn(patches[1:].shape, generator=torch.Generator().manual_seed(4))
    steps = CONFIG.sample_steps
    first = steps // 2
    cache = FrameCache(model, LEARNED, router)
    with torch.no_grad():
        for t in range(1, patches.shape[0]):
            cache.append(patches[t - 1 : t])
            x = (1 - first / steps) * noise[t - 1 : t] + first / steps * patches[t : t + 1]
            for i in range(first, steps):
                clean, _ = cache._run(model.embed_noisy(x.unsqueeze(1), torch.full((1, 1), i / steps)).squeeze(1))
                x = euler_step(x, clean, i, steps)
            error = ((x - patches[t : t + 1]) ** 2).mean()
            torch.testing.assert_close(error, errors[0, t - 1], rtol=1e-4, atol=1e-6)


def test_rollout_keeps_the_prompt_and_generates_the_rest():
    torch.manual_seed(0)
    model, router = VideoGenerator(CONFIG).eval(), ImportanceRouter(CONFIG.hidden_size)
    frames = clip_frames(frames=8, a_len=2, gap=3)[0]
    out = rollout(model, frames, LEARNED, prompt=5, router=router, generator=torch.Generator().manual_seed(0))
    assert out.shape == frames.shape
    assert torch.equal(out[:5], frames[:5])
    assert not torch.allclose(out[5:], frames[5:])
    assert torch.equal(rollout(model, frames, LEARNED, prompt=8, router=router), frames)


def test_router_learns_from_the_full_context_teacher():
    """Router-only L2M training on a frozen generator: distillation plus sparsity falls."""
    torch.manual_seed(0)
    model = VideoGenerator(CONFIG).requires_grad_(False)
    router = ImportanceRouter(CONFIG.hidden_size, width=16)
    optimizer = torch.optim.Adam(router.parameters(), lr=1e-2)
    frames = clip_frames(count=2, frames=8, a_len=2, gap=3) * 2 - 1
    totals = []
    for step in range(30):
        generator = torch.Generator().manual_seed(0)  # the same noise each step: the loss is comparable
        loss, penalty = distillation_loss(model, model, frames, LEARNED, router, generator, corruption=(0.5, 0.1))
        total = loss + 0.01 * penalty
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        totals.append(total.item())
    assert totals[-1] < 0.9 * totals[0], totals


def test_context_forcing_student_moves_towards_the_teacher():
    """A student under a sliding window, trained on a rollout to match the full-context teacher."""
    torch.manual_seed(0)
    teacher = VideoGenerator(CONFIG).requires_grad_(False)
    student = VideoGenerator(CONFIG)
    student.load_state_dict(teacher.state_dict())
    memory = MemoryConfig(policy="sliding", budget=2)
    frames = clip_frames(count=2, frames=8, a_len=2, gap=3) * 2 - 1
    frames = torch.stack([rollout(student, clip, memory, prompt=4) for clip in frames])
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-4)
    losses = []
    for _ in range(20):
        loss, penalty = distillation_loss(student, teacher, frames, memory, generator=torch.Generator().manual_seed(0))
        assert penalty.item() == 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
