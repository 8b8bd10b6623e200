"""Pipeline stages send activations and gradients on two process groups, each carrying one direction.

On one group, NCCL runs a link's operations in order: in 1F1B's steady state each neighbour sends before
it receives, and two sends facing each other wait for ever once messages outgrow NCCL's buffers (gloo
forgives it). The VLM with its LLM pp2 and the vision encoder dp2 on the same 2 ranks, under one 1F1B
over the graph (so a rank's stage sends and receives are interleaved with the encoder's work): every
stage-link message of a step is recorded with its group; activations (rank 0 to 1) and gradients (rank 1
to 0) travel on two different groups, and each group carries one direction only. Values against one
process: ``test_vlm_parity`` ("... one 1F1B over the graph").
"""

from hetero.parallel.pipeline import StageLink
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from test_vlm_parity import batches, vlm_experiment


def stage_messages(rank, world_size):
    runtime = build_runtime(vlm_experiment(2, {"vision": {"dp": 2}, "llm": {"pp": 2}}, 8, 4, {}, "graph_1f1b"))
    posted, send, recv = [], StageLink.send, StageLink.recv

    def recorded_send(link, tensor, direction):
        posted.append(("send", link.peer, link.send_group.group_name))
        return send(link, tensor, direction)

    def recorded_recv(link, shape, dtype):
        posted.append(("recv", link.peer, link.recv_group.group_name))
        return recv(link, shape, dtype)

    StageLink.send, StageLink.recv = recorded_send, recorded_recv
    try:
        runtime.train_step(batches(8)[0])
    finally:
        StageLink.send, StageLink.recv = send, recv
    return posted


def test_activations_and_gradients_travel_on_groups_of_their_own():
    first, last = run_ranks(stage_messages, 2, timeout_s=120)
    activations = {group for kind, peer, group in first if kind == "send"}
    gradients = {group for kind, peer, group in first if kind == "recv"}
    assert len(first) == len(last) == 8  # 4 microbatches, an activation and a gradient each
    assert len(activations) == len(gradients) == 1 and activations != gradients
    assert {(kind, group) for kind, _, group in last} == {("recv", *activations), ("send", *gradients)}
    assert {peer for _, peer, _ in first} == {1} and {peer for _, peer, _ in last} == {0}
