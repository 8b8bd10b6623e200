"""1F1B's steady state posts each send together with the receive that follows it, in one batch.

Two neighbouring stages that both send before they receive wait for each other for ever on NCCL once the
messages outgrow its buffers (gloo forgives it). A GPT under pp2 with 4 microbatches: stage 0 runs
F0 F1 B0 F2 B1 F3 B2 B3 and stage 1 F0 B0 F1 B1 F2 B2 F3 B3; every "F then B" of stage 0 is one batch
(activation out, gradient in) and every "B then F" of stage 1 one batch (gradient out, activation in),
three each. Values against one process: ``test_gpt_parity`` (pp2, pp4, tp2·pp2, ...).
"""

import torch.distributed as dist

from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from test_gpt_parity import CONFIG, batches


def batches_of_a_step(rank, world_size):
    runtime = build_runtime(experiment(world_size, {"llm": module("gpt", CONFIG, {"pp": 2})}, global_batch=8,
                                       microbatches=4))
    posted, original = [], dist.batch_isend_irecv

    def recorded(ops):
        posted.append([("send" if op.op.__name__ == "isend" else "recv", op.peer, tuple(op.tensor.shape)) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = recorded
    try:
        runtime.train_step(batches()[0])
    finally:
        dist.batch_isend_irecv = original
    return posted


def test_1f1b_steady_state_pairs_each_send_with_the_next_receive():
    activation = (2, CONFIG.seq_len, CONFIG.hidden_size)  # 8 rows / 4 microbatches
    stage0, stage1 = run_ranks(batches_of_a_step, 2, timeout_s=120)
    assert stage0 == [[("send", 1, activation), ("recv", 1, activation)]] * 3
    assert stage1 == [[("send", 0, activation), ("recv", 0, activation)]] * 3
