"""hetero's DiLoCo over torchft replica groups: same numbers as over a gloo group, same as torchft's DiLoCo,
and a round whose collectives fail is dropped (every replica back at its anchor) without hanging."""

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetero.bench.torchft_peer import TorchftDiLoCoRun, run_torchft_diloco
from hetero.parallel.compression.build import build_diloco
from hetero.parallel.compression.collective import Collective, GroupCollective
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig, DiLoCoConfig
from hetero.parallel.compression.torchft_replicas import (
    TorchftCollective,
    replica_manager,
    shared_lighthouse,
)
from hetero.testing.multiprocess import run_ranks

TIMEOUT = timedelta(seconds=20)  # every torchft wait; the harness kills the ranks after 60 s
H = 2


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_on(rank: int):
    def loss_fn(model: nn.Module, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        return F.mse_loss(model(x), y)

    return loss_fn


def lr_at(step: int) -> float:
    return 1e-2 * (1.0 + 0.5 * (step % 3))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def diloco_config(method: str, error_feedback: str = "auto", **overlap) -> CompressionConfig:
    """``overlap``: DiLoCoConfig's overlap_* fields."""
    pseudo = CompressorConfig(method=method, error_feedback=error_feedback)
    return CompressionConfig(diloco=DiLoCoConfig(inner_steps=H, pseudo_grad=pseudo, **overlap))


def train_ours(rank: int, comm: Collective, method: str, steps: int, **overlap) -> dict:
    """hetero's DiLoCo on this replica: the loop run_torchft_diloco runs, with build_diloco's outer step."""
    model = build_model()
    inner = adamw(model.parameters())
    diloco = build_diloco(diloco_config(method, **overlap), model.named_parameters(), comm)
    loss_fn, losses = loss_on(rank), []
    for step in range(steps):
        for group in inner.param_groups:
            group["lr"] = lr_at(step)
        inner.zero_grad(set_to_none=True)
        loss = loss_fn(model, step)
        loss.backward()
        inner.step()
        diloco.after_inner_step()
        losses.append(loss.item())
    diloco.close()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return {"state": state, "bytes": comm.bytes_sent, "rounds": diloco.rounds, "losses": losses}


def both_backends(rank: int, world_size: int, method: str, steps: int) -> tuple[dict, dict]:
    with shared_lighthouse() as addr, replica_manager(f"replica_{rank}", addr, TIMEOUT) as manager:
        torchft = train_ours(rank, TorchftCollective(manager), method, steps)
    group = train_ours(rank, GroupCollective(dist.group.WORLD), method, steps)
    return torchft, group


@pytest.mark.parametrize("method", ["none", "int4"])
def test_torchft_replicas_match_a_gloo_group(method):
    steps = 3 * H
    results = run_ranks(both_backends, 2, method, steps, timeout_s=60)
    initial = build_model().state_dict()
    for torchft, group in results:
        torch.testing.assert_close(torchft["state"], group["state"], rtol=1e-6, atol=1e-7)
        assert torchft["bytes"] == group["bytes"] > 0
        assert torchft["rounds"] == group["rounds"] == steps // H
        assert torchft["losses"] == pytest.approx(group["losses"], rel=1e-6)
        assert not torch.allclose(torchft["state"]["0.weight"], initial["0.weight"])
    # the last step synced: every replica holds the same weights
    torch.testing.assert_close(results[0][0]["state"], results[1][0]["state"], rtol=0, atol=0)


def against_torchft_diloco(rank: int, world_size: int, steps: int, delay: int, alpha: float
                           ) -> tuple[TorchftDiLoCoRun, dict]:
    model = build_model()
    inner = adamw(model.parameters())

    def set_lr(step: int) -> None:
        for group in inner.param_groups:
            group["lr"] = lr_at(step)

    run = run_torchft_diloco(model, inner, loss_on(rank), set_lr, steps=steps, sync_every=H, timeout=TIMEOUT,
                             sync_delay=delay, update_alpha=alpha)
    overlap = {"overlap_steps": delay, "overlap_merge": "mix", "overlap_alpha": alpha} if delay else {}
    return run, train_ours(rank, GroupCollective(dist.group.WORLD), "none", steps, **overlap)


@pytest.mark.parametrize("delay,alpha", [(0, 0.0), (1, 0.5)], ids=["blocking", "overlapped"])
def test_torchft_diloco_equals_ours_without_compression(delay, alpha):
    # torchft averages the pseudo-gradients (anchor - theta, as ours) with ReduceOp.AVG and takes the same
    # Nesterov SGD step from the anchor: with no compression the two are the same algorithm. Overlapped:
    # torchft's Streaming DiLoCo (fragment_sync_delay, fragment_update_alpha) is our overlap_merge=mix.
    steps = 2 * H
    results = run_ranks(against_torchft_diloco, 2, steps, delay, alpha, timeout_s=60)
    for run, ours in results:
        torch.testing.assert_close(run.state, ours["state"], rtol=1e-6, atol=1e-7)
        assert run.losses == pytest.approx(ours["losses"], rel=1e-6)
        assert run.commits == ours["rounds"] == steps // H
        # torchft all-reduces tensor by tensor, hetero one flat buffer: on two replicas the ring model
        # gives the same bytes (the model's fp32 size per round)
        n_bytes = sum(t.numel() * 4 for t in build_model().parameters())
        assert run.bytes_sent == ours["bytes"] == steps // H * n_bytes


class AbortAtRound(TorchftCollective):
    """Aborts this replica's torchft process group once round ``fail_round`` has its quorum.

    Its collectives of that round then fail to launch, and its peers' fail on the closed connections:
    a real failure, on every replica.
    """

    def __init__(self, manager, fail_round: int):
        super().__init__(manager)
        self.fail_round = fail_round
        self.started = 0

    def start_round(self) -> None:
        super().start_round()
        self.started += 1
        if self.started == self.fail_round:
            self.manager._pg.abort()


def fail_second_round(rank: int, world_size: int, method: str, overlap: int) -> list[dict]:
    with shared_lighthouse() as addr, replica_manager(f"replica_{rank}", addr, TIMEOUT) as manager:
        comm = AbortAtRound(manager, fail_round=2 if rank == 1 else 0)
        model = build_model()
        inner = adamw(model.parameters())
        feedback = "ef" if method != "none" else "auto"
        config = diloco_config(method, feedback, overlap_steps=overlap)
        diloco = build_diloco(config, model.named_parameters(), comm)
        loss_fn, after_sync = loss_on(rank), []
        for step in range(3 * H):
            inner.zero_grad(set_to_none=True)
            loss_fn(model, step).backward()
            inner.step()
            if diloco.after_inner_step() is not None:
                after_sync.append({
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "anchor": {n: a.detach().clone() for n, a in diloco.anchor.items()},
                    "rounds": diloco.rounds,
                    "step": manager.current_step(),
                    "residual": {n: r.clone() for n, r in diloco.residual.items()},
                    "codec_state": copy.deepcopy(diloco.codec_state),
                })
        diloco.close()
        return after_sync


# all-reduce; all-to-all and all-gather; int32; and int4's from the round's thread
@pytest.mark.parametrize("method,overlap", [("none", 0), ("int4", 0), ("shared_topk", 0), ("int4", 1)],
                         ids=["none", "int4", "shared_topk", "int4-overlapped"])
def test_a_round_that_fails_is_dropped_and_the_next_one_commits(method, overlap):
    # overlapped: each round's quorum, collectives and commit run on the round's background thread
    results = run_ranks(fail_second_round, 2, method, overlap, timeout_s=60)
    for first, failed, third in results:
        assert (first["rounds"], failed["rounds"], third["rounds"]) == (1, 1, 2)
        assert (first["step"], failed["step"], third["step"]) == (1, 1, 2)
        # the failed round left the anchor where the first round put them, and the weights back at it
        # (blocking: where the first round put them; overlapped, they had moved on since)
        torch.testing.assert_close(failed["anchor"], first["anchor"], rtol=0, atol=0)
        torch.testing.assert_close(failed["params"], failed["anchor"] if overlap else first["params"], rtol=0, atol=0)
        # ... and its error-feedback residuals (int4 with EF) as they were
        torch.testing.assert_close(failed["residual"], first["residual"], rtol=0, atol=0)
        torch.testing.assert_close(failed["codec_state"], first["codec_state"], rtol=0, atol=0)
        if method != "none":
            assert first["residual"] and not torch.equal(third["residual"]["0.weight"], first["residual"]["0.weight"])
        if not overlap:  # overlapped, each replica keeps its own progress since the send
            torch.testing.assert_close(third["params"], third["anchor"], rtol=0, atol=0)
        assert not torch.equal(third["params"]["0.weight"], first["params"]["0.weight"])
    # the third round ran on a reconfigured process group, with both replicas
    torch.testing.assert_close(results[0][2]["anchor"], results[1][2]["anchor"], rtol=0, atol=0)
    if not overlap:
        torch.testing.assert_close(results[0][2]["params"], results[1][2]["params"], rtol=0, atol=0)


def runtime_over_torchft(rank: int, world_size: int, steps: int) -> dict:
    from test_compression_training import CONFIG, OPTIM, batches, step, weights

    from hetero.testing.kinds import build_runtime
    from hetero.testing.experiments import experiment, module

    compression = CompressionConfig(diloco=DiLoCoConfig(inner_steps=2))
    config = experiment(2, {"llm": module("gpt", CONFIG, {"dp": 2}, OPTIM, compression=compression)},
                        global_batch=8, microbatches=2, seed=7)
    with shared_lighthouse() as addr, replica_manager(f"replica_{rank}", addr, TIMEOUT) as manager:
        runtime = build_runtime(config, outer_comms={"llm": TorchftCollective(manager)})
        for batch in batches(steps):
            step(runtime, batch)
        return weights(runtime)


def test_runtime_runs_diloco_over_torchft_replica_groups():
    """Each DP replica of the GPT is its own torchft replica group, and DiLoCo's outer rounds run over
    torchft: the same run as over the dp group."""
    from test_compression_training import oracle_diloco

    results = run_ranks(runtime_over_torchft, 2, 6, timeout_s=120)
    _, params0, params1 = oracle_diloco(6, 2, 1)
    for got, expected in zip(results, (params0, params1)):
        for name, p in expected.items():
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-5)
