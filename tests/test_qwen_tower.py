"""hetero's Qwen2.5-VL and Qwen3-VL vision towers against transformers' on the same weights, in one process
(fp32): merged tokens, DeepStack taps and every weight's gradient, for a packed set of images of several
sizes and aspect ratios and a video; the cost model's count of its FLOPs."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from hetero.models.vit.config import ViTConfig
from hetero.models.vit.flops import qwen_tower_forward_flops
from hetero.models.vit.qwen_tower import QwenVisionTower
from hetero.parallel.options import ParallelOptions
from hetero.models.vit.qwen_tower_hf import tower_state

# (t, h, w) in patches: a still image is one temporal patch; widths and heights with windows cut short
GRIDS = [(1, 8, 12), (1, 4, 4), (2, 6, 10), (1, 10, 6)]
SIZES = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=40, patch_size=2,
             temporal_patch_size=2, in_channels=3, spatial_merge_size=2)

TOWER = dict(hidden_size=32, num_layers=4, num_heads=2, ffn_hidden_size=48, out_size=40, channels=3, patch_size=2,
             temporal_patch=2, merge=2, max_patches=120, class_token=False, projector=False, feature_norm=False)


def towers(family: str):
    torch.manual_seed(0)
    if family == "qwen2.5-vl":
        vision = Qwen2_5_VLConfig(vision_config=dict(SIZES, window_size=8, fullatt_block_indexes=[1, 3])).vision_config
        theirs = Qwen2_5_VisionTransformerPretrainedModel(vision)
        ours = ViTConfig(**TOWER, tower=family, window_size=8, full_attention_blocks=[1, 3])
    else:
        vision = Qwen3VLConfig(vision_config=dict(SIZES, num_position_embeddings=36,
                                                  deepstack_visual_indexes=[0, 2])).vision_config
        theirs = Qwen3VLVisionModel(vision)
        ours = ViTConfig(**TOWER, tower=family, position_grid=6, deepstack_layers=[0, 2])
    with torch.no_grad():  # transformers starts biases and norms at 0 and 1: make every weight matter
        for param in theirs.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    theirs.eval()
    tower = QwenVisionTower(ours)
    tower.load_state_dict(tower_state(theirs.state_dict(), ours), strict=True)
    return theirs, tower


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_the_tower_equals_transformers(family):
    theirs, ours = towers(family)
    values = 3 * 2 * 2 * 2
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), values, generator=torch.Generator().manual_seed(1))
    out = theirs(patches, grid_thw=torch.tensor(GRIDS))
    merged, taps = ours(patches, GRIDS)
    expected_taps = list(getattr(out, "deepstack_features", None) or [])
    assert merged.shape == (len(patches) // 4, 40) and len(taps) == len(expected_taps)
    for got, want in zip([merged, *taps], [out.pooler_output, *expected_taps]):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(2 + i)) for i, t in enumerate([merged, *taps])]
    sum((t * w).sum() for t, w in zip([merged, *taps], weights)).backward()
    sum((t * w).sum() for t, w in zip([out.pooler_output, *expected_taps], weights)).backward()
    grads = tower_state({n: p.grad for n, p in theirs.named_parameters()}, ours.config)
    for name, param in ours.named_parameters():
        want = grads[name]
        assert (param.grad - want).norm() <= 1e-5 * want.norm(), name


def test_a_qwen_tower_refuses_what_it_does_not_run():
    from hetero.parallel.layout import Layout

    config = ViTConfig(**TOWER, tower="qwen3-vl", position_grid=6, deepstack_layers=[1], window_size=8)
    errors = config.errors("vision", Layout(3, 1, 1, 2, tuple(range(6))), ParallelOptions(sequence_parallel=True))
    assert errors == [
        "vision.model.tower=qwen3-vl attends to whole images: set vision.model.window_size=0 and full_attention_blocks=[]",
        "vision.layout: the qwen3-vl tower runs on one pipeline stage without context parallelism, not cp=1, pp=2; "
        "spread it with dp and tp",
        "vision.parallel.sequence_parallel: the qwen3-vl tower's TP ranks hold every patch (its images are not one "
        "sequence to split); set it false",
        "vision.layout.tp=3 does not divide vision.model.num_heads=2; choose tp from 1, 2",
        "vision.layout.tp=3 does not divide vision.model.hidden_size=32; choose tp from 1, 2, 4, 8, 16, 32"], errors
    assert ViTConfig(tower="qwen2.5-vl", max_patches=64, merge=2).errors("vision", Layout(1, 1, 1, 1, (0,)))[:3] == [
        "vision.model.tower=qwen2.5-vl has no class_token: set vision.model.class_token=false",
        "vision.model.tower=qwen2.5-vl has no projector: set vision.model.projector=false",
        "vision.model.tower=qwen2.5-vl has no feature_norm: set vision.model.feature_norm=false"]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(1, 16, 10)], GRIDS], ids=["8x12", "16x10", "mixed with a video"])
def test_the_cost_models_tower_flops_equal_a_count_of_its_matmuls(family, grids):
    """``qwen_tower_forward_flops`` against torch's FlopCounterMode over the tower's forward: windows cut short
    at the edges, full-attention blocks, SwiGLU, DeepStack mergers."""
    _, ours = towers(family)
    patches = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 2 * 2)
    with FlopCounterMode(display=False) as counter:
        ours(patches, grids)
    assert counter.get_total_flops() == qwen_tower_forward_flops(ours.config, grids)
