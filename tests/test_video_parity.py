"""The video generator (and the learned memory's router) under TP and DP matches one process: 3 AdamW
steps through the runtime on revisit clips, fp32, for a content-dependent memory (slow_fast) and the
learned one (flow matching on random keeps, distillation of the router's soft memory from the full
context, sparsity). Per step the loss, its parts and the gradient norm; every replica's gradients at the
first step (``hetero.testing.parity``). The reference sums the kind's per-clip losses (each clip's noise
from its own generator) over the whole batch in one process."""

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.video.config import VideoConfig
from hetero.models.video.memory import MemoryConfig
from hetero.models.video.spec import VideoModule, clip_losses
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_bf16_parity, check_parity, record_reference, record_run
from test_video_generator import clip_frames

BATCH, STEPS, LR, SEED = 4, 3, 3e-3, 5
MEMORIES = {"slow_fast": MemoryConfig(policy="slow_fast", budget=4, sink=1, window=2, similarity=0.999),
            "learned": MemoryConfig(policy="learned", budget=4, window=2)}


def config(memory: str) -> VideoConfig:
    return VideoConfig(frame_size=16, patch_size=8, hidden_size=32, num_layers=2, num_heads=4, max_distance=8,
                       memory=MEMORIES[memory])


def batches() -> list[dict[str, torch.Tensor]]:
    clips = clip_frames(count=BATCH * STEPS, frames=8, a_len=2, gap=3)
    return [{"clips": clips[s * BATCH : (s + 1) * BATCH], "index": torch.arange(BATCH) + s * BATCH}
            for s in range(STEPS)]


def reference(memory: str, precision: str = "fp32") -> Record:
    torch.manual_seed(SEED)
    model = VideoModule(config(memory))

    def losses(batch, step):
        total, parts = clip_losses(model, config(memory), batch["clips"], batch["index"].tolist(), None, SEED, step)
        return [total / BATCH] + [parts[k] / BATCH for k in sorted(parts)]

    return record_reference({"video": model}, {"video": OptimizerConfig(lr=LR)}, batches(), losses,
                            precision=precision)


def run(rank, world_size, layout, options, memory):
    blocks = {"video": module("video", config(memory), layout, OptimizerConfig(lr=LR), options)}
    runtime = build_runtime(experiment(world_size, blocks, global_batch=BATCH, microbatches=1, seed=SEED))
    parts = sorted(f"video.{part}" for part in runtime.graph.nodes["video"].kind.loss_parts(config(memory)))
    return record_run(runtime, batches(), ["video.loss", *parts])


@pytest.mark.parametrize(
    "layout,options,memory",
    [({"tp": 2}, ParallelOptions(), "slow_fast"), ({"dp": 2}, ParallelOptions(), "learned"),
     ({"tp": 2, "dp": 2}, ParallelOptions(activation_checkpointing=True), "learned")],
    ids=["tp2 slow_fast", "dp2 learned", "tp2·dp2+checkpointing learned"],
)
def test_video_generator_parity(layout, options, memory):
    world = layout.get("tp", 1) * layout.get("dp", 1)
    results = run_ranks(run, world, layout, options, memory, timeout_s=240)
    print("\n" + check_parity(results, reference(memory), f"video parity {layout} {memory}"))


def test_video_generator_bf16_parity():
    """tp2 under bf16 autocast against one process under the same autocast (``check_bf16_parity``)."""
    results = run_ranks(run, 2, {"tp": 2}, ParallelOptions(precision="bf16"), "slow_fast", timeout_s=240)
    print("\n" + check_bf16_parity(results, reference("slow_fast", "bf16"), reference("slow_fast"),
                                   "video bf16 tp2 slow_fast"))
