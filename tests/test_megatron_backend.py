"""The gpt kind's megatron backend (megatron-core's GPTModel) matches the native GPT in one process on the
same weights: losses and gradient norms for 4 AdamW steps, every replica's step-1 gradients under native
names (``hetero.testing.parity``), fp32, alone (``test_gpt_parity``'s model, data and reference), with
experts (``test_moe_parity``'s, both auxiliary losses included) and as the LLM of a VLM behind a boundary
(``test_vlm_parity``'s). Skipped without the ``megatron`` extra; megatron-core runs on CPU under
``hetero.testing.megatron_cpu``."""

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from hetero.config import CheckpointConfig, OptimizerConfig  # noqa: E402
from hetero.errors import ConfigError  # noqa: E402
from hetero.testing.kinds import build_graph  # noqa: E402
from hetero.interop.hf_checkpoint import HFCheckpoint  # noqa: E402
from hetero.interop.hf_export import export_hf  # noqa: E402
from hetero.models.gpt.config import GPTConfig, RopeScaling  # noqa: E402
from hetero.models.gpt.megatron_names import is_expert, megatron_shards, native_tensors  # noqa: E402
from hetero.models.gpt.model import GPT  # noqa: E402
from hetero.parallel.options import ParallelOptions  # noqa: E402
from hetero.testing.kinds import build_runtime  # noqa: E402
from hetero.testing.experiments import experiment, module  # noqa: E402
from hetero.testing.megatron_cpu import megatron_on_cpu  # noqa: E402
from hetero.testing.multiprocess import run_ranks  # noqa: E402
from hetero.testing.parity import check_parity, record_run  # noqa: E402
from hetero.train.checkpoint import Checkpointer  # noqa: E402
from hetero.train.job import expert_routing, run_identity  # noqa: E402
import test_hf_import as hf_import  # noqa: E402
import test_packed_parity as packed  # noqa: E402
import test_moe_parity as moe  # noqa: E402
import test_vlm_parity as vlm  # noqa: E402
from test_gpt_parity import CONFIG, GLOBAL_BATCH, LR, MICROBATCHES, SEED, batches, reference  # noqa: E402

MEGATRON = replace(CONFIG, backend="megatron")
QWEN_LIKE = replace(CONFIG, qk_norm=True, qkv_bias=True)  # per-head q/k norms: gradients summed over TP
# the attention factor (1.139) scales the scores by its square through megatron-core's softmax scale
YARN = replace(CONFIG, rope_scaling=RopeScaling(type="yarn", factor=4.0, original_max_position=8))
CASES = {  # name: (model, layout, parallel options)
    "tp1": (CONFIG, {}, ParallelOptions()),
    "tp2": (CONFIG, {"tp": 2}, ParallelOptions()),
    "tp2+sp": (CONFIG, {"tp": 2}, ParallelOptions(sequence_parallel=True)),
    "tp2+sp, q/k norms and biases": (QWEN_LIKE, {"tp": 2}, ParallelOptions(sequence_parallel=True)),
    "tp2, yarn scaling": (YARN, {"tp": 2}, ParallelOptions()),
    "pp2": (CONFIG, {"pp": 2}, ParallelOptions()),
    "tp2·pp2+sp": (CONFIG, {"tp": 2, "pp": 2}, ParallelOptions(sequence_parallel=True)),
    "tp2+activation checkpointing": (CONFIG, {"tp": 2}, ParallelOptions(activation_checkpointing=True)),
    "dp2": (CONFIG, {"dp": 2}, ParallelOptions()),
    # the norms' TP sums happen before the overlapped DP sync takes their gradients
    "tp2·dp2+sp": (CONFIG, {"tp": 2, "dp": 2}, ParallelOptions(sequence_parallel=True)),
}
SP = ParallelOptions(sequence_parallel=True)
MOE_CASES = {  # name: (model, layout, parallel options): test_moe_parity's model, on the megatron backend
    "tp2+sp": (moe.CONFIG, {"tp": 2}, SP),  # every expert on both ranks, each routing its part of the sequence
    "ep2 sigmoid+checkpointing": (moe.SIGMOID, {"dp": 2, "ep": 2}, ParallelOptions(activation_checkpointing=True)),
    "ep2·tp2+sp": (moe.CONFIG, {"tp": 2, "dp": 2, "ep": 2}, SP),
    "ep2·pp2": (moe.CONFIG, {"pp": 2, "dp": 2, "ep": 2}, ParallelOptions()),
}
VLM_CASES = {  # name: (layouts, world size); the llm on the megatron backend
    "colocated vision dp2, llm tp2": ({"vision": {"dp": 2}, "llm": {"tp": 2}}, 2),
    "non-colocated vision dp2 (0-1), llm tp2 (2-3)": ({"vision": {"dp": 2}, "llm": {"tp": 2, "offset": 2}}, 4),
}
VLM_BATCH, VLM_MICROBATCHES = 8, 2


