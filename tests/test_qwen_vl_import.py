"""A whole Qwen2.5-VL checkpoint (``hetero.interop.qwen_vl``): a tiny random one saved offline by transformers
imported into a tower dp2 or tp2 (ranks 0-1) → LLM tp2 (ranks 2-3) graph, both modules naming the same directory.
On rows of text around images of several grids and a video (random patches, the processor's steps are not
built yet), hetero's logits on every LLM rank equal transformers' (1e-5), for Qwen2.5-VL (windows, M-RoPE
in sections) and Qwen3-VL (the learned position grid, interleaved M-RoPE, DeepStack's taps added after
the LLM's first layers, q/k norms), and Qwen3-VL-MoE (its experts fused as transformers 5 writes them, and
transposed as the hub's files, written by transformers 4, hold them)."""

import json

import pytest
import torch
import transformers

from hetero.data.mrope_positions import VisionSpan, mrope_positions
from hetero.interop.parts import open_part
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.qwen_vl import llm_logits

SEQ = 40
# a video's temporal patches 0.25 s apart at the tiny config's 4 tokens per second: a temporal step of 1, where
# transformers 5 and the original rule place the text after it alike (docs/qwen_vl.md)
SECONDS, TOKENS_PER_SECOND = 0.25, 4
IMAGE, VIDEO, START, END = 120, 121, 122, 123
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=32, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=2)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6)
ROWS = [  # per row: text, then per picture (kind, (t, h, w) patches) and text after it
    [("text", 3), ("image", (1, 4, 6)), ("text", 5)],
    [("text", 2), ("image", (1, 2, 2)), ("text", 2), ("video", (2, 4, 4)), ("text", 4)],
]


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
FAMILIES = ["qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "qwen3-vl-moe, hub files"]


def write_qwen_vl(path, family="qwen2.5-vl"):
    torch.manual_seed(0)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    if family == "qwen2.5-vl":
        config = transformers.Qwen2_5_VLConfig(
            vision_config=dict(VISION, window_size=8, fullatt_block_indexes=[1]),
            text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                    "mrope_section": [1, 1, 2]}), **ids)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    else:
        moe = family.startswith("qwen3-vl-moe")
        config = (transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig)(
            vision_config=dict(VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
            text_config=dict(TEXT, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                "mrope_section": [2, 1, 1], "mrope_interleaved": True},
                             **(MOE if moe else {})), **ids)
        model = (transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration)(config)
    with torch.no_grad():  # biases and norms start at 0 and 1: make every weight matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    if family.endswith("hub files"):  # as transformers 4 wrote them: each layer's fused experts transposed
        from safetensors.torch import load_file, save_file

        state = load_file(path / "model.safetensors")
        save_file({name: t.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                   else t for name, t in state.items()}, path / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text()) | {"transformers_version": "4.57.0"}
        (path / "config.json").write_text(json.dumps(config))
    return path


