"""A GPT through the runtime with compressed DP sync or DiLoCo on 2 gloo ranks matches a single-process
oracle that holds both replicas and applies the compression by hand; a run resumed from a checkpoint
continues exactly."""

import copy
from pathlib import Path

import pytest
import torch

from compression_oracle import owner_zeros, quant_sum, shared_topk_sum, topk_sum
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.config import GPTConfig
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig, DiLoCoConfig
from hetero.parallel.compression.diloco import _split_evenly
from hetero.config import CheckpointConfig, OptimizerConfig
from hetero.testing.kinds import build_graph
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.train.checkpoint import Checkpointer
from hetero.train.job import run_identity

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, seq_len=16)
BATCH, MICRO, LR, SEED = 8, 2, 1e-2, 7
OPTIM = OptimizerConfig(lr=LR)


def batches(steps):
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def lm(world_size, compression, layout=None):
    """The runtime of one GPT over ``layout`` (default: dp over every rank)."""
    blocks = {"llm": module("gpt", CONFIG, layout or {"dp": world_size}, OPTIM, compression=compression)}
    return build_runtime(experiment(world_size, blocks, global_batch=BATCH, microbatches=BATCH // (MICRO * world_size),
                                    seed=SEED))


def step(runtime, batch) -> float:
    tokens, labels = batch
    return runtime.train_step({"tokens": tokens, "labels": labels})["loss"]


def weights(runtime) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in runtime.modules["llm"].model.named_parameters()}


def train(rank, world_size, compression, steps):
    runtime = lm(world_size, compression)
    losses = [step(runtime, b) for b in batches(steps)]
    return losses, weights(runtime), runtime.modules["llm"].replica_sync.bytes_sent