def world_size_of(layout: dict) -> int:
    return layout.get("tp", 1) * layout.get("pp", 1) * layout.get("dp", 1)


def train_cases(rank, world_size, cases, keys):
    """Each case's run on the megatron backend (test_gpt_parity's and test_moe_parity's batch, microbatches,
    seed and learning rate are the same), recording the metrics ``keys``."""
    results = {}
    with megatron_on_cpu():
        for key, config, layout, options in cases:
            blocks = {"llm": module("gpt", replace(config, backend="megatron"), layout, OptimizerConfig(lr=LR), options)}
            runtime = build_runtime(experiment(world_size, blocks, global_batch=GLOBAL_BATCH,
                                               microbatches=MICROBATCHES, seed=SEED))
            results[key] = record_run(runtime, batches(config), keys)
    return results


@functools.cache
def results(world_size: int, experts: bool = False) -> dict:
    table, keys = (MOE_CASES, moe.KEYS) if experts else (CASES, ("loss",))
    cases = [(key, *case) for key, case in table.items() if world_size_of(case[1]) == world_size]
    ranks = run_ranks(train_cases, world_size, cases, keys, timeout_s=300)
    return {key: [by_key[key] for by_key in ranks] for key, *_ in cases}


@pytest.mark.parametrize("key", list(CASES))
def test_megatron_backend_matches_the_native_gpt(key):
    config, layout, _ = CASES[key]
    got = results(world_size_of(layout))[key]
    print("\n" + check_parity(got, reference(config), f"megatron backend {key}"))


@pytest.mark.parametrize("key", list(MOE_CASES))
def test_megatron_experts_match_the_native_mixture_of_experts(key):
    """megatron-core's MoE layer (its router, dispatcher and experts) with hetero's auxiliary losses against
    the native model in one process: the loss and both auxiliary losses at every step."""
    config, layout, _ = MOE_CASES[key]
    got = results(world_size_of(layout), experts=True)[key]
    print("\n" + check_parity(got, moe.references(moe.config_name(config)), f"megatron experts {key}"))


def evaluated(rank, world_size):
    """Loss and next-token accuracy at one position per row (the whole vocabulary's argmax) on a batch each
    backend has trained on 20 times at tp2, from the same weights."""
    batch = batches()[0] | {"answer_position": torch.arange(GLOBAL_BATCH) % CONFIG.seq_len}
    out = {}
    with megatron_on_cpu():
        for backend in ("native", "megatron"):
            blocks = {"llm": module("gpt", replace(CONFIG, backend=backend), {"tp": 2}, OptimizerConfig(lr=LR))}
            runtime = build_runtime(experiment(world_size, blocks, global_batch=GLOBAL_BATCH, microbatches=1, seed=SEED))
            for _ in range(20):
                runtime.train_step(batch)
            out[backend] = runtime.evaluate([batch])
    return out


def test_evaluation_on_the_megatron_backend_matches_the_native_one():
    for got in run_ranks(evaluated, 2, timeout_s=300):
        native, megatron = got["native"], got["megatron"]
        assert abs(megatron["llm.loss"] - native["llm.loss"]) / native["llm.loss"] < 1e-5, got
        assert megatron["llm.answer_accuracy"] == native["llm.answer_accuracy"] > 0.5, got


def train_vlm(rank, world_size, layouts):
    modules = {name: module(kind, config, layouts[name], vlm.OPTIM[name])
               for name, kind, config in (("vision", "vit", vlm.VISION), ("llm", "gpt", replace(vlm.LLM, backend="megatron")))}
    with megatron_on_cpu():
        runtime = build_runtime(experiment(world_size, modules, edges=[("vision", "llm")], global_batch=VLM_BATCH,
                                           microbatches=VLM_MICROBATCHES, grad_clip=vlm.CLIP))
        return record_run(runtime, vlm.batches(VLM_BATCH)[:vlm.STEPS])


@pytest.mark.parametrize("key", list(VLM_CASES))
def test_a_vlm_with_a_megatron_llm_matches_one_process(key):
    """vision (native ViT) -> llm (megatron-core) through a boundary, against the native VLM in one process."""
    layouts, world_size = VLM_CASES[key]
    got = run_ranks(train_vlm, world_size, layouts, timeout_s=300)
    print("\n" + check_parity(got, vlm.reference(VLM_BATCH), f"megatron VLM {key}"))


