"""Every invalid configuration fails before any process starts, with a message naming field and fix.

Each case writes a real YAML file (or overrides a shipped experiment) and composes it through Hydra.
"""

import copy

import pytest
import yaml

from hetero.config import experiment_from_dict, load_experiment
from hetero.testing.kinds import build_graph
from hetero.errors import ConfigError
from hetero.parallel.mesh import init_distributed

VALID = {
    "name": "case",
    "world_size": 4,
    "batch": {"global_batch_size": 16, "micro_batch_size": 2},
    "vision": {
        "kind": "vit",
        "model": {"image_size": 32, "patch_size": 4, "hidden_size": 64, "num_heads": 4, "num_layers": 2},
        "layout": {"tp": 1, "dp": 4},
        "micro_batch_size": 1,
    },
    "llm": {
        "kind": "gpt",
        "model": {"vocab_size": 256, "hidden_size": 64, "num_heads": 4, "num_layers": 2, "seq_len": 64},
        "layout": {"tp": 2, "dp": 2},
    },
    "edges": [{"src": "vision", "dst": "llm"}],
}


def compose(tmp_path, change=None, overrides=()):
    raw = copy.deepcopy(VALID)
    if change:
        change(raw)
    path = tmp_path / "case.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    experiment = load_experiment(str(path), list(overrides))
    return experiment, build_graph(experiment).placement


def test_valid_base_config_passes(tmp_path):
    _, placement = compose(tmp_path)
    assert placement.mode == "colocated"


def setter(path, value):
    def change(raw):
        node = raw
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value

    return change


def both(*changes):
    def change(raw):
        for c in changes:
            c(raw)

    return change


NON_COLOCATED = both(
    setter("world_size", 6),
    setter("placement", "non_colocated"),
    setter("vision.layout", {"dp": 2, "offset": 0}),
    setter("llm.layout", {"tp": 2, "dp": 2, "offset": 2}),
)

