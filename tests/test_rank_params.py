"""Each rank's share on paper (``hetero layout --params``, ``hetero/parallel/rank_params.py``): the real
parallelization applied on the meta device in fake worlds. Checked against the bytes a real import reads
and against a hand count."""

import subprocess
import sys

import torch

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


QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     tie_word_embeddings=False)


def names_only_checkpoint(directory, family: str, fields: dict) -> None:
    """A bf16 checkpoint of transformers' ``family`` with ``fields`` as the hub lays out its big ones: an index
    naming every weight (each expert's own, as the hub's files hold them) and its shard, and config.json;
    the shards are not written (the count reads names and the config alone)."""
    import json

    import transformers

    config = getattr(transformers, f"{family}Config")(**fields)
    with torch.device("meta"):
        state = getattr(transformers, f"{family}ForCausalLM")(config).state_dict()
    names = []
    for name, tensor in state.items():
        layer, _, fused = name.rpartition(".experts.")
        parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}.get(fused) if layer else None
        names += [f"{layer}.experts.{e}.{part}.weight" for e in range(tensor.shape[0]) for part in parts] if parts else [name]
    directory.mkdir()
    weight_map = dict.fromkeys(names, "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    saved = config.to_dict() | {"architectures": [f"{family}ForCausalLM"], "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps({k: v for k, v in saved.items() if k != "dtype"}))


def test_real_size_moe_checkpoints_at_ep8_pp4_are_counted_as_by_hand(tmp_path):
    """Qwen3-30B-A3B and DeepSeek-V3 (transformers' DeepseekV3Config defaults are its sizes; a bf16 copy, as
    its hub weights are fp8, which hetero refuses until dequantized) at ep8·tp1·pp4 (dp8, 32 ranks): each
    rank holds its stage's layers whole but for the experts, of which it holds its EP group's eighth, and
    reads exactly those in bf16."""
    qwen_attention = 2048 * 32 * 128 * 2 + 2 * 2048 * 4 * 128 + 2 * 128  # q and o, k and v, q/k norms
    qwen_layer = qwen_attention + 2 * 2048 + 128 * 2048 + 16 * 3 * 2048 * 768  # norms, router, 16 experts
    qwen_expected = [12 * qwen_layer + 151936 * 2048, 12 * qwen_layer, 12 * qwen_layer,
                     12 * qwen_layer + 2048 + 151936 * 2048]  # stage 0: embedding; stage 3: final norm, output
    h = 7168
    mla = h * 1536 + 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 + 512 * 128 * (128 + 128) + 128 * 128 * h
    dense = mla + 2 * h + 3 * h * 18432
    moe = mla + 2 * h + 256 * h + 256 + 3 * h * 2048 + 32 * 3 * h * 2048  # router, its bias, shared, 32 experts
    # 61 layers over 4 stages: 16 (the 3 dense first), 15, 15, 15
    deepseek_expected = [3 * dense + 13 * moe + 129280 * h, 15 * moe, 15 * moe, 15 * moe + h + 129280 * h]
    for family, fields, expected in (("Qwen3Moe", QWEN3_30B_A3B, qwen_expected), ("DeepseekV3", {}, deepseek_expected)):
        names_only_checkpoint(tmp_path / family, family, fields)
        block = module("gpt", {"seq_len": 64}, {"ep": 8, "pp": 4, "dp": 8}, init={"hf": str(tmp_path / family)})
        shares = rank_shares(build_graph(experiment(32, {"llm": block}, global_batch=32, microbatches=4)))
        by_stage = [expected[rank // 8] for rank in range(32)]  # ranks 8s..8s+7: stage s's eight EP ranks
        print(f"\n{family}: parameters per rank, stages 0-3: {', '.join(f'{e:,}' for e in expected)}; bf16 bytes "
              f"{', '.join(f'{2 * e:,}' for e in expected)}")
        assert [share.parameters for share in shares] == by_stage, family
        assert [share.checkpoint_bytes for share in shares] == [2 * e for e in by_stage]
