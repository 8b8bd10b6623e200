"""A NaN in one module's gradients on one rank, or in a loss, skips the step on every rank: no weight,
optimizer state or error-feedback buffer changes, the event names the module and rank, and training goes
on afterwards; under ``train.nonfinite=stop`` the job ends instead, naming the module."""

import json
import math
import os
import socket
import subprocess
import sys

import torch

from hetero.config import load_experiment
from hetero.models.gpt.spec import GPTKind
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig
from hetero.parallel.data import local_data
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.train.run_log import RunLog
from test_vlm_parity import LLM, OPTIM, VISION, batches

POISONED_RANK = 1


def snapshot(runtime) -> dict[str, torch.Tensor]:
    """Every tensor a step could change on this rank: weights, optimizer moments, EF buffers."""
    out = {}
    for name, state in runtime.modules.items():
        for pname, p in state.model.named_parameters():
            out[f"{name}.{pname}"] = local_data(p).clone()
            for key, value in state.optimizer.state[p].items():
                value = value.to_local() if hasattr(value, "to_local") else value
                out[f"{name}.{pname}.{key}"] = value.clone()
        for kind, buffers in state.replica_sync.state_dict()["grad_sync"]["buffers"].items():
            out |= {f"{name}.ef.{kind}.{n}": t.clone() for n, t in buffers.items()}
    return out


def nan_loss(kind_stage):
    """``GPTKind.stage`` whose loss, at optimizer step 1, is NaN in value while its gradient stays finite."""
    def stage(self, model, step):
        result = kind_stage(self, model, step)
        if result.loss is not None and step.step == 1:
            result.loss = result.loss + torch.full_like(result.loss.detach(), math.nan)
        return result
    return stage


def poison(rank, world_size, where):
    int8 = CompressionConfig(grad=CompressorConfig(method="int8"))
    modules = {"vision": module("vit", VISION, {"dp": 4}, OPTIM["vision"], compression=int8),
               "llm": module("gpt", LLM, {"tp": 2, "dp": 2}, OPTIM["llm"], compression=int8)}
    runtime = build_runtime(experiment(world_size, modules, edges=[("vision", "llm")], global_batch=8,
                                       microbatches=2, grad_clip=0.5))
    data = batches(8)
    assert runtime.train_step(data[0])["stepped"] == 1.0  # optimizer moments and EF residuals now exist
    before = snapshot(runtime)
    hook = None
    if where == "gradient" and rank == POISONED_RANK:
        hook = runtime.modules["vision"].model.patch_embed.weight.register_hook(lambda grad: grad * float("nan"))
    if where == "loss":
        GPTKind.stage, original = nan_loss(GPTKind.stage), GPTKind.stage
    poisoned = runtime.train_step(data[1])
    found = dict(runtime.nonfinite)
    unchanged = all(torch.equal(before[k], v) for k, v in snapshot(runtime).items())
    assert len(before) > 20 and any(".ef.residual." in k for k in before)
    if hook is not None:
        hook.remove()
    if where == "loss":
        GPTKind.stage = original
    after = runtime.train_step(data[1])
    return poisoned, found, unchanged, after


def test_nan_in_one_rank_s_gradient_skips_the_step_everywhere():
    for poisoned, found, unchanged, after in run_ranks(poison, 4, "gradient", timeout_s=240):
        assert poisoned["stepped"] == 0.0 and math.isnan(poisoned["grad_norm"])
        # Found before the gradient sync (which would have spread it): one module, one rank, on every rank.
        assert found == {"vision": [POISONED_RANK]}
        assert unchanged  # weights, Adam moments and int8 error-feedback residuals of every module
        assert after["stepped"] == 1.0 and math.isfinite(after["loss"]) and after["grad_norm"] > 0


def test_nan_in_a_loss_with_finite_gradients_skips_the_step_everywhere():
    for poisoned, found, unchanged, after in run_ranks(poison, 4, "loss", timeout_s=240):
        assert poisoned["stepped"] == 0.0 and math.isnan(poisoned["loss"])
        assert found == {"llm": [0, 1, 2, 3]}  # every rank of the LLM holds its (replicated) loss
        assert unchanged
        assert after["stepped"] == 1.0 and math.isfinite(after["loss"])


STOP_AT_A_NAN_LOSS = """
import sys
from hetero.models.gpt.spec import GPTKind
from test_nonfinite_steps import nan_loss
GPTKind.stage = nan_loss(GPTKind.stage)
from hetero.train.run import main
main(sys.argv[1:])
"""


def test_nonfinite_stop_ends_the_job_naming_the_module(tmp_path):
    """``train.nonfinite=stop``: the job (one process) ends at the step whose loss is NaN, with an error
    naming the module; the steps before it were logged."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "PYTHONPATH": os.path.dirname(__file__)}
    overrides = ["experiment=colocated_vlm", "world_size=1", "vision.layout.dp=1", "llm.layout.tp=1", "llm.layout.dp=1",
                 "vision.micro_batch_size=16", "batch.micro_batch_size=16", "batch.global_batch_size=16", "train.steps=4", "train.log_every=1",
                 "train.eval_every=0", "train.wandb=disabled", "train.nonfinite=stop",
                 f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / 'runs'}"]
    done = subprocess.run([sys.executable, "-c", STOP_AT_A_NAN_LOSS, *overrides], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert done.returncode != 0
    assert "NonFiniteError: step 2: non-finite loss or gradients in llm; train.nonfinite=stop ends the job" in done.stderr
    rows = [json.loads(line) for line in (tmp_path / "runs" / "colocated_vlm" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and rows[1]["skipped"] == {"llm": ["rank 0 (vision; llm)"]}


def test_skipped_step_is_logged(tmp_path, capsys):
    config = load_experiment("colocated_vlm", [f"train.run_dir={tmp_path}", "train.wandb=disabled"])
    log = RunLog(config, tmp_path, enabled=True)
    log.skipped(7, {"vision": ["rank 1 (vision dp1; llm tp1 dp0)"]})
    out = capsys.readouterr().out
    assert "step     7 | skipped: non-finite loss or gradients in vision on rank 1 (vision dp1; llm tp1 dp0)" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 7, "skipped": {"vision": ["rank 1 (vision dp1; llm tp1 dp0)"]}}]
