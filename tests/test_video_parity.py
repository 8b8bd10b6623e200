"""The video generator (and the learned memory's router) under TP and DP matches one process: the
training loss over a batch of revisit clips and every gradient, fp32, for a content-dependent memory
(slow_fast) and the learned one (router scores, soft log-importance bias)."""

import pytest
import torch
import torch.nn.functional as F

from hetero.kinds.video.config import VideoConfig
from hetero.kinds.video.model import VideoGenerator, patchify
from hetero.kinds.video.memory import MemoryConfig
from hetero.kinds.video.objectives import clip_attention, sequence_tokens
from hetero.kinds.video.plan import parallelize_video
from hetero.kinds.video.router import ImportanceRouter, sparsity
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.options import ParallelOptions
from hetero.parallel.placement import place
from hetero.testing.grads import synced_full_grads
from hetero.testing.multiprocess import run_ranks
from test_video_generator import clip_frames

CONFIG = VideoConfig(frame_size=16, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, max_distance=8)
BATCH = 4
MEMORIES = [MemoryConfig(policy="slow_fast", budget=4, sink=1, window=2, similarity=0.999),
            MemoryConfig(policy="learned", budget=4, window=2)]


def data():
    frames = clip_frames(count=BATCH, frames=8, a_len=2, gap=3) * 2 - 1
    gen = torch.Generator().manual_seed(7)
    noise = torch.randn(BATCH, 7, CONFIG.patches_per_frame, CONFIG.patch_dim, generator=gen)
    tau = torch.rand(BATCH, 7, generator=gen)
    return frames, noise, tau


def loss_of(model, router, rows):
    """The batch's loss restricted to ``rows``, scaled so the rows' parts sum to the whole batch's."""
    frames, noise, tau = (t[rows] for t in data())
    patches = patchify(frames, CONFIG.patch_size)
    count, per_frame = patches.shape[1], patches.shape[2]
    noisy = (1 - tau[..., None, None]) * noise + tau[..., None, None] * patches[:, 1:]
    tokens = sequence_tokens(model, patches, noisy, tau)
    summaries = model.frame_summary(patches).detach()
    total = 0
    for b, row in enumerate(rows.tolist()):
        memory = MEMORIES[row % 2]
        distances, bias, importance = clip_attention(model, summaries[b], memory, router, soft=True)
        out = model(tokens[b : b + 1], distances, bias)[:, count * per_frame :]
        total = total + F.mse_loss(out, patches[b : b + 1, 1:].reshape(1, -1, CONFIG.patch_dim))
        if importance is not None:
            total = total + 0.1 * sparsity(importance, memory.window)
    return total / BATCH


def build():
    torch.manual_seed(0)
    return VideoGenerator(CONFIG), ImportanceRouter(CONFIG.hidden_size, width=16)


def reference():
    model, router = build()
    loss = loss_of(model, router, torch.arange(BATCH))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    grads |= {f"router.{n}": p.grad.clone() for n, p in router.named_parameters()}
    return loss.item(), grads


def run(rank, world_size, layout_kwargs, options):
    mesh = build_module_meshes(place({"video": LayoutSpec(**layout_kwargs)}, world_size))["video"]
    model, router = build()
    model = parallelize_video(model, mesh, options)
    rows = torch.arange(BATCH).tensor_split(mesh.layout.dp)[mesh.coord.dp]
    loss = loss_of(model, router, rows)
    loss.backward()
    named = list(model.named_parameters()) + [(f"router.{n}", p) for n, p in router.named_parameters()]
    return loss.item(), synced_full_grads(named, mesh, options)


@pytest.mark.parametrize(
    "layout,options",
    [({"tp": 2}, ParallelOptions()), ({"dp": 2}, ParallelOptions()),
     ({"tp": 2, "dp": 2}, ParallelOptions(activation_checkpointing=True))],
    ids=["tp2", "dp2", "tp2·dp2+checkpointing"],
)
def test_video_generator_parity(layout, options):
    ref_loss, ref_grads = reference()
    world = 1
    for degree in layout.values():
        world *= degree
    results = run_ranks(run, world, layout, options, timeout_s=240)
    dp = layout.get("dp", 1)
    losses = [loss for loss, _ in results]
    total = sum(losses[:: world // dp]) if dp > 1 else losses[0]  # one rank per dp replica
    assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss)
    for _, grads in results:
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            error = ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert error <= 1e-5, f"{name}: relative gradient error {error:.1e}"