CASES = {
    "degrees product != explicit rank count": (
        setter("llm.layout", {"tp": 2, "dp": 2, "ranks": [0, 1, 2]}),
        r"llm\.layout: tp\*cp\*dp\*pp = 2\*1\*2\*1 = 4 but the layout has 3 ranks \(0-2\)",
    ),
    "degrees product != size": (
        setter("llm.layout", {"tp": 2, "dp": 1, "size": 4}),
        r"llm\.layout: tp\*cp\*dp\*pp = 2\*1\*1\*1 = 2 but the layout has 4 ranks .*llm\.layout\.dp=2",
    ),
    "rank out of range": (
        setter("llm.layout", {"tp": 2, "ranks": [2, 3, 4, 5]}),
        r"llm\.layout: ranks 4-5 are outside the world of 4 ranks \(0-3\)",
    ),
    "rank listed twice": (
        setter("llm.layout", {"tp": 2, "ranks": [0, 1, 1, 2]}),
        r"llm\.layout\.ranks lists ranks \[1\] more than once",
    ),
    "overlap in a non-colocated placement": (
        both(NON_COLOCATED, setter("llm.layout.offset", 1), setter("world_size", 5)),
        r"placement=non_colocated but vision \(ranks 0-1\) and llm \(ranks 1-4\) share ranks 1; "
        r"give them disjoint ranks",
    ),
    "colocated modules on different ranks": (
        both(setter("placement", "colocated"), setter("vision.layout", {"dp": 2})),
        r"placement=colocated but vision runs on ranks 0-1 and llm on ranks 0-3",
    ),
    "ranks no module covers": (
        setter("world_size", 6),
        r"world_size=6 but ranks 4-5 run no module; .* or set world_size=4",
    ),
    "an odd head width": (
        setter("llm.model.head_dim", 15),
        r"llm\.model: each head is 15 wide .* but rotary embeddings turn pairs of channels; make it even",
    ),
    "an unknown gpt backend": (
        setter("llm.model.backend", "te"),
        r"llm\.model\.backend='te' is not one of native, megatron",
    ),
    "heads not divisible by tp": (
        both(setter("llm.layout", {"tp": 4, "dp": 1}), setter("llm.model.num_heads", 2),
             setter("llm.model.hidden_size", 64)),
        r"llm\.layout\.tp=4 does not divide llm\.model\.num_heads=2; choose tp from 1, 2",
    ),
    "ffn size not divisible by tp": (
        both(setter("llm.layout", {"tp": 4, "dp": 1}), setter("llm.model.ffn_hidden_size", 90)),
        r"llm\.layout\.tp=4 does not divide llm\.model\.ffn_hidden_size=90; choose tp from 1, 2, 3, 5",
    ),
    "vocabulary not divisible by tp": (
        both(setter("llm.layout", {"tp": 4, "dp": 1}), setter("llm.model.vocab_size", 250)),
        r"llm\.layout\.tp=4 does not divide llm\.model\.vocab_size=250",
    ),
    "sequence not divisible by 2*cp": (
        both(setter("llm.layout", {"cp": 2, "dp": 2}), setter("llm.model.seq_len", 66)),
        r"llm\.layout\.cp=2: sequence length 66 is not divisible by 2\*cp=4",
    ),
    "global batch not divisible by dp*micro batch": (
        setter("batch.global_batch_size", 10),
        r"batch\.global_batch_size=10 is not divisible by vision's dp\*micro_batch_size = 4\*1 = 4",
    ),
    "modules disagree on the microbatch count": (
        setter("vision.micro_batch_size", 2),
        r"modules split the global batch into different numbers of microbatches \(vision: 16/\(4\*2\) = 2, "
        r"llm: 16/\(2\*2\) = 4\)",
    ),
    "unknown wandb mode": (
        setter("train", {"wandb": "online"}),
        r"train\.wandb='online' is not one of offline, disabled",
    ),
    "more pipeline stages than layers": (
        setter("llm.layout", {"pp": 4}),
        r"llm\.layout\.pp=4 is larger than llm\.model\.num_layers=2; .*use pp <= 2",
    ),
    "edge naming an unknown module": (
        setter("edges", [{"src": "vision", "dst": "lm"}]),
        r"edges\[0\]\.dst='lm' names no module; modules are vision, llm",
    ),
    "unknown module kind": (
        setter("llm.kind", "mamba"),
        r"llm\.kind='mamba' is not a known module kind; use one of gpt, vit",
    ),
    "dp cannot be inferred": (
        both(setter("world_size", None), setter("vision.layout", {"tp": 1, "dp": 4}),
             setter("llm.layout", {"tp": 3, "size": 4})),
        r"llm\.layout: tp\*cp\*pp = 3\*1\*1 = 3 does not divide the 4 ranks",
    ),
    "degree below one": (
        setter("llm.layout", {"tp": 0}),
        r"llm\.layout\.tp=0 must be >= 1",
    ),
    "misspelled model field": (
        setter("llm.model.num_head", 4),
        r"llm\.model\.num_head: Key 'num_head' not in 'GPTConfig'",
    ),
    "wrong type in a layout": (
        setter("llm.layout.tp", "two"),
        r"llm\.layout\.tp: Value 'two' of type 'str' could not be converted to Integer",
    ),
    "unknown pipeline schedule": (
        setter("llm.parallel", {"pipeline_schedule": "zero_bubble"}),
        r"llm\.parallel\.pipeline_schedule='zero_bubble' is not one of gpipe, 1f1b",
    ),
    "unknown CP attention method": (
        setter("llm.parallel", {"cp_attention": "ulysses"}),
        r"llm\.parallel\.cp_attention='ulysses' is not one of ring, allgather",
    ),
    "sequence parallel split does not divide": (
        both(setter("llm.parallel", {"sequence_parallel": True}), setter("llm.model.seq_len", 65)),
        r"llm\.parallel\.sequence_parallel: the 65 tokens each CP rank holds do not split over tp=2",
    ),
    "fsdp with tensor parallelism": (
        setter("llm.parallel", {"fsdp": True}),
        r"llm\.parallel\.fsdp=true shards over dp×cp only and runs with tp=1 and pp=1 \(got tp=2, pp=1\)",
    ),
    "tied embeddings across pipeline stages": (
        both(setter("llm.layout", {"pp": 2, "dp": 2}), setter("llm.model.tie_embeddings", True)),
        r"llm\.model\.tie_embeddings=true needs the embedding and the output layer on one pipeline stage",
    ),
    "unknown compression method": (
        setter("vision.compression", {"grad": {"method": "int2"}}),
        r"vision\.compression\.grad\.method='int2' is not one of none, topk, shared_topk, randomk, int8, int4, powersgd",
    ),
    "top-k ratio out of range": (
        setter("vision.compression", {"grad": {"method": "topk", "ratio": 1.5}}),
        r"vision\.compression\.grad\.ratio=1\.5 must be in \(0, 1\]",
    ),
    "DiLoCo together with a compressed per-step sync": (
        setter("vision.compression", {"grad": {"method": "int8"}, "diloco": {"inner_steps": 8}}),
        r"vision\.compression: diloco replaces the per-step gradient sync; set grad\.method=none",
    ),
    "DiLoCo fragments that do not divide the inner steps": (
        setter("vision.compression", {"diloco": {"inner_steps": 10, "fragments": 3}}),
        r"vision\.compression\.diloco\.fragments=3 must be at least 1 and divide inner_steps=10",
    ),
    "a union of indices for a method without shared indices": (
        setter("vision.compression", {"grad": {"method": "topk", "indices": "union"}}),
        r"vision\.compression\.grad\.indices=union chooses shared_topk's entries; set "
        r"vision\.compression\.grad\.method=shared_topk or indices=turn",
    ),
    "a DiLoCo overlap as long as the round": (
        setter("vision.compression", {"diloco": {"inner_steps": 8, "fragments": 2, "overlap_steps": 4}}),
        r"vision\.compression\.diloco\.overlap_steps=4 must be in 0\.\.3 \(a round lands before the next starts",
    ),
    "a mixing weight without the mix merge": (
        setter("vision.compression", {"diloco": {"inner_steps": 8, "overlap_steps": 2, "overlap_alpha": 0.5}}),
        r"vision\.compression\.diloco\.overlap_alpha=0\.5 weighs the local weights of overlap_merge=mix",
    ),
    "a simulated link with latency and no bandwidth": (
        setter("vision.parallel", {"simulated_link": {"latency_ms": 5}}),
        r"vision\.parallel\.simulated_link\.latency_ms=5\.0 needs a bandwidth: set vision\.parallel\.simulated_link\.gbit_s > 0",
    ),
    "a decayed error feedback on pseudo-gradients that keep none": (
        setter("vision.compression", {"diloco": {"inner_steps": 8, "error_decay": 0.9,
                                                 "pseudo_grad": {"method": "int4"}}}),
        r"vision\.compression\.diloco\.error_decay=0\.9 decays the error-feedback residual, which "
        r"vision\.compression\.diloco\.pseudo_grad \(method=int4\) does not keep",
    ),
    "quantized values of a method other than top-k": (
        setter("vision.compression", {"grad": {"method": "randomk", "value_bits": 4}}),
        r"vision\.compression\.grad\.value_bits=4 quantizes the values of topk and shared_topk; set "
        r"vision\.compression\.grad\.method=topk or shared_topk, or value_bits=32",
    ),
    "DiLoCo with context parallelism": (
        both(setter("llm.layout", {"cp": 2, "dp": 2}), setter("llm.compression", {"diloco": {"inner_steps": 8}})),
        r"llm\.compression\.diloco needs cp=1 .* got llm\.layout\.cp=2",
    ),
    "compression with FSDP": (
        both(setter("vision.parallel", {"fsdp": True}), setter("vision.compression", {"grad": {"method": "int4"}})),
        r"vision\.parallel\.fsdp=true reduce-scatters gradients itself; compression needs the DP gradient sync",
    ),
    "misspelled compression field": (
        setter("vision.compression", {"grad": {"methods": "int4"}}),
        r"vision\.compression\.grad\.methods: Key 'methods' not in 'CompressorConfig'",
    ),
    "stray top-level key": (
        setter("batchsize", 4),
        r"top-level key 'batchsize' is neither an experiment field",
    ),
    "a class to instantiate in a module": (
        setter("llm.model._target_", "os.system"),
        r"llm\.model\._target_='os\.system': configs cannot name classes to instantiate; a module picks its "
        r"model from the registry of module kinds with kind: \(a built-in kind such as gpt or vit, or one registered",
    ),
    "a class to instantiate at the top level": (
        setter("_target_", "subprocess.Popen"),
        r"_target_='subprocess\.Popen': configs cannot name classes to instantiate",
    ),
    "a kind outside the registry": (
        setter("llm.kind", "os.system"),
        r"llm\.kind='os\.system' is not a known module kind; use one of gpt, vit",
    ),
    "a vision encoder under context parallelism": (
        setter("vision.layout", {"cp": 2, "dp": 2}),
        r"vision: the vision encoder runs with cp=1 \(got cp=2\); its sequence is short: spread it with dp, tp or pp",
    ),
    "a vision pipeline longer than the blocks up to the feature layer": (
        both(setter("vision.layout", {"pp": 2, "dp": 2}), setter("vision.model.feature_layer", 0)),
        r"vision\.layout\.pp=2 is larger than the 1 blocks up to vision\.model\.feature_layer=0; every pipeline "
        r"stage needs one: use pp <= 1",
    ),
    "a vision activation hetero does not model": (
        setter("vision.model.activation", "relu"),
        r"vision\.model\.activation='relu' is not one of gelu, gelu_tanh, quick_gelu",
    ),
    "a projector width on a tower without its projector": (
        both(setter("vision.model.projector", False), setter("vision.model.out_size", 48)),
        r"vision\.model\.out_size=48 is the projector's width, but projector=false hands on the features "
        r"\(hidden_size=64\); set vision\.model\.out_size=64",
    ),
    "unknown non-finite policy": (
        setter("train", {"nonfinite": "ignore"}),
        r"train\.nonfinite='ignore' is not one of skip, stop",
    ),
    "negative checkpoint interval": (
        setter("train", {"checkpoint": {"every": -5}}),
        r"train\.checkpoint\.every=-5 and train\.checkpoint\.keep=2 must be >= 0",
    ),
    "ep that does not divide dp": (
        both(setter("llm.model.num_experts", 4), setter("llm.layout.ep", 4)),
        r"llm\.layout\.ep=4 does not divide llm\.layout\.dp=2: experts are split over ep data-parallel replicas; "
        r"choose ep from 1, 2 or raise dp",
    ),
    "experts whose tokens do not split over tp": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.seq_len", 63), setter("llm.model.num_heads", 4)),
        r"llm: under llm\.layout\.tp=2 each TP rank routes its part of the sequence through the experts, but the 63 "
        r"tokens a CP rank holds do not split over tp=2",
    ),
    "ep that does not divide the experts": (
        both(setter("llm.model.num_experts", 3), setter("llm.model.top_k", 1), setter("llm.layout.ep", 2)),
        r"llm\.layout\.ep=2 does not divide llm\.model\.num_experts=3; choose ep from 1, 3",
    ),
    "ep without experts": (
        setter("llm.layout.ep", 2),
        r"llm\.layout\.ep=2: this gpt module has no experts to split .*; set llm\.model\.num_experts or remove "
        r"llm\.layout\.ep",
    ),
    "ep on a vision encoder": (
        setter("vision.layout.ep", 2),
        r"vision\.layout\.ep=2: this vit module has no experts to split",
    ),
    "top_k above the expert count": (
        both(setter("llm.model.num_experts", 2), setter("llm.model.top_k", 3)),
        r"llm\.model\.top_k=3 must be in 1\.\.llm\.model\.num_experts=2",
    ),
    "an unknown gate": (
        both(setter("llm.model.num_experts", 2), setter("llm.model.gate", "relu")),
        r"llm\.model\.gate='relu' is not one of softmax, sigmoid",
    ),
    "deepseek routing on the megatron backend": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.routed_scale", 2.5),
             setter("llm.model.backend", "megatron")),
        r"llm\.model\.backend=megatron does not run llm\.model\.routed_scale=2\.5 yet",
    ),
    "dense layers out of range": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.dense_layers", [0, 9])),
        r"llm\.model\.dense_layers=\[0, 9\] must name some of the layers 0\.\.\d+, not all",
    ),
    "a shared experts' gate without shared experts": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.shared_expert_gate", True)),
        r"llm\.model\.shared_expert_gate=true gates the shared experts, and llm\.model\.shared_experts=0",
    ),
    "a shared experts' gate on the megatron backend": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.shared_experts", 1),
             setter("llm.model.shared_expert_gate", True), setter("llm.model.backend", "megatron")),
        r"llm\.model\.backend=megatron does not run the shared experts' gate",
    ),
    "the pooled balance loss over pipeline stages": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.balance_pooled", True),
             setter("llm.layout", {"pp": 2, "tp": 2})),
        r"llm\.model\.balance_pooled=true pools every MoE layer of a forward, and llm\.layout\.pp=2 puts them on "
        r"different stages",
    ),
    "the pooled balance loss on the megatron backend": (
        both(setter("llm.model.num_experts", 4), setter("llm.model.balance_pooled", True),
             setter("llm.model.backend", "megatron")),
        r"llm\.model\.backend=megatron does not compute the pooled balance loss",
    ),
    "experts under fsdp and ep": (
        both(setter("llm.model.num_experts", 4), setter("llm.layout", {"dp": 4, "ep": 2}),
             setter("llm.parallel", {"fsdp": True})),
        r"llm\.parallel\.fsdp=true with experts runs at ep=1 and tp=1 \(got ep=2, tp=1\)",
    ),
    "a compressed sync under ep": (
        both(setter("llm.model.num_experts", 4), setter("llm.layout.ep", 2),
             setter("llm.compression", {"grad": {"method": "int8"}})),
        r"llm: compressed gradient syncs and DiLoCo run over dp×cp, while experts under ep=2, tp=2 sum their gradients "
        r"over other ranks; turn llm\.compression\.grad and llm\.compression\.diloco off or set ep=1 and tp=1",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_config_is_rejected(tmp_path, case):
    change, message = CASES[case]
    with pytest.raises(ConfigError, match=message):
        compose(tmp_path, change)


def test_hydra_override_with_bad_type_names_the_key():
    with pytest.raises(ConfigError, match=r"full_key: llm\.layout\.tp"):
        load_experiment("colocated_vlm", ["llm.layout.tp=abc"])


def test_override_makes_tp_not_divide_heads():
    experiment = load_experiment("colocated_vlm", ["llm.layout.tp=4", "llm.layout.dp=1", "llm.model.num_heads=2"])
    with pytest.raises(ConfigError, match=r"llm\.layout\.tp=4 does not divide llm\.model\.num_heads=2"):
        build_graph(experiment).placement


def test_unknown_experiment_lists_the_available_ones():
    with pytest.raises(ConfigError, match=r"experiment 'nope' is not in .*choose one of .*colocated_vlm"):
        load_experiment("nope")


def test_launcher_world_size_must_match_before_any_group(monkeypatch):
    placement = build_graph(load_experiment("non_colocated_vlm")).placement
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"needs world_size=6 ranks but the launcher started 4 .*--nproc_per_node=6"):
        init_distributed(placement)


