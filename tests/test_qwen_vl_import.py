"""A whole Qwen2.5-VL checkpoint (``hetero.interop.qwen_vl``): a tiny random one saved offline by transformers
imported into a tower dp2 (ranks 0-1) → LLM tp2 (ranks 2-3) graph, both modules naming the same directory.
On rows of text around images of several grids and a video (random patches, the processor's steps are not
built yet), hetero's logits on every LLM rank equal transformers' (1e-5). A Qwen3-VL checkpoint is refused
by name until DeepStack reaches the LLM."""

import pytest
import torch
import transformers
from torch.distributed.tensor import DTensor

from hetero.data.mrope_positions import VisionSpan, mrope_positions
from hetero.errors import ConfigError
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

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
        config = transformers.Qwen3VLConfig(vision_config=dict(VISION, num_position_embeddings=16,
                                                               deepstack_visual_indexes=[0]),
                                            text_config=dict(TEXT, head_dim=8), **ids)
        model = transformers.Qwen3VLForConditionalGeneration(config)
    with torch.no_grad():  # biases and norms start at 0 and 1: make every weight matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(path)
    return path


def rows():
    """Per row: input ids, token types (0 text, 1 image, 2 video), hetero's spans, the grids and patches."""
    gen, out = torch.Generator().manual_seed(1), []
    for parts in ROWS:
        ids, types, spans, grids = [], [], [], []
        for kind, what in parts:
            if kind == "text":
                ids += torch.randint(0, 100, (what,), generator=gen).tolist()
                types += [0] * what
                continue
            t, h, w = what
            ids.append(START), types.append(0)
            step = SECONDS * TOKENS_PER_SECOND if kind == "video" else 1.0
            spans.append(VisionSpan(len(ids), (t, h // 2, w // 2), step))
            ids += [IMAGE if kind == "image" else VIDEO] * (t * h * w // 4)
            types += [1 if kind == "image" else 2] * (t * h * w // 4)
            ids.append(END), types.append(0)
            grids.append((kind, what))
        patches = torch.randn(sum(t * h * w for _, (t, h, w) in grids), 3 * 2 * 2 * 2, generator=gen)
        out.append((torch.tensor(ids), torch.tensor(types), spans, grids, patches))
    return out


def transformers_logits(path):
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    logits = []
    with torch.no_grad():
        for ids, types, _, grids, patches in rows():
            images = [g for kind, g in grids if kind == "image"]
            videos = [g for kind, g in grids if kind == "video"]
            image_patches = sum(t * h * w for t, h, w in images)
            extra = {}
            if images:
                extra |= {"pixel_values": patches[:image_patches], "image_grid_thw": torch.tensor(images)}
            if videos:
                extra |= {"pixel_values_videos": patches[image_patches:], "video_grid_thw": torch.tensor(videos),
                          "second_per_grid_ts": torch.tensor([SECONDS] * len(videos))}
            logits.append(model(input_ids=ids[None], mm_token_type_ids=types[None], **extra).logits[0])
    return logits


def hetero_batch():
    """The rows padded to SEQ; transformers gives a row's images first, then its videos: so do the patches."""
    tokens = torch.zeros(len(ROWS), SEQ, dtype=torch.long)
    rope, grids, image_row, image_start, patches = [], [], [], [], []
    for r, (ids, _, spans, row_grids, row_patches) in enumerate(rows()):
        tokens[r, :len(ids)] = ids
        rope.append(mrope_positions(SEQ, spans))
        order = sorted(range(len(spans)), key=lambda i: row_grids[i][0] != "image")
        sizes = [t * h * w for _, (t, h, w) in (row_grids[i] for i in order)]
        offsets = torch.tensor([0, *sizes]).cumsum(0).tolist()
        for i in range(len(spans)):  # in row order, each its own patches
            k = order.index(i)
            grids.append(row_grids[i][1]), image_row.append(r), image_start.append(spans[i].start)
            patches.append(row_patches[offsets[k]:offsets[k + 1]])
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "rope_positions": torch.stack(rope),
            "image_patches": torch.cat(patches), "image_grid": torch.tensor(grids), "image_row": torch.tensor(image_row),
            "image_start": torch.tensor(image_start)}


def graph(path):
    layouts = {"vision": {"dp": 2}, "llm": {"tp": 2, "offset": 2}}
    blocks = {name: module(kind, {}, layouts[name], {"lr": 1e-3, "warmup_steps": 0}, init={"hf": str(path)})
              for name, kind in (("vision", "vit"), ("llm", "gpt"))}
    blocks["vision"]["model"] = {"max_patches": 64}
    blocks["llm"]["model"] = {"seq_len": SEQ}
    return experiment(4, blocks, edges=[("vision", "llm")], global_batch=2, microbatches=1)


def imported_logits(rank, world_size, path, batch):
    from hetero.testing.kinds import build_runtime

    runtime = build_runtime(graph(path))
    if "llm" not in runtime.modules:
        runtime.evaluate([batch])
        return None
    seen = []

    def keep(_, __, out):
        logits = out[0] if isinstance(out, tuple) else out
        seen.append((logits.full_tensor() if isinstance(logits, DTensor) else logits).detach().clone())

    hook = runtime.modules["llm"].model.register_forward_hook(keep)
    runtime.evaluate([batch])
    hook.remove()
    return seen[0]


def test_a_whole_qwen2_5_vl_imports_under_layouts(tmp_path):
    path = write_qwen_vl(tmp_path / "qwen2.5-vl")
    expected = transformers_logits(path)
    held = [r for r in run_ranks(imported_logits, 4, path, hetero_batch(), timeout_s=300) if r is not None]
    assert len(held) == 2  # both LLM ranks
    errors = [((ours[r, :len(want)] - want).abs().max() / want.abs().max()).item()
              for ours in held for r, want in enumerate(expected)]
    print(f"\nimported Qwen2.5-VL: logits rel. errors {', '.join(f'{e:.1e}' for e in errors)}")
    assert max(errors) <= 1e-5


def test_a_qwen3_vl_is_refused_until_deepstack_reaches_the_llm(tmp_path):
    from hetero.models import default_registry

    path = write_qwen_vl(tmp_path / "qwen3-vl", "qwen3-vl")
    kind = default_registry()["vit"]
    config = kind.pretrained_config("vision", path, {"max_patches": 64})
    assert config.tower == "qwen3-vl" and config.deepstack_layers == [0] and config.position_grid == 4
    with pytest.raises(ConfigError, match="DeepStack taps do not reach the LLM yet"):
        from hetero.testing.kinds import build_graph

        build_graph(graph(path))