def train_packed(rank, world_size):
    blocks = {"llm": module("gpt", replace(packed.LLM, backend="megatron"), {"tp": 2}, packed.OPTIM["llm"],
                            ParallelOptions(sequence_parallel=True))}
    with megatron_on_cpu():
        runtime = build_runtime(experiment(world_size, blocks, global_batch=packed.ROWS,
                                           microbatches=packed.MICROBATCHES, seed=packed.SEED))
        return record_run(runtime, packed.text_batches())


def test_packed_rows_on_the_megatron_backend_match_each_document_run_alone():
    """tp2+sp on rows of several documents (attention kept inside each, RoPE restarting per document)
    against ``test_packed_parity``'s reference, which runs every document on its own."""
    got = run_ranks(train_packed, 2, timeout_s=300)
    print("\n" + check_parity(got, packed.gpt_reference(), "megatron backend tp2+sp, packed rows"))


def routing_statistics(rank, world_size):
    """``expert_routing`` (busiest expert over the mean, worst layer; dropped fraction) after 2 steps of
    each backend at ep2 with recomputation, from the same weights."""
    out = {}
    with megatron_on_cpu():
        for backend in ("native", "megatron"):
            blocks = {"llm": module("gpt", replace(moe.CONFIG, backend=backend), {"dp": 2, "ep": 2},
                                    OptimizerConfig(lr=moe.LR), ParallelOptions(activation_checkpointing=True))}
            runtime = build_runtime(experiment(world_size, blocks, global_batch=moe.GLOBAL_BATCH,
                                               microbatches=moe.MICROBATCHES, seed=moe.SEED))
            for batch in moe.batches()[:2]:
                runtime.train_step(batch)
            out[backend] = expert_routing(runtime)
    return out


def test_the_megatron_routers_count_the_load_the_native_layers_count():
    """Each training forward counted once (megatron-core recomputes a layer inside the backward, torch's
    checkpoint around the native one), under the layer's global index."""
    for got in run_ranks(routing_statistics, 2, timeout_s=300):
        native, megatron = got["native"], got["megatron"]
        assert native.keys() == megatron.keys() and native["expert_load.llm"] > 1, got
        for key, value in native.items():
            assert abs(megatron[key] - value) <= 1e-6 * max(abs(value), 1), (key, got)


def resumed(rank, world_size, config, saved_as, resumed_as, directory):
    """3 steps under ``saved_as`` (backend, layout, options), a checkpoint (``Checkpointer``: weights and
    AdamW state through DCP), 2 more steps; then a fresh runtime under ``resumed_as`` loads the checkpoint
    and takes the same 2 steps. Both runs' losses of steps 4 and 5."""
    data = batches(config, steps=5)

    def runtime(backend, layout, options=ParallelOptions()):
        blocks = {"llm": module("gpt", replace(config, backend=backend), layout, OptimizerConfig(lr=LR), options)}
        setup = experiment(world_size, blocks, global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES, seed=SEED)
        return setup, build_runtime(setup)

    with megatron_on_cpu():
        setup, first = runtime(*saved_as)
        saver = Checkpointer(CheckpointConfig(every=1), Path(directory), run_identity(setup, first.graph))
        for batch in data[:3]:
            first.train_step(batch)
        saver.save(first, 3)
        saver.close()
        straight = [first.train_step(batch)["loss"] for batch in data[3:]]
        _, second = runtime(*resumed_as)
        assert saver.load(second, Path(directory) / "step_000003", same_local=False) == 3
        return straight, [second.train_step(batch)["loss"] for batch in data[3:]]


@pytest.mark.parametrize("config,saved_as,resumed_as", [
    (CONFIG, ("megatron", {"tp": 2}), ("native", {"tp": 2})),
    (CONFIG, ("native", {"dp": 2}), ("megatron", {"tp": 2})),
    (CONFIG, ("megatron", {"pp": 2}), ("megatron", {"tp": 2})),
    (moe.CONFIG, ("native", {"dp": 2, "ep": 2}), ("megatron", {"tp": 2}, SP)),
    (moe.CONFIG, ("megatron", {"tp": 2}, SP), ("native", {"dp": 2, "ep": 2})),
], ids=["megatron tp2 -> native tp2", "native dp2 -> megatron tp2", "megatron pp2 -> megatron tp2",
        "experts: native ep2 -> megatron tp2+sp", "experts: megatron tp2+sp -> native ep2"])
