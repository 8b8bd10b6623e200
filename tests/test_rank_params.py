"""Each rank's share on paper (``hetero layout --params``, ``hetero/parallel/rank_params.py``): the real
parallelization applied on the meta device in fake worlds. Checked against the bytes a real import reads
and against a hand count."""

import subprocess
import sys

from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.parallel.rank_params import rank_shares
from hetero.testing.experiments import experiment, module
from hetero.testing.kinds import build_graph

from test_moe_import import saved


def test_the_bytes_on_paper_are_those_an_ep_rank_of_the_import_reads(tmp_path):
    """An imported Qwen3-MoE at ep2 (fp32 files): each rank reads every weight but the other rank's half
    of the experts, which ``test_moe_import`` measures a real import reading."""
    saved(tmp_path, "qwen3-moe renormalized")
    checkpoint = HFCheckpoint(tmp_path)
    sizes = {name: t.numel() * t.element_size() for name, t in checkpoint.tensors(checkpoint.names())}
    experts = sum(size for name, size in sizes.items() if ".experts." in name)
    block = module("gpt", {"seq_len": 40}, {"ep": 2, "dp": 2}, init={"hf": str(tmp_path)})
    shares = rank_shares(build_graph(experiment(2, {"llm": block}, global_batch=4, microbatches=1)))
    assert [share.checkpoint_bytes for share in shares] == [sum(sizes.values()) - experts // 2] * 2
    assert [share.parameters * 4 for share in shares] == [share.checkpoint_bytes for share in shares]


def test_a_layout_of_every_axis_is_counted_as_by_hand():
    """tp2·pp2·dp2 with ep2 on 8 ranks, 4 layers of 4 experts: attention split over TP (and the
    embedding and output by vocabulary), norms and router whole, each rank its 2 experts, its stage's 2
    layers."""
    config = {"vocab_size": 64, "hidden_size": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "seq_len": 16,
              "num_experts": 4, "top_k": 2, "expert_ffn_size": 16}
    block = module("gpt", config, {"tp": 2, "pp": 2, "dp": 2, "ep": 2})
    shares = rank_shares(build_graph(experiment(8, {"llm": block}, global_batch=8, microbatches=2)))
    attention = (32 * 32 + 2 * 32 * 16 + 32 * 32) // 2
    layer = attention + 2 * 32 + 4 * 32 + 2 * 3 * 16 * 32  # + norms, router, this rank's experts
    vocabulary = 64 * 32 // 2
    expected = [2 * layer + vocabulary] * 4 + [2 * layer + vocabulary + 32] * 4  # the last stage: + final norm
    assert [share.parameters for share in shares] == expected
    assert all(share.checkpoint_bytes is None for share in shares)


def test_hetero_layout_prints_each_ranks_share(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "layout", "moe_vlm", "--params"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    header, *rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("rank ", "0 ", "1 "))]
    assert header[-2:] == ["parameters", "checkpoint_bytes"]
    llm = [row for row in rows if row[1] == "llm"]
    assert len(llm) == 2 and llm[0][-2] == llm[1][-2] and int(llm[0][-2].replace(",", "")) > 0