@pytest.mark.parametrize(
    "override,message",
    [
        ("video.model.memory.budget=0", r"video\.model\.memory\.budget=0 must be > 0"),
        ("video.model.memory.window=9", r"video\.model\.memory\.window=9 exceeds budget=8"),
        ("video.model.memory.policy=lru", r"video\.model\.memory\.policy='lru' is not one of"),
        ("world_size=3 video.layout.tp=3", r"video\.layout\.tp=3 does not divide video\.model\.num_heads=4"),
    ],
)
def test_video_memory_and_layout_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        build_graph(load_experiment("video", override.split())).placement


def test_video_sink_must_leave_room_in_the_budget():
    overrides = ["video.model.memory.policy=sink_window", "video.model.memory.sink=8"]
    with pytest.raises(ConfigError, match=r"video\.model\.memory\.sink=8 fills the whole budget=8"):
        build_graph(load_experiment("video", overrides)).placement


@pytest.mark.parametrize(
    "override,message",
    [
        ("world_size=3 dna.layout.tp=3 dna.layout.dp=1 dna.layout.offset=0 vision.layout.dp=3 llm.layout.tp=1 "
         "llm.layout.dp=3",
         r"dna\.layout\.tp=3 does not divide dna\.model\.num_heads=4"),
        ("dna.model.routing=learned", r"dna\.model\.routing='learned' is not one of dynamic, fixed"),
        ("+dna.model.region_bpt.exon=3", r"dna\.model\.region_bpt names unknown regions \['exon'\]"),
        ("dna.model.region_bpt.coding=1", r"dna\.model\.region_bpt\.coding=1\.0 must be > 1"),
        ("+dna.model.region_channels=0", r"dna\.model\.region_channels=0 and region_gain=0\.05 must be >= 1 and > 0"),
        ("dna.model.min_boundaries=13", r"dna\.model\.min_boundaries=13 exceeds max_boundaries=12"),
        ("dna.model.routing=fixed", r"dna\.model\.routing=fixed places a token every target_bpt"),
        ("dna.model.hidden_size=60 dna.model.out_size=64",
         r"dna\.model: each head is 15 wide \(hidden_size=60 / num_heads=4\), but rotary embeddings turn pairs"),
        ("dna.model.stages=3", r"dna\.model\.stages=3: GeneZip has 1 or 2 chunking stages"),
        ("dna.parallel.sequence_parallel=true", r"dna\.parallel\.sequence_parallel=true: chunking gathers"),
        ("dna.model.out_size=32", r"edges\[1\] \(dna -> llm\): dna hands on width 32 \(dna\.model\.out_size\) but llm\.model\.hidden_size=64; "
                                  r"set dna\.model\.out_size=64"),
    ],
)
def test_genezip_errors_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        build_graph(load_experiment("dna_vlm", override.split())).placement