def train_with_resume(rank, world_size, compression, steps, directory):
    """Half the steps, a checkpoint (``Checkpointer``: DCP weights and optimizer, rank-local compression
    state), a fresh runtime loading it, the other half."""
    config = experiment(world_size, {"llm": module("gpt", CONFIG, {"dp": world_size}, OPTIM, compression=compression)},
                        global_batch=BATCH, microbatches=BATCH // (MICRO * world_size), seed=SEED)
    checkpoints = Checkpointer(CheckpointConfig(every=1), Path(directory), run_identity(config, build_graph(config)))
    first = lm(world_size, compression)
    data = batches(steps)
    losses = [step(first, b) for b in data[: steps // 2]]
    checkpoints.save(first, steps // 2)
    checkpoints.close()
    del first
    second = lm(world_size, compression)
    assert checkpoints.load(second, Path(directory) / f"step_{steps // 2:06d}", same_local=True) == steps // 2
    losses += [step(second, b) for b in data[steps // 2 :]]
    return losses, weights(second)


def rows(tokens, replica, replicas=2):
    """Replica ``replica``'s rows, as the runtime deals them: its ``MICRO`` rows of each global microbatch
    (``replicas`` × ``MICRO`` rows), microbatch after microbatch."""
    micro = MICRO * replicas
    return torch.cat([tokens[start + replica * MICRO : start + (replica + 1) * MICRO]
                      for start in range(0, tokens.shape[0], micro)])


def replica_grads(model, tokens, labels, replica, normalizer):
    """This replica's loss and flat gradient, accumulated over microbatches as the runtime does (a
    different summation order would move quantization and top-k decisions at their boundaries)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in zip(rows(tokens, replica).split(MICRO), rows(labels, replica).split(MICRO)):
        loss = token_loss_sum(model(x), y) / normalizer
        loss.backward()
        total += loss.item()
    return total, torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def set_flat(tensors, flat):
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def oracle_compressed_sync(steps, method):
    """One model; per step each replica's gradient of its rows, summed through the compressor by hand."""
    torch.manual_seed(SEED)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    numel = sum(p.numel() for p in model.parameters())
    residuals = [torch.zeros(numel) for _ in range(2)]
    owners = owner_zeros(numel, 2, 64)
    losses = []
    for tokens, labels in batches(steps):
        results = [replica_grads(model, tokens, labels, r, tokens.numel()) for r in range(2)]
        grads = [g for _, g in results]
        if method == "topk":
            total = topk_sum(grads, residuals, 0.05, 256)
        else:
            total = quant_sum(grads, residuals, owners, 8, 64)
        with torch.no_grad():
            set_flat([p.grad for p in model.parameters()], total)
        opt.step()
        losses.append(sum(loss for loss, _ in results))
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("method", ["topk", "int8"])
def test_compressed_sync_training_matches_the_oracle(method):
    grad = CompressorConfig(method=method, ratio=0.05, segment=256)
    results = run_ranks(train, 2, CompressionConfig(grad=grad), 6, timeout_s=180)
    losses, params = oracle_compressed_sync(6, method)
    for got_losses, got_params, _ in results:
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for name, p in params.items():
            torch.testing.assert_close(got_params[name], p.detach(), rtol=1e-5, atol=1e-5)


def oracle_diloco(steps, inner_steps, fragments, pseudo_method="none", decay=1.0, outer_lr=0.7, momentum_factor=0.9,
                  overlap=0, merge="keep", alpha=0.0):
    """Two replicas train alone; every inner_steps/fragments steps one fragment's deltas are averaged and
    applied to the anchor by Nesterov SGD (``outer_lr``, ``momentum_factor``), then copied back to both
    replicas. ``shared_topk``: replica r mod 2 chooses the entries of round r, the residuals decay by ``decay``.
    ``overlap`` > 0: the deltas are taken that many steps before the round's end, and at its end each
    replica gets the anchor plus its progress since then (``keep``) or lerp(anchor, replica, ``alpha``)."""
    torch.manual_seed(SEED)
    models = [GPT(CONFIG)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.AdamW(m.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    parts = _split_evenly(names, [p.numel() for p in models[0].parameters()], fragments)
    anchor = {n: p.detach().clone() for n, p in models[0].named_parameters()}
    momentum = {n: torch.zeros_like(a) for n, a in anchor.items()}
    residuals, owners, rounds = {}, {}, {}
    period = inner_steps // fragments
    losses = []
    for step, (tokens, labels) in enumerate(batches(steps)):
        step_losses = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            loss, _ = replica_grads(model, tokens, labels, r, tokens.numel() // 2)
            opt.step()
            step_losses.append(loss)
        losses.append(sum(step_losses) / 2)
        position = (step + 1) % period
        fragment = ((step + 1 + overlap) // period - 1) % fragments
        part = parts[fragment]
        params = [dict(m.named_parameters()) for m in models]
        if position == (period - overlap) % period:
            sent = [{n: p[n].detach().clone() for n in part} for p in params]
            deltas = [torch.cat([(anchor[n] - p[n].detach()).reshape(-1) for n in part]) for p in params]
        if position:
            continue
        if pseudo_method == "int4":
            numel = deltas[0].numel()
            residuals.setdefault(fragment, [torch.zeros(numel) for _ in range(2)])
            owners.setdefault(fragment, owner_zeros(numel, 2, 64))
            mean = quant_sum(deltas, residuals[fragment], owners[fragment], 4, 64) / 2
        elif pseudo_method == "shared_topk":
            kept = residuals.setdefault(fragment, [torch.zeros(deltas[0].numel()) for _ in range(2)])
            kept[:] = [decay * r for r in kept]
            rounds[fragment] = rounds.get(fragment, -1) + 1
            mean = shared_topk_sum(deltas, kept, 0.1, 256, rounds[fragment] % 2) / 2
        else:
            mean = sum(deltas) / 2
        offset = 0
        for n in part:
            g = mean[offset : offset + anchor[n].numel()].view_as(anchor[n])
            offset += anchor[n].numel()
            momentum[n] = momentum_factor * momentum[n] + g
            anchor[n] = anchor[n] - outer_lr * (g + momentum_factor * momentum[n])
            with torch.no_grad():
                for p, since in zip(params, sent):
                    if not overlap:
                        p[n].copy_(anchor[n])
                    elif merge == "keep":
                        p[n].copy_((p[n] - since[n]) + anchor[n])
                    else:
                        p[n].copy_(torch.lerp(anchor[n], p[n], alpha))
    return losses, dict(models[0].named_parameters()), dict(models[1].named_parameters())


def test_diloco_with_shared_topk_and_decayed_error_feedback_matches_the_oracle():
    """SparseLoCo's structure: no outer momentum, the error-feedback residual decayed each round (0.8), the
    pseudo-gradients' top-k entries chosen by each replica in turn."""
    pseudo = CompressorConfig(method="shared_topk", ratio=0.1, segment=256)
    compression = CompressionConfig(diloco=DiLoCoConfig(inner_steps=2, outer_lr=1.0, outer_momentum=0.0,
                                                        error_decay=0.8, pseudo_grad=pseudo))
    steps = 8
    results = run_ranks(train, 2, compression, steps, timeout_s=180)
    losses, params0, params1 = oracle_diloco(steps, 2, 1, "shared_topk", decay=0.8, outer_lr=1.0, momentum_factor=0.0)
    for rank, (got_losses, got_params, _) in enumerate(results):
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for name, p in (params0 if rank == 0 else params1).items():
            torch.testing.assert_close(got_params[name], p.detach(), rtol=1e-5, atol=1e-5)
    _, without_decay, _ = oracle_diloco(steps, 2, 1, "shared_topk", decay=1.0, outer_lr=1.0, momentum_factor=0.0)
    assert any(not torch.allclose(params0[n], without_decay[n], rtol=1e-5, atol=1e-5) for n in params0)


@pytest.mark.parametrize(
    "inner_steps,fragments,pseudo",
    [(2, 1, "none"), (4, 2, "none"), (2, 1, "int4")],
    ids=["diloco", "streaming", "int4-ef"],
)
def test_diloco_matches_the_oracle(inner_steps, fragments, pseudo):
    pseudo_grad = CompressorConfig(method=pseudo, error_feedback="ef" if pseudo != "none" else "auto")
    compression = CompressionConfig(diloco=DiLoCoConfig(inner_steps=inner_steps, fragments=fragments,
                                                        pseudo_grad=pseudo_grad))
    steps = 8
    results = run_ranks(train, 2, compression, steps, timeout_s=180)
    losses, params0, params1 = oracle_diloco(steps, inner_steps, fragments, pseudo)
    for rank, (got_losses, got_params, sent) in enumerate(results):
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for name, p in (params0 if rank == 0 else params1).items():
            torch.testing.assert_close(got_params[name], p.detach(), rtol=1e-5, atol=1e-5)
    numel = sum(p.numel() for p in params0.values())
    if pseudo == "none":  # every parameter crosses once per outer round, as one fp32 all-reduce
        assert results[0][2] == steps // inner_steps * numel * 4


@pytest.mark.parametrize(
    "merge,alpha,pseudo", [("keep", 0.0, "int4"), ("mix", 0.5, "none")], ids=["keep-int4-ef", "mix"])
def test_overlapped_diloco_matches_the_oracle(merge, alpha, pseudo):
    """Each round's exchange runs in the background for 2 of its 4 steps; at its end the replicas merge."""
    pseudo_grad = CompressorConfig(method=pseudo, error_feedback="ef" if pseudo != "none" else "auto")
    compression = CompressionConfig(diloco=DiLoCoConfig(inner_steps=4, overlap_steps=2, overlap_merge=merge,
                                                        overlap_alpha=alpha, pseudo_grad=pseudo_grad))
    steps = 8
    results = run_ranks(train, 2, compression, steps, timeout_s=180)
    losses, params0, params1 = oracle_diloco(steps, 4, 1, pseudo, overlap=2, merge=merge, alpha=alpha)
    for rank, (got_losses, got_params, _) in enumerate(results):
        assert got_losses == pytest.approx(losses, rel=1e-5)
        for name, p in (params0 if rank == 0 else params1).items():
            torch.testing.assert_close(got_params[name], p.detach(), rtol=1e-5, atol=1e-5)
    # the merge kept each replica's own progress: the replicas differ after the last round landed
    assert any(not torch.equal(results[0][1][n], results[1][1][n]) for n in params0)
    _, blocking, _ = oracle_diloco(steps, 4, 1, pseudo)
    assert any(not torch.allclose(params0[n], blocking[n], rtol=1e-5, atol=1e-5) for n in params0)


@pytest.mark.parametrize(
    "compression",
    [
        CompressionConfig(grad=CompressorConfig(method="topk", ratio=0.05, segment=256, error_feedback="ef21")),
        CompressionConfig(grad=CompressorConfig(method="int4")),
        CompressionConfig(grad=CompressorConfig(method="powersgd", rank=2)),
        # the chooser's turn, the decayed residual and the int4 values' owner residuals all carried over
        CompressionConfig(diloco=DiLoCoConfig(inner_steps=2, outer_momentum=0.0, error_decay=0.9, pseudo_grad=CompressorConfig(
            method="shared_topk", ratio=0.1, segment=256, value_bits=4, error_feedback="ef"))),
        # the checkpoint (after step 3) falls while a round sent at step 2 is in flight; it lands at step 4
        CompressionConfig(diloco=DiLoCoConfig(inner_steps=4, overlap_steps=2, pseudo_grad=CompressorConfig(
            method="int4", error_feedback="ef"))),
    ],
    ids=["topk-ef21", "int4-ef", "powersgd", "diloco-shared-topk-int4-decayed-ef", "diloco-overlapped-int4-ef"],
)
def test_resume_from_a_checkpoint_continues_identically(compression, tmp_path):
    runs = run_ranks(straight_and_resumed, 2, compression, 6, str(tmp_path), timeout_s=240)
    for (losses, params, _), (resumed_losses, resumed_params) in runs:
        assert resumed_losses == losses
        for name, p in params.items():
            assert torch.equal(resumed_params[name], p), name


def straight_and_resumed(rank, world_size, compression, steps, tmp):
    """Both runs in one world (starting ranks costs more than the runs): uninterrupted, then resumed."""
    return train(rank, world_size, compression, steps), train_with_resume(rank, world_size, compression, steps, tmp)


def train_on_layout(rank, world_size, layout, compression, steps):
    runtime = lm(layout.get("dp", 1), compression, layout) if world_size == layout.get("dp", 1) else None
    if runtime is None:  # dp replicas of tp groups: the microbatch count follows dp
        blocks = {"llm": module("gpt", CONFIG, layout, OPTIM, compression=compression)}
        runtime = build_runtime(experiment(world_size, blocks, global_batch=BATCH,
                                           microbatches=BATCH // (MICRO * layout["dp"]), seed=SEED))
    losses = [step(runtime, b) for b in batches(steps)]
    return losses, weights(runtime)


def test_diloco_on_tensor_parallel_replicas_matches_plain_replicas():
    """DiLoCo keeps anchors of each rank's shard: tp=2 replicas train exactly as tp=1 ones."""
    compression = CompressionConfig(diloco=DiLoCoConfig(inner_steps=2))
    plain = run_ranks(train_on_layout, 2, {"dp": 2}, compression, 6, timeout_s=180)[0]
    sharded = run_ranks(train_on_layout, 4, {"tp": 2, "dp": 2}, compression, 6, timeout_s=240)[0]
    assert sharded[0] == pytest.approx(plain[0], rel=1e-5)
    # TP sums partial products in another order; AdamW turns that float noise into a few thousandths of
    # one lr-sized step on single near-zero-gradient elements (up to 0.0057·lr measured on an AVX-512
    # CPU), so each tensor is compared in norm, as the parity checks compare gradients: measured up to
    # 2.9e-5 relative, where anchors of the wrong shard would be off by about lr on every element.
    for name, p in plain[1].items():
        difference = float((sharded[1][name] - p).norm() / p.norm())
        assert difference < 1e-4, f"{name}: tp2 weights differ from tp1's by {difference:.2e} relative (in norm)"
