"""The simulated link: transfers queue on it one at a time, every data-parallel collective of a rank goes
through it (per-step sync and DiLoCo rounds, overlapped or not), and it changes no number."""

import pytest
import torch

from hetero.parallel.compression.config import CompressionConfig, CompressorConfig, DiLoCoConfig
from hetero.parallel.compression.link import LinkConfig, SimulatedLink
from hetero.testing.experiments import experiment, module
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from test_compression_training import BATCH, CONFIG, MICRO, OPTIM, SEED, batches, step, weights


def test_transfers_queue_on_the_link():
    now = [0.0]
    link = SimulatedLink(LinkConfig(latency_ms=1, gbit_s=0.008), clock=lambda: now[0])  # 1 MB/s
    assert link.post(1000) == pytest.approx(0.002)  # 1 ms latency + 1 ms for 1,000 bytes
    now[0] = 0.0005
    assert link.post(3000) == pytest.approx(0.006)  # waits for the first transfer: starts at 2 ms
    now[0] = 0.010
    assert link.post(0) == pytest.approx(0.011)  # an idle link starts at once
    assert link.busy_s == pytest.approx(0.002 + 0.004 + 0.001)


LINK = LinkConfig(latency_ms=0.2, gbit_s=50.0)


def train_on_link(rank, world_size, compression, link, steps):
    blocks = {"llm": module("gpt", CONFIG, {"dp": world_size}, OPTIM, {"simulated_link": link},
                            compression=compression)}
    runtime = build_runtime(experiment(world_size, blocks, global_batch=BATCH,
                                       microbatches=BATCH // (MICRO * world_size), seed=SEED))
    losses = [step(runtime, b) for b in batches(steps)]
    sync = runtime.modules["llm"].replica_sync
    comm = (sync.diloco or sync.grad_sync).comm
    busy = comm.link.busy_s if comm.link is not None else None
    anchors = {n: a.detach().clone() for n, a in sync.diloco.anchor.items()} if sync.diloco else weights(runtime)
    return losses, weights(runtime), comm.bytes_sent, busy, anchors


@pytest.mark.parametrize("compression", [
    CompressionConfig(),
    CompressionConfig(diloco=DiLoCoConfig(inner_steps=2, overlap_steps=1, pseudo_grad=CompressorConfig(
        method="shared_topk", ratio=0.1, segment=256, value_bits=2, error_feedback="ef"))),
], ids=["per-step-fp32", "diloco-overlapped-shared-topk"])
def test_every_collective_crosses_the_link_and_no_number_changes(compression):
    steps = 4
    off, on = (run_ranks(train_on_link, 2, compression, link, steps, timeout_s=120)
               for link in (LinkConfig(), LINK))
    for (losses, params, sent, _, _), (linked_losses, linked_params, linked_sent, busy, _) in zip(off, on):
        assert linked_losses == losses and linked_sent == sent > 0
        for name, p in params.items():
            assert linked_params[name].equal(p), name
        # the link carried every byte, and a whole number of latencies: one per collective
        collectives = (busy - sent * 8 / (LINK.gbit_s * 1e9)) / (LINK.latency_ms / 1e3)
        assert collectives == pytest.approx(round(collectives), abs=1e-6) and round(collectives) >= steps // 2
    # after the last sync (step 4) every replica holds the same global weights, bit for bit
    for name, anchor in on[0][4].items():
        assert torch.equal(on[1][4][name], anchor), name