def test_a_checkpoint_moves_between_backends_and_layouts(tmp_path, config, saved_as, resumed_as):
    """Checkpoints keep the native names and placements, so the weights and AdamW moments reload in
    either backend under any layout: the resumed run's next losses are the uninterrupted run's."""
    for straight, again in run_ranks(resumed, 2, config, saved_as, resumed_as, tmp_path, timeout_s=300):
        assert all(abs(a - b) / b < 1e-5 for a, b in zip(again, straight)), (again, straight)


HF_CASES = {  # test_hf_import's checkpoints
    "qwen2: biases on q, k, v, yarn scaling": hf_import.CASES[hf_import.QWEN2],
    "llama 3: GQA, llama3 scaling, tied embeddings": hf_import.CASES[hf_import.LLAMA],
    "qwen3: q/k norms, head_dim 16, tied embeddings": hf_import.CASES[hf_import.QWEN3],
}


def imported(rank, world_size, source, tokens, out, layout=None):
    """``llm.init.hf`` into the megatron backend at ``layout`` (tp2): its logits on ``tokens`` (every rank,
    whole vocabulary) and, untrained, ``export_hf`` to ``out``."""
    block = module("gpt", {"seq_len": tokens.shape[1], "backend": "megatron"}, layout or {"tp": 2},
                   init={"hf": str(source)})
    with megatron_on_cpu():
        runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=len(tokens), microbatches=1))
        model = runtime.modules["llm"].model
        with torch.no_grad():
            logits = model.whole_vocabulary(model.eval()(tokens))
        export_hf(runtime, "llm", out)
    return logits