def test_an_llm_conditioning_a_video_generator_needs_matching_widths():
    raw = {
        "world_size": 2, "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "llm": {"kind": "gpt", "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "seq_len": 32},
                "layout": {"dp": 2}},
        "video": {"kind": "video", "model": {"frame_size": 16, "patch_size": 4, "hidden_size": 32},
                  "layout": {"dp": 2}},
        "edges": [{"src": "llm", "dst": "video"}],
    }
    with pytest.raises(ConfigError, match=r"edges\[0\] \(llm -> video\): llm hands on width 64 \(llm\.model\.hidden_size\) but "
                                          r"video\.model\.condition_size=0; set video\.model\.condition_size=64"):
        build_graph(experiment_from_dict(raw)).placement
    raw["video"]["model"]["condition_size"] = 64
    assert build_graph(experiment_from_dict(raw)).placement.world_size == 2


# ------------------------------------------------------------------------------------ the graph


GRAPH = {
    "world_size": 2, "batch": {"global_batch_size": 4, "micro_batch_size": 1},
    "vision": {"kind": "vit", "model": {"image_size": 16, "patch_size": 8, "hidden_size": 32, "num_heads": 4,
                                        "out_size": 32}, "layout": {"dp": 2}},
    "llm": {"kind": "gpt", "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "seq_len": 16},
            "layout": {"dp": 2}},
    "video": {"kind": "video", "model": {"frame_size": 16, "patch_size": 8, "hidden_size": 32, "condition_size": 32},
              "layout": {"dp": 2}},
    "edges": [{"src": "vision", "dst": "llm"}, {"src": "llm", "dst": "video"}],
}


