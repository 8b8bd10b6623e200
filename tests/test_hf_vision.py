"""Hugging Face vision towers imported into hetero's ViT (``hetero/models/vit/hf.py``): tiny random SigLIP
and CLIP models built offline with ``transformers`` (vision models, and the vision half of full
SiglipModel / CLIPModel checkpoints), every weight perturbed (norms off 1, biases off 0), saved with
``save_pretrained``, imported, and run on the same images: per-patch features equal to transformers'
within 1e-5 in fp32, whole and under tp2, dp2 + FSDP, tp2·dp2 (each rank reading only what it
holds), tp2·pp2. An untrained import exports bit for bit. Configs and checkpoints hetero does not model
are refused by name. (The tower takes no cp: its sequence is short; the config check refuses it.)"""

import json

import pytest
import torch
import transformers

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.models import default_registry
from hetero.models.vit.hf import check_weights, load_vit, passed_over, vit_config
from hetero.models.vit.model import VisionEncoder

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_channels=1,
              image_size=32, patch_size=8)
TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, vocab_size=50,
            bos_token_id=0, eos_token_id=1, pad_token_id=1)
CASES = {  # name: (config class, model class, text tower?, feature_layer)
    "siglip vision, last layer (post_layernorm)": ("SiglipVisionConfig", "SiglipVisionModel", False, -1),
    "siglip vision, layer -2 (LLaVA-style)": ("SiglipVisionConfig", "SiglipVisionModel", False, -2),
    "clip vision, layer -2 (LLaVA-style)": ("CLIPVisionConfig", "CLIPVisionModel", False, -2),
    "clip vision, last layer": ("CLIPVisionConfig", "CLIPVisionModel", False, -1),
    "siglip with its text tower": ("SiglipConfig", "SiglipModel", True, -1),
    "clip with its text tower": ("CLIPConfig", "CLIPModel", True, -2),
}


def saved(path, case: str):
    config_class, model_class, with_text, _ = CASES[case]
    torch.manual_seed(0)
    fields = dict(vision_config=VISION, text_config=TEXT) if with_text else VISION
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(path)
    return model.vision_model if with_text else model


def expected_features(reference, case: str, images: torch.Tensor) -> torch.Tensor:
    """What a LLaVA-style VLM takes from the tower: ``last_hidden_state`` for SigLIP's last layer (after
    its post_layernorm), else the hidden states after block ``feature_layer``; CLIP's class token dropped."""
    *_, feature_layer = CASES[case]
    with torch.no_grad():
        out = reference(pixel_values=images, output_hidden_states=True)
    if "siglip" in case and feature_layer == -1:
        return out.last_hidden_state
    return out.hidden_states[feature_layer][:, 1 if "clip" in case else 0:]