def rows(family):
    """Per row: input ids, token types (0 text, 1 image, 2 video), the images and videos as transformers
    takes them (grid in patches, patches), and hetero's items (first placeholder, grid, patches) and
    M-RoPE spans. A Qwen3-VL video is its frames, each between timestamp tokens and its own item."""
    gen, out = torch.Generator().manual_seed(1), []
    for parts in ROWS:
        row = {"ids": [], "types": [], "image": [], "video": [], "items": [], "spans": []}

        def text(n):
            row["ids"] += torch.randint(0, 100, (n,), generator=gen).tolist()
            row["types"] += [0] * n

        def picture(kind, grid, patches, step):
            t, h, w = grid
            row["ids"].append(START), row["types"].append(0)
            start, tokens = len(row["ids"]), t * h * w // 4
            row["spans"].append(VisionSpan(start, (t, h // 2, w // 2), step))
            row["items"].append((start, grid, patches))
            row["ids"] += [IMAGE if kind == "image" else VIDEO] * tokens
            row["types"] += [1 if kind == "image" else 2] * tokens
            row["ids"].append(END), row["types"].append(0)

        for kind, what in parts:
            if kind == "text":
                text(what)
                continue
            t, h, w = what
            patches = torch.randn(t * h * w, 3 * 2 * 2 * 2, generator=gen)
            row[kind].append((what, patches))
            if kind == "video" and family.startswith("qwen3-vl"):
                for frame in range(t):
                    text(2)  # its timestamp
                    picture(kind, (1, h, w), patches[frame * h * w:(frame + 1) * h * w], 1.0)
            else:
                picture(kind, what, patches, SECONDS * TOKENS_PER_SECOND if kind == "video" else 1.0)
        out.append(row)
    return out


def transformers_logits(path, family):
    classes = {"qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
               "qwen3-vl": transformers.Qwen3VLForConditionalGeneration,
               "qwen3-vl-moe": transformers.Qwen3VLMoeForConditionalGeneration}
    model = classes[family.split(",")[0]].from_pretrained(path, dtype=torch.float32).eval()
    logits = []
    with torch.no_grad():
        for row in rows(family):
            extra = {}
            if row["image"]:
                extra |= {"pixel_values": torch.cat([p for _, p in row["image"]]),
                          "image_grid_thw": torch.tensor([g for g, _ in row["image"]])}
            if row["video"]:
                extra |= {"pixel_values_videos": torch.cat([p for _, p in row["video"]]),
                          "video_grid_thw": torch.tensor([g for g, _ in row["video"]])}
                if family == "qwen2.5-vl":
                    extra["second_per_grid_ts"] = torch.tensor([SECONDS] * len(row["video"]))
            ids, types = torch.tensor(row["ids"]), torch.tensor(row["types"])
            logits.append(model(input_ids=ids[None], mm_token_type_ids=types[None], **extra).logits[0])
    return logits


def hetero_batch(family):
    """The rows padded to SEQ, their items in row order, each with its own patches."""
    tokens = torch.zeros(len(ROWS), SEQ, dtype=torch.long)
    rope, grids, image_row, image_start, patches = [], [], [], [], []
    for r, row in enumerate(rows(family)):
        tokens[r, :len(row["ids"])] = torch.tensor(row["ids"])
        rope.append(mrope_positions(SEQ, row["spans"]))
        for start, grid, item in row["items"]:
            grids.append(grid), image_row.append(r), image_start.append(start), patches.append(item)
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "rope_positions": torch.stack(rope),
            "image_patches": torch.cat(patches), "image_grid": torch.tensor(grids), "image_row": torch.tensor(image_row),
            "image_start": torch.tensor(image_start)}


# the tower split over TP (each rank reading its heads' thirds of the fused qkv) or replicated over DP
TOWER_LAYOUTS = {"qwen2.5-vl": {"tp": 2, "size": 2}, "qwen3-vl": {"dp": 2}, "qwen3-vl-moe, hub files": {"tp": 2, "size": 2}}


def graph(path, family):
    layouts = {"vision": TOWER_LAYOUTS[family], "llm": {"tp": 2, "offset": 2}}
    blocks = {name: module(kind, {}, layouts[name], {"lr": 1e-3, "warmup_steps": 0}, init={"hf": str(path)})
              for name, kind in (("vision", "vit"), ("llm", "gpt"))}
    blocks["vision"]["model"] = {"max_patches": 64}
    blocks["llm"]["model"] = {"seq_len": SEQ}
    return experiment(4, blocks, edges=[("vision", "llm")], global_batch=2, microbatches=1)


def imported_logits(rank, world_size, path, batch, family):
    from hetero.testing.kinds import build_runtime

    logits = llm_logits(build_runtime(graph(path, family)), batch)
    return None if logits is None else logits[1]


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen3-vl-moe"])  # its layout: test_moe_import
def test_a_whole_qwen_vl_imports_under_layouts(tmp_path, family):
    path = write_qwen_vl(tmp_path / family.replace(", ", "-").replace(" ", "-"), family)
    expected = transformers_logits(path, family)
    held = [r for r in run_ranks(imported_logits, 4, path, hetero_batch(family), family, timeout_s=300) if r is not None]
    assert len(held) == 2  # both LLM ranks
    errors = [((ours[r, :len(want)] - want).abs().max() / want.abs().max()).item()
              for ours in held for r, want in enumerate(expected)]
    print(f"\nimported {family} (tower {TOWER_LAYOUTS[family]}): logits rel. errors {', '.join(f'{e:.1e}' for e in errors)}")
    assert max(errors) <= 1e-5


@pytest.mark.parametrize("family", ["qwen3-vl-moe", "qwen3-vl-moe, hub files"])
def test_a_whole_qwen3_vl_moe_exports_bit_for_bit_in_its_files_layout(tmp_path, family):
    """A Qwen3-VL-MoE imported in one process and written back whole (``whole_export``, as ``hetero convert
    --vlm`` writes it): every tensor, the fused experts in the layout the files hold them (transposed in the
    hub's), the tower's q, k and v joined into its fused qkv."""
    from hetero.interop.hf_checkpoint import HFCheckpoint
    from hetero.interop.hf_export import hf_tensors
    from hetero.interop.vlm_export import whole_export
    from hetero.models import default_registry
    from hetero.models.gpt.hf import gpt_config, load_gpt
    from hetero.models.gpt.model import GPT
    from hetero.models.vit.qwen_tower import QwenVisionTower
    from hetero.models.vit.qwen_tower_hf import load_tower, qwen_vit_config

    path = write_qwen_vl(tmp_path / "vlm", family)
    whole, registry = HFCheckpoint(path), default_registry()
    llm = GPT(gpt_config(open_part(whole, "text").config))
    load_gpt(llm, path)
    tower = QwenVisionTower(qwen_vit_config(open_part(whole, "vision").config, {}, "vision"))
    load_tower(tower, open_part(whole, "vision"))
    written = {}
    for kind, model in (("vit", tower), ("gpt", llm)):
        export = whole_export(registry[kind], model.config, whole, kind)
        written |= hf_tensors(export, whole, model.state_dict().items())
    assert sorted(written) == sorted(whole.names())
    for name in whole.names():
        assert torch.equal(written[name], whole.tensor(name)), name