def graph_with(change):
    raw = copy.deepcopy(GRAPH)
    change(raw)
    return experiment_from_dict(raw)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda raw: raw.update(vision2=copy.deepcopy(raw["vision"]), edges=[*raw["edges"], {"src": "video", "dst": "vision2"}]),
         r"edges\[2\] \(video -> vision2\): video produces nothing another module can take; remove the edge"),
        (lambda raw: raw["edges"].append({"src": "llm", "dst": "llm"}), r"edges\[2\] connects llm to itself"),
        (lambda raw: raw["edges"].pop(1),
         r"video: its input condition takes exactly one edge, got 0; add an edge into it or configure the model "
         r"without it"),
        (lambda raw: raw.update(audio={"kind": "vit", "model": {"image_size": 16, "patch_size": 8, "hidden_size": 32,
                                                                "num_heads": 4, "out_size": 32}, "layout": {"dp": 2}}),
         r"module audio is joined to no other module; add an edge from or to it"),
        (lambda raw: raw["edges"].append({"src": "vision", "dst": "llm", "output": "features"}),
         r"edges\[2\]\.output='features' is not one of vision's outputs: embeddings"),
        (lambda raw: raw["edges"].append({"src": "vision", "dst": "llm"}),
         r"edges\[2\] \(vision -> llm\): the same output already feeds the same input; remove the duplicate"),
        (lambda raw: raw["edges"].append({"src": "vision", "dst": "video"}),
         r"video: its input condition takes exactly one edge, got 2; keep one"),
        (lambda raw: raw["llm"]["model"].update(seq_len=2),
         r"llm's placeholders end at position 4 .* beyond llm\.model\.seq_len=2"),
        (lambda raw: raw.update(schedule="interleaved"), r"schedule='interleaved' is not one of auto, phased, graph_1f1b"),
        (lambda raw: raw.update(schedule="bubble_fill"),
         r"schedule='bubble_fill': bubble filling is what schedule=graph_1f1b does .*; set schedule=graph_1f1b"),
        (lambda raw: raw["vision"].update(layout={"tp": 2}, micro_batch_size=2, parallel={"sequence_parallel": True}),
         r"edges\[0\] \(vision -> llm\): vision's output embeddings is whole on every rank, so vision runs with cp=1 "
         r"and sequence_parallel=false here \(got vision\.layout\.cp=1, vision\.parallel\.sequence_parallel=true\)"),
        (lambda raw: raw.update(llm={**raw["llm"], "layout": {"cp": 2}, "micro_batch_size": 2},
                                edges=[{**raw["edges"][0], "compression": {"forward": {"method": "int8", "block_size": 32},
                                                                           "compensation": "none"}}, raw["edges"][1]]),
         r"edges\[0\] \(vision -> llm\): a compressed edge carries whole sequences; run vision and llm with cp=1 and "
         r"sequence_parallel=false, or turn edges\[0\]\.compression off"),
        (lambda raw: raw.update(vision={**raw["vision"], "model": {**raw["vision"]["model"], "projector": False}},
                                projector={"kind": "projector", "model": {"in_size": 32, "out_size": 32, "tokens": 9},
                                           "layout": {"dp": 2}},
                                edges=[{"src": "vision", "dst": "projector"}, {"src": "projector", "dst": "llm"},
                                       raw["edges"][1]]),
         r"edges\[0\] \(vision -> projector\): vision hands on 4 tokens per row but projector's input features takes "
         r"9; make projector\.model match vision's 4 tokens"),
    ],
    ids=["an edge from a module without outputs", "a self-edge", "a condition nothing feeds", "a module no edge reaches",
         "an unknown output port", "a duplicate edge", "two edges into one condition", "placeholders past the sequence",
         "an unknown schedule", "bubble filling by another name", "an encoder under sequence parallelism at an edge",
         "a compressed edge into a context-parallel LLM", "a projector taking another token count than the tower's"],
)
def test_a_graph_that_cannot_run_is_refused_naming_the_fix(change, message):
    with pytest.raises(ConfigError, match=message):
        build_graph(graph_with(change))


