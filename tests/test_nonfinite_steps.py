"""A NaN in one module's gradients on one rank skips the step on every rank: no weight, optimizer state or
error-feedback buffer changes, the event names the module and rank, and training goes on afterwards."""

import json
import math

import torch

from hetero.config import load_experiment
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig
from hetero.parallel.data import local_data
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.options import ParallelOptions
from hetero.parallel.placement import place
from hetero.testing.multiprocess import run_ranks
from hetero.train.run_log import RunLog
from hetero.train.vlm import ModuleSetup, VLMTrainer
from test_vlm_parity import LLM, OPTIM, VISION, batches

POISONED_RANK = 1


def snapshot(trainer: VLMTrainer) -> dict[str, torch.Tensor]:
    """Every tensor a step could change on this rank: weights, optimizer moments, EF buffers."""
    out = {}
    for name, module in trainer.modules.items():
        for pname, p in module.model.named_parameters():
            out[f"{name}.{pname}"] = local_data(p).clone()
            for key, value in module.optimizer.state[p].items():
                value = value.to_local() if hasattr(value, "to_local") else value
                out[f"{name}.{pname}.{key}"] = value.clone()
        for kind, buffers in module.replica_sync.state_dict()["grad_sync"]["buffers"].items():
            out |= {f"{name}.ef.{kind}.{n}": t.clone() for n, t in buffers.items()}
    return out


def poison_one_rank(rank, world_size):
    placement = place({"vision": LayoutSpec(dp=4), "llm": LayoutSpec(tp=2, dp=2)}, world_size)
    meshes = build_module_meshes(placement)
    int8 = CompressionConfig(grad=CompressorConfig(method="int8"))
    setups = {"vision": ModuleSetup(ParallelOptions(), OPTIM["vision"], int8),
              "llm": ModuleSetup(ParallelOptions(), OPTIM["llm"], int8)}
    trainer = VLMTrainer(placement, meshes, VISION, LLM, num_microbatches=2, setups=setups, grad_clip=0.5)
    data = batches(8)
    assert trainer.train_step(data[0])["stepped"] == 1.0  # optimizer moments and EF residuals now exist
    before = snapshot(trainer)
    hook = None
    if rank == POISONED_RANK:
        weight = trainer.modules["vision"].model.patch_embed.weight
        hook = weight.register_hook(lambda grad: grad * float("nan"))
    poisoned = trainer.train_step(data[1])
    where = dict(trainer.nonfinite)
    unchanged = all(torch.equal(before[k], v) for k, v in snapshot(trainer).items())
    assert len(before) > 20 and any(".ef.residual." in k for k in before)
    if hook is not None:
        hook.remove()
    after = trainer.train_step(data[1])
    return poisoned, where, unchanged, after


def test_nan_in_one_rank_skips_the_step_everywhere():
    results = run_ranks(poison_one_rank, 4, timeout_s=240)
    for poisoned, where, unchanged, after in results:
        assert poisoned["stepped"] == 0.0 and math.isnan(poisoned["grad_norm"])
        # Found before the gradient sync (which would have spread it): one module, one rank, on every rank.
        assert where == {"vision": [POISONED_RANK]}
        assert unchanged  # weights, Adam moments and int8 error-feedback residuals of every module
        assert after["stepped"] == 1.0 and math.isfinite(after["loss"]) and after["grad_norm"] > 0


def test_skipped_step_is_logged(tmp_path, capsys):
    experiment = load_experiment("colocated_vlm", [f"train.run_dir={tmp_path}", "train.wandb=disabled"])
    log = RunLog(experiment, tmp_path, enabled=True)
    log.skipped(7, {"vision": ["rank 1 (vision dp1; llm tp1 dp0)"]})
    out = capsys.readouterr().out
    assert "step     7 | skipped: non-finite loss or gradients in vision on rank 1 (vision dp1; llm tp1 dp0)" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 7, "skipped": {"vision": ["rank 1 (vision dp1; llm tp1 dp0)"]}}]
