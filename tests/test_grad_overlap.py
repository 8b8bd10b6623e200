"""The DP gradient all-reduce overlaps the backward, shown by a trace recorded on gloo.

Each rank of a dp2 GPT (2 microbatches, small gradient buckets) logs, in the order they happen, the
start and end of every backward, every parameter's gradient becoming final (a hook registered after the
sync's own) and every ``all_reduce`` posted. The first bucket's all-reduce must be posted during the
last microbatch's backward while gradients of later buckets are still to come; nothing is posted during
the first microbatch's backward (its gradients are not final); the buckets are posted in order, every
parameter in exactly one; and the byte counter is what the ring model gives for every gradient once.
Gradient values against one process are the parity tests' (``test_gpt_parity``: dp2 uses this sync).
"""

import torch
import torch.distributed as dist

from hetero.parallel.compression.collective import all_reduce_wire_bytes
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from test_gpt_parity import CONFIG, batches

BUCKET_MB = 8 / 1024  # 8 KB: a few weight matrices per bucket, several buckets in all


def trace_a_step(rank, world_size):
    blocks = {"llm": module("gpt", CONFIG, {"dp": 2}, parallel=ParallelOptions(grad_bucket_mb=BUCKET_MB))}
    runtime = build_runtime(experiment(world_size, blocks, global_batch=8, microbatches=2))
    model, sync = runtime.modules["llm"].model, runtime.modules["llm"].replica_sync.grad_sync
    names = {id(p): n for n, p in model.named_parameters()}
    trace: list[tuple[str, object]] = []
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: trace.append(("grad", names[id(p)])))
    backward, all_reduce = torch.autograd.backward, dist.all_reduce

    def traced_backward(*args, **kwargs):
        trace.append(("backward begins", None))
        backward(*args, **kwargs)
        trace.append(("backward ends", None))

    def traced_all_reduce(tensor, *args, **kwargs):
        trace.append(("all_reduce", tensor.numel()))
        return all_reduce(tensor, *args, **kwargs)

    torch.autograd.backward, dist.all_reduce = traced_backward, traced_all_reduce
    try:
        runtime.train_step(batches()[0])
    finally:
        torch.autograd.backward, dist.all_reduce = backward, all_reduce
    buckets = [[names[id(p)] for p in bucket] for bucket in sync.buckets]
    numels = {n: p.numel() for n, p in model.named_parameters()}
    return trace, buckets, sync.bytes_sent, numels


def test_first_bucket_all_reduce_starts_before_the_backward_ends():
    for trace, buckets, sent, numels in run_ranks(trace_a_step, 2, timeout_s=180):
        assert len(buckets) >= 3, buckets
        assert sorted(n for bucket in buckets for n in bucket) == sorted({n for kind, n in trace if kind == "grad"})
        begins = [i for i, (kind, _) in enumerate(trace) if kind == "backward begins"]
        ends = [i for i, (kind, _) in enumerate(trace) if kind == "backward ends"]
        assert len(begins) == len(ends) == 2  # one backward per microbatch
        first_window = trace[begins[0] : ends[0]]
        assert not any(kind == "all_reduce" for kind, _ in first_window), "a bucket left before its gradients were final"
        last = trace[begins[1] : ends[1] + 1]
        first_post = next(i for i, (kind, _) in enumerate(last) if kind == "all_reduce")
        later = {n for bucket in buckets[1:] for n in bucket}
        still_to_come = [n for kind, n in last[first_post:] if kind == "grad" and n in later]
        print(f"\n{len(buckets)} buckets; after the first bucket's all-reduce was posted the backward still "
              f"produced {len(still_to_come)} of the other buckets' {len(later)} gradients")
        assert still_to_come, "the first bucket's all-reduce started only after the backward"
        posts = [value for kind, value in trace if kind == "all_reduce"]
        assert posts[: len(buckets)] == [sum(numels[n] for n in bucket) for bucket in buckets]  # in order, once each
        assert sent == sum(all_reduce_wire_bytes(4 * sum(numels[n] for n in bucket), 2) for bucket in buckets)
        assert sent == all_reduce_wire_bytes(4 * sum(numels.values()), 2)  # every gradient once