def test_a_cycle_is_named():
    """A GPT fed by a second GPT's hidden states, which the first feeds back: llm -> decoder -> llm."""
    def cycle(raw):
        raw.pop("video")
        raw["decoder"] = copy.deepcopy(raw["llm"])
        raw["edges"] = [{"src": "vision", "dst": "llm"}, {"src": "llm", "dst": "decoder"}, {"src": "decoder", "dst": "llm"}]

    with pytest.raises(ConfigError, match=r"edges form a cycle llm -> decoder -> llm; a module graph must be acyclic"):
        build_graph(graph_with(cycle))


def test_the_dataset_must_hold_what_each_module_reads():
    from hetero.data.splits import check

    experiment = load_experiment("genezip", ["train.data.format=video_clips"])
    with pytest.raises(ConfigError, match=r"^train\.data\.format=video_clips gives the columns clips, revisit, scene, "
                                          r"index but dna \(kind genezip\) reads dna, dna_regions; choose "
                                          r"train\.data\.format=digits_dna or multimodal or genome$"):
        check(experiment, build_graph(experiment))
    with pytest.raises(ConfigError, match=r"^train\.data\.format=imagenet is not a data format; choose one of digits, "
                                          r"digits_dna, multimodal, video_clips, genome, stdlib_text, photo_documents, "
                                          r"llava, webdataset, text \(or register yours"):
        check(load_experiment("genezip", ["train.data.format=imagenet"]), build_graph(experiment))
    vision_alone = graph_with(lambda raw: (raw.pop("llm"), raw.pop("video"), raw.update(edges=[])))
    with pytest.raises(ConfigError, match=r"train\.data\.format=digits sizes its samples by the module that reads tokens; "
                                          r"none of vision does"):
        check(vision_alone, build_graph(vision_alone))


def test_kinds_register_once_and_unknown_ones_are_listed():
    from hetero.models import default_registry
    from hetero.models.gpt.spec import GPTKind

    registry = default_registry()
    with pytest.raises(ConfigError, match=r"cannot register kind GPTKind: 'gpt' is already registered"):
        registry.register(GPTKind())
    with pytest.raises(ConfigError, match=r"llm\.kind='mamba' is not a known module kind; use one of gpt, vit, "
                                          r"projector, genezip, video \(or register yours"):
        build_graph(graph_with(lambda raw: raw["llm"].update(kind="mamba")), registry)