def images(rows: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.rand(rows, 1, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_an_imported_tower_gives_transformers_features(tmp_path, case):
    reference = saved(tmp_path, case)
    checkpoint = HFCheckpoint(tmp_path)
    config = vit_config(checkpoint.config, {"feature_layer": CASES[case][3]})
    check_weights(checkpoint, config)
    model = VisionEncoder(config)
    load_vit(model, tmp_path)
    x = images()
    expected = expected_features(reference, case, x)
    with torch.no_grad():
        got = model.eval()(x)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"\n{case}: features relative error {error:.1e}")
    assert got.shape == expected.shape == (3, config.num_patches, 32)
    assert error < 1e-5


def loaded_under(rank, world_size, path, layout, fsdp, feature_layer, out):
    """The tower imported as the runtime imports ``init.hf`` (built on meta, parallelized, allocated, read),
    run on this rank's rows (the features on the last stage, None elsewhere); an untrained export written
    from this layout."""
    import torch.distributed as dist

    from hetero.interop.hf_export import export_hf
    from hetero.testing.kinds import build_runtime
    from hetero.testing.experiments import experiment, module

    vision = module("vit", {"feature_layer": feature_layer}, layout, init={"hf": str(path)},
                    parallel={"fsdp": fsdp})
    llm = module("gpt", {"vocab_size": 64, "hidden_size": 32, "num_layers": 1, "num_heads": 4, "seq_len": 24},
                 {"dp": world_size})
    config = experiment(world_size, {"vision": vision, "llm": llm}, edges=[("vision", "llm")], global_batch=4,
                        microbatches=1)
    runtime = build_runtime(config)
    state = runtime.modules["vision"]
    mesh = state.mesh
    rows = torch.arange(4).tensor_split(mesh.layout.dp)[mesh.coord.dp]
    with torch.no_grad():  # each stage in turn, hidden states handed to the next stage's rank of this TP coordinate
        x = images(4)[rows].to(state.device)
        if not mesh.is_first_stage:
            x = torch.empty(len(rows), state.node.config.seq_len, 32)
            dist.recv(x, mesh.layout.rank_at(mesh.coord._replace(pp=mesh.coord.pp - 1)))
        features = state.model(x)
        if not mesh.is_last_stage:
            dist.send(features.contiguous(), mesh.layout.rank_at(mesh.coord._replace(pp=mesh.coord.pp + 1)))
            features = None
    export_hf(runtime, "vision", out)
    return rows, features, state.pretrained_bytes, mesh.coord.pp


@pytest.mark.parametrize("case,layout,fsdp,share", [
    ("siglip vision, last layer (post_layernorm)", {"tp": 2, "dp": 1}, False, (0.5, 0.6)),
    ("clip vision, layer -2 (LLaVA-style)", {"dp": 2}, True, (0.45, 0.55)),
    ("siglip with its text tower", {"tp": 2, "dp": 2}, False, (0.5, 0.6)),
    ("clip vision, last layer", {"tp": 2, "pp": 2, "dp": 1}, False, [(0.35, 0.45), (0.1, 0.2)]),
], ids=["siglip tp2", "clip dp2+fsdp", "siglip+text tp2·dp2", "clip tp2·pp2"])
def test_an_imported_tower_under_a_layout_gives_transformers_features_and_exports_bit_for_bit(
        tmp_path, case, layout, fsdp, share):
    """Every rank's features equal transformers' on its rows. ``share``: the bounds of a rank's part of
    the bytes of the tower's weights it uses (TP splits all but the norms, biases of the output
    projections and the embeddings; FSDP shards every weight over dp; per stage under PP: the first of
    pp2 holds two of the three blocks and the embeddings). The export holds the source's
    vision tensors bit for bit (those passed over copied back) and its tower's config."""
    from hetero.testing.multiprocess import run_ranks

    source = tmp_path / "source"
    reference = saved(source, case)
    feature_layer = CASES[case][3]
    expected = expected_features(reference, case, images(4))
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout["dp"]
    results = run_ranks(loaded_under, world, source, layout, fsdp, feature_layer, tmp_path / "out", timeout_s=240)
    checkpoint = HFCheckpoint(source)
    config = vit_config(checkpoint.config, {"feature_layer": feature_layer})
    prefix = "vision_model." if CASES[case][2] else ""
    used = [n for n in checkpoint.names() if n.startswith(prefix) and not passed_over(n[len(prefix):], config)]
    total = sum(t.numel() * t.element_size() for _, t in checkpoint.tensors(used))
    errors = []
    for rows, features, read, stage in results:
        if features is not None:
            errors.append(((features - expected[rows]).abs().max() / expected.abs().max()).item())
        low, high = share[stage] if isinstance(share, list) else share
        assert low <= read / total <= high, (stage, read / total)
    assert len(errors) == world // layout.get("pp", 1)  # every last-stage rank
    print(f"\n{case} {layout} fsdp={fsdp}: features rel. errors " + ", ".join(f"{e:.1e}" for e in errors)
          + "; bytes read per rank / the tower's " + ", ".join(f"{r[2] / total:.2f}" for r in results))
    assert all(error < 1e-5 for error in errors), errors
    exported = HFCheckpoint(tmp_path / "out")
    vision = checkpoint.config["vision_config"] if prefix else checkpoint.config
    architecture = CASES[case][1].removesuffix("VisionModel").removesuffix("Model") + "VisionModel"
    assert exported.config == vision | {"architectures": [architecture]}
    originals = [n for n in checkpoint.names() if n.startswith(prefix)]
    assert sorted(exported.names()) == sorted(n[len(prefix):] for n in originals)
    for name in originals:
        a, b = checkpoint.tensor(name), exported.tensor(name[len(prefix):])
        assert a.dtype == b.dtype and torch.equal(a, b), name
    reloaded = getattr(transformers, exported.config["architectures"][0]).from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(expected_features(reloaded, case, images(4)), expected, rtol=0, atol=0)


def vision_config(**changes):
    return {"architectures": ["SiglipVisionModel"], "model_type": "siglip_vision_model", **VISION,
            "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6} | changes


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["Dinov2Model"]}, r"architectures=\['Dinov2Model'\] is not one hetero imports as a vision tower"),
    ({"hidden_act": "relu"}, r"hidden_act='relu' is not modelled; hetero models gelu, gelu_pytorch_tanh, quick_gelu"),
    ({"attention_dropout": 0.1}, r"attention_dropout=0\.1 is not modelled"),
    ({"num_register_tokens": 4}, r"hetero does not model the vision field\(s\) num_register_tokens"),
])
def test_a_tower_config_hetero_does_not_model_is_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        vit_config(vision_config(**changes), {})
    json.dumps(vision_config(**changes))


