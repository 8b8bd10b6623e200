"""M-RoPE: the host's positions (``hetero.data.mrope_positions``) against transformers' ``get_rope_index`` of
tiny random Qwen2.5-VL and Qwen3-VL models, and hetero's GPT with M-RoPE sections against their text models
(fp32 hidden states at the same positions)."""

import pytest
import torch
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel,
                          Qwen3VLConfig, Qwen3VLModel, Qwen3VLTextConfig, Qwen3VLTextModel)

from hetero.data.mrope_positions import VisionSpan, mrope_positions
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.hf import gpt_name
from hetero.models.gpt.model import GPT
from hetero.models.gpt.rope import mrope_axes
from hetero.parallel.layout import Layout

MERGE = 2
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
TINY_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rms_norm_eps=1e-6)


def vlm(family: str):
    torch.manual_seed(0)
    if family == "qwen2.5-vl":
        config = Qwen2_5_VLConfig(vision_config=dict(TINY_VISION, fullatt_block_indexes=[0]), text_config=TINY_TEXT)
        return Qwen2_5_VLModel(config).eval()
    config = Qwen3VLConfig(vision_config=dict(TINY_VISION, deepstack_visual_indexes=[0]),
                           text_config=dict(TINY_TEXT, head_dim=8))
    return Qwen3VLModel(config).eval()