@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_hugging_face_checkpoint_imports_into_the_megatron_backend_and_exports_bit_for_bit(tmp_path, case):
    reference = hf_import.saved(tmp_path / "source", *HF_CASES[case], shard=True)
    tokens = torch.randint(0, hf_import.SIZES["vocab_size"], (4, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(tokens).logits
    for logits in run_ranks(imported, 2, tmp_path / "source", tokens, tmp_path / "out", timeout_s=300):
        error = ((logits - expected).abs().max() / expected.abs().max()).item()
        print(f"\n{case}: logits relative error {error:.1e}")
        assert error < 1e-5
    source, exported = HFCheckpoint(tmp_path / "source"), HFCheckpoint(tmp_path / "out")
    assert exported.config == source.config and sorted(exported.names()) == sorted(source.names())
    for name in source.names():
        assert torch.equal(exported.tensor(name), source.tensor(name)), name


@pytest.mark.parametrize("case", ["qwen3-moe renormalized", "mixtral"])
def test_a_hugging_face_moe_imports_into_megatron_experts_at_ep2_and_exports_bit_for_bit(tmp_path, case):
    import test_moe_import as moe_import

    reference = moe_import.saved(tmp_path / "source", case)
    tokens = torch.randint(0, moe_import.SIZES["vocab_size"], (4, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(tokens).logits
    for logits in run_ranks(imported, 2, tmp_path / "source", tokens, tmp_path / "out", {"dp": 2, "ep": 2},
                            timeout_s=300):
        error = ((logits - expected).abs().max() / expected.abs().max()).item()
        print(f"\n{case} at ep2: logits relative error {error:.1e}")
        assert error < 1e-5
    source, exported = HFCheckpoint(tmp_path / "source"), HFCheckpoint(tmp_path / "out")
    assert exported.config == source.config and sorted(exported.names()) == sorted(source.names())
    for name in source.names():
        assert torch.equal(exported.tensor(name), source.tensor(name)), name


def imported_loss(rank, world_size, source, batch, layout, parallel):
    """``llm.init.hf`` into the megatron backend at ``layout``: its loss on ``batch``, the bytes this rank read,
    and on the last stage's ranks its logits (whole vocabulary; None elsewhere)."""
    from test_hf_import import stage_logits

    block = module("gpt", {"seq_len": batch["tokens"].shape[1], "backend": "megatron"}, layout, parallel=parallel,
                   init={"hf": str(source)})
    with megatron_on_cpu():
        runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=len(batch["tokens"]),
                                           microbatches=2 if layout.get("pp", 1) > 1 else 1))
        llm = runtime.modules["llm"]
        loss = runtime.evaluate([batch])["llm.loss"]
        staged = stage_logits(llm, batch["tokens"])
        logits = llm.model.whole_vocabulary(staged[1]) if staged is not None else None
        return loss, llm.pretrained_bytes, logits


@pytest.mark.parametrize("case,layout,parallel", [
    ("qwen3-moe renormalized", {"ep": 2, "tp": 2, "dp": 2}, {"sequence_parallel": True}),
    ("mixtral", {"ep": 2, "pp": 2, "dp": 2}, None),
], ids=["qwen3-moe ep2·tp2+sp", "mixtral ep2·pp2"])
def test_a_hugging_face_moe_imports_into_megatron_under_tp_and_pp_with_transformers_logits(tmp_path, case, layout,
                                                                                            parallel):
    """Every rank's loss equals transformers' on the same rows, so do the last stage's ranks' logits, and each
    rank reads less than the whole checkpoint (its TP shards or its stage's layers, and its EP group's experts)."""
    import test_moe_import as moe_import

    reference = moe_import.saved(tmp_path, case)
    tokens = torch.randint(0, moe_import.SIZES["vocab_size"], (4, 40), generator=torch.Generator().manual_seed(2))
    labels = torch.cat([tokens[:, 1:], torch.full((4, 1), -100)], dim=1)
    with torch.no_grad():
        logits = reference(tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    results = run_ranks(imported_loss, 4, tmp_path, {"tokens": tokens, "labels": labels}, layout, parallel,
                        timeout_s=300)
    whole = sum(t.numel() * t.element_size() for _, t in HFCheckpoint(tmp_path).tensors(HFCheckpoint(tmp_path).names()))
    errors = [((got - logits).abs().max() / logits.abs().max()).item() for *_, got in results if got is not None]
    print(f"\n{case} {layout} on megatron: loss rel. errors "
          + ", ".join(f"{abs(loss - expected) / expected:.1e}" for loss, *_ in results)
          + f"; logits rel. errors {', '.join(f'{e:.1e}' for e in errors)}"
          + f"; bytes read per rank {[read for _, read, _ in results]} of {whole}")
    assert all(abs(loss - expected) / expected < 1e-5 for loss, *_ in results), (results, expected)
    assert len(errors) == 4 // layout.get("pp", 1) and max(errors) < 1e-5
    assert all(0 < read < whole for _, read, _ in results)


@pytest.mark.parametrize("config", [replace(MEGATRON, qkv_bias=True, qk_norm=True), replace(moe.CONFIG, backend="megatron")],
                         ids=["q/k/v biases and norms", "shared and routed experts"])
def test_the_name_map_round_trips_every_weight_of_every_shard(config):
    """Native -> megatron-core shards (tp 2 × ep 2, each stage of pp 2) -> native gives back every tensor,
    bit for bit."""
    native = GPT(config).state_dict()
    for layers, top in ((range(0, 2), "tok_embeddings.weight"), (range(2, 4), "output.weight")):
        by_ep = []  # each EP rank's tensors, its TP ranks' parts put together
        for ep in range(2):
            shards = [megatron_shards(native, config, layers, 2, tp, 2, ep) for tp in range(2)]
            held = {name: [shard[name] for shard in shards] for name in shards[0]}
            by_ep.append(native_tensors({name: parts[0] for name, parts in held.items()}, config, layers,
                                        lambda value, held=held: next(p for p in held.values() if p[0] is value)))
        back = {name: torch.cat([part[name] for part in by_ep]) if is_expert(name) else value
                for name, value in by_ep[0].items()}
        want = {name for name in native if name.startswith(tuple(f"layers.{i}." for i in layers))}
        assert want | {top} <= set(back)
        for name, value in back.items():
            assert torch.equal(value, native[name]), name


def test_the_megatron_backend_refuses_what_it_does_not_run():
    def errors(model=None, layout=None, parallel=None, **top):
        blocks = {"llm": module("gpt", replace(MEGATRON, **(model or {})), layout or {"tp": 2},
                                OptimizerConfig(), ParallelOptions(**(parallel or {})))}
        with pytest.raises(ConfigError) as caught:
            build_graph(experiment(2, blocks, global_batch=4, microbatches=1, **top))
        return str(caught.value)

    assert "does not run context parallelism (llm.layout.cp=2)" in errors(layout={"cp": 2})
    experts = {"num_experts": 4, "top_k": 2}
    assert "runs experts dropless only (llm.model.capacity_factor=1.25)" in errors(model=experts | {"capacity_factor": 1.25},
                                                                                  parallel={"sequence_parallel": True})
    assert "set llm.model.normalize_gates=true" in errors(model=experts | {"gate": "sigmoid"}, parallel={"sequence_parallel": True})
    assert "needs llm.parallel.sequence_parallel=true" in errors(model=experts)
    assert "does not shard with FSDP2" in errors(layout={"dp": 2}, parallel={"fsdp": True})
    assert "is not one of native, megatron" in errors(model={"backend": "te"})
    assert isinstance(GPTConfig().backend, str)