def test_init_hf_refuses_model_fields_and_checkpoints_that_do_not_fit(tmp_path):
    """Only feature_layer comes from the YAML (other fields may restate the checkpoint's); a weight with no place, a missing one, and a tensor whose
    shape disagrees with config.json are refused before any process group exists."""
    from safetensors.torch import load_file, save_file

    from hetero.testing.experiments import experiment, module

    saved(tmp_path, "clip vision, layer -2 (LLaVA-style)")

    def config_with(model=None, tensors=None, **config_changes):
        if tensors is not None:
            save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
        if config_changes:
            path = tmp_path / "config.json"
            path.write_text(json.dumps(json.loads(path.read_text()) | config_changes))
        block = module("vit", model or {"feature_layer": -2}, {"dp": 1}, init={"hf": str(tmp_path)})
        return experiment(1, {"vision": block}, global_batch=2, microbatches=1).model_config("vision", default_registry())

    config = config_with()
    assert (config.class_token, config.pre_norm, config.patch_bias, config.activation, config.used_layers) == (
        True, True, False, "quick_gelu", 2)
    with pytest.raises(ConfigError, match=r"vision\.init\.hf gives vision's sizes, and vision\.model disagrees "
                                          r"with its config\.json on 1 field: vision\.model\.projector=True "
                                          r"\(config\.json: False\); remove it or set it to config\.json's value"):
        config_with({"projector": True})
    assert config_with({"feature_layer": -2, "hidden_size": 32, "class_token": True}) == config
    weights = load_file(tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"weights encoder\.layers\.0\.self_attn\.rotary\.weight have no place"):
        config_with(tensors=weights | {"encoder.layers.0.self_attn.rotary.weight": torch.zeros(4)})
    with pytest.raises(ConfigError, match=r"lacks weights encoder\.layers\.1\.mlp\.fc2\.bias"):
        config_with(tensors={k: v for k, v in weights.items() if k != "encoder.layers.1.mlp.fc2.bias"})
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"embeddings\.position_embedding\.weight has shape \(17, 32\), but its "
                                          r"config\.json gives \(5, 32\)"):
        config_with(image_size=16)