def row(parts):
    """Token types of a row from ("text", n) / ("image", (t, h, w)) / ("video", (t, h, w)) parts, the
    patch grids (before the merge) of its images and videos, and hetero's spans of it."""
    types, images, videos, spans = [], [], [], []
    for kind, what in parts:
        if kind == "text":
            types += [0] * what
            continue
        t, h, w = what
        merged = (t, h // MERGE, w // MERGE)
        spans.append(VisionSpan(len(types), merged))
        types += [1 if kind == "image" else 2] * (t * merged[1] * merged[2])
        (images if kind == "image" else videos).append(list(what))
    return torch.tensor([types]), images, videos, spans


ROWS = {
    "text only": [("text", 9)],
    "one image": [("text", 5), ("image", (1, 4, 6)), ("text", 4)],
    "two images, one first": [("image", (1, 8, 4)), ("text", 3), ("image", (1, 2, 2)), ("text", 2)],
    "a tall image last": [("text", 2), ("image", (1, 10, 2))],
}


def theirs(model, types, images, videos, **extra):
    grids = {"image_grid_thw": torch.tensor(images) if images else None,
             "video_grid_thw": torch.tensor(videos) if videos else None}
    positions, _ = model.get_rope_index(torch.zeros_like(types), types, **grids, **extra)
    return positions[:, 0]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_positions_equal_transformers_for_images(family):
    model = vlm(family)
    for name, parts in ROWS.items():
        types, images, videos, spans = row(parts)
        ours = mrope_positions(types.shape[1], spans)
        assert torch.equal(ours, theirs(model, types, images, videos)), name


def test_positions_equal_transformers_for_qwen3_vl_video_frames():
    """Qwen3-VL splits a video into frames, each a span of one temporal step between timestamp tokens."""
    frames, h, w = 3, 4, 6
    parts = [("text", 3)]
    for _ in range(frames):
        parts += [("text", 2), ("video", (1, h, w))]
    parts += [("text", 4)]
    types, _, _, spans = row(parts)
    ours = mrope_positions(types.shape[1], spans)
    assert torch.equal(ours, theirs(vlm("qwen3-vl"), types, None, [[frames, h, w]]))


def test_a_qwen2_5_vl_video_follows_the_original_rule():
    """A video of 3 temporal patches, 2 s each at 4 tokens per second (time step 8): temporal positions
    start, start+8, start+16; the text after continues past the largest, unlike transformers 5.x."""
    t, h, w, step = 3, 4, 4, 8.0
    types, _, videos, spans = row([("text", 2), ("video", (t, h, w)), ("text", 3)])
    spans = [VisionSpan(spans[0].start, spans[0].grid, step)]
    ours = mrope_positions(types.shape[1], spans)
    expected = [[p, p, p] for p in range(2)]
    for k in range(t):
        expected += [[2 + int(k * step), 2 + i, 2 + j] for i in range(h // MERGE) for j in range(w // MERGE)]
    expected += [[2 + 16 + 1 + n] * 3 for n in range(3)]
    assert ours.T.tolist() == expected
    transformers_5 = theirs(vlm("qwen2.5-vl"), types, None, videos, second_per_grid_ts=torch.tensor([2.0]))
    assert torch.equal(transformers_5[:, :-3], ours[:, :-3])
    assert transformers_5[0, -3].item() == 2 + max(h, w) // MERGE  # below the video's last temporal position


def test_positions_restart_in_every_packed_document():
    model = vlm("qwen2.5-vl")
    samples = [ROWS["one image"], ROWS["two images, one first"], ROWS["text only"]]
    rows = [row(parts) for parts in samples]
    starts, spans, at = [], [], 0
    for types, _, _, own in rows:
        starts.append(at)
        spans += [VisionSpan(s.start + at, s.grid) for s in own]
        at += types.shape[1]
    packed = mrope_positions(at, spans, starts)
    for start, (types, images, videos, _) in zip(starts, rows):
        alone = theirs(model, types, images, videos)
        assert torch.equal(packed[:, start:start + types.shape[1]], alone)


def test_a_span_that_crosses_a_document_is_refused():
    with pytest.raises(ValueError, match="crosses the end of its document"):
        mrope_positions(10, [VisionSpan(3, (1, 2, 2))], (0, 5))


def test_the_axes_of_each_frequency():
    assert mrope_axes([2, 3, 3], False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    # interleaved, Qwen3-VL's rule: height on 1, 4, ..., width on 2, 5, ... while their counts last
    assert mrope_axes([4, 2, 2], True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    layout = Layout(1, 1, 1, 1, (0,))
    assert GPTConfig(head_dim=16, mrope_sections=[2, 3, 3], mrope_interleaved=True).errors("llm", layout) == [
        "llm.model.mrope_sections=[2, 3, 3] with mrope_interleaved=true: height takes frequencies 1, 4, 7, ... "
        "and width 2, 5, 8, ... of the 8, so at most 3 and 2"]
    assert "sum to 7, but a head of 16 channels turns 8" in GPTConfig(head_dim=16, mrope_sections=[2, 3, 2]).errors(
        "llm", layout)[0]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_the_gpt_with_mrope_equals_the_text_model(family):
    torch.manual_seed(0)
    if family == "qwen2.5-vl":
        text = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**TINY_TEXT, rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 1, 2]})).eval()
        ours = GPTConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         ffn_hidden_size=64, seq_len=24, qkv_bias=True, norm_eps=1e-6, rope_theta=1e4,
                         mrope_sections=[1, 1, 2])
    else:
        text = Qwen3VLTextModel(Qwen3VLTextConfig(**TINY_TEXT, head_dim=8, rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1], "mrope_interleaved": True})).eval()
        ours = GPTConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         ffn_hidden_size=64, seq_len=24, qk_norm=True, norm_eps=1e-6, rope_theta=1e4,
                         mrope_sections=[2, 1, 1], mrope_interleaved=True)
    assert not ours.errors("llm", Layout(1, 1, 1, 1, (0,)))
    gpt = GPT(ours)
    loaded = gpt.load_state_dict({gpt_name(f"model.{k}"): v for k, v in text.state_dict().items()}, strict=False)
    assert loaded.missing_keys == ["output.weight"] and not loaded.unexpected_keys
    types, _, _, spans = row(ROWS["two images, one first"] + [("text", 10)])
    positions = mrope_positions(types.shape[1], spans)[:, None].expand(3, 2, -1)
    tokens = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        _, hidden = gpt(tokens, positions, return_hidden=True)
        expected = text(input_ids=tokens, position_ids=positions).last_hidden_state
        plain = text(input_ids=tokens).last_hidden_state
    assert torch.allclose(hidden, expected, rtol=1e-5, atol=1e-5), (hidden - expected).abs().max()
    assert not torch.allclose(hidden, plain, atol=1e-3)  # the positions matter
