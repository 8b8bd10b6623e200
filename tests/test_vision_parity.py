"""The vision encoder (ViT + projector) under TP and DP matches one process: outputs and gradients, fp32."""

import pytest
import torch

from hetero.models.vit.model import VisionEncoder
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.plan import parallelize_vision
from hetero.parallel.data import AllReduceGradSync
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.options import ParallelOptions
from hetero.parallel.placement import place
from hetero.testing.multiprocess import run_ranks

CONFIG = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=3, num_heads=4, out_size=24,
                   feature_layer=-2)
BATCH = 6


def data():
    gen = torch.Generator().manual_seed(5)
    images = torch.rand(BATCH, 1, 16, 16, generator=gen)
    weight = torch.randn(BATCH, CONFIG.num_patches, CONFIG.out_size, generator=gen)
    return images, weight


def reference():
    torch.manual_seed(0)
    model = VisionEncoder(CONFIG)
    images, weight = data()
    out = model(images)
    ((out * weight).sum() / BATCH).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run(rank, world_size, layout_kwargs, options):
    mesh = build_module_meshes(place({"vision": LayoutSpec(**layout_kwargs)}, world_size))["vision"]
    torch.manual_seed(0)
    model = parallelize_vision(VisionEncoder(CONFIG), mesh, options)
    images, weight = data()
    rows = torch.arange(BATCH).tensor_split(mesh.layout.dp)[mesh.coord.dp]
    out = model(images[rows])
    ((out * weight[rows]).sum() / BATCH).backward()
    if mesh.layout.dp > 1 and not options.fsdp:
        AllReduceGradSync(model.named_parameters(), mesh.group("dp")).sync()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = grad.detach().clone()
    return rows, out.detach(), grads


@pytest.mark.parametrize(
    "layout,options",
    [
        ({"tp": 2}, ParallelOptions()),
        ({"dp": 3}, ParallelOptions()),
        ({"tp": 2, "dp": 2}, ParallelOptions(activation_checkpointing=True)),
        ({"dp": 2}, ParallelOptions(fsdp=True)),
    ],
    ids=["tp2", "dp3", "tp2·dp2+checkpointing", "dp2+fsdp"],
)
def test_vision_encoder_parity(layout, options):
    ref_out, ref_grads = reference()
    world = 1
    for degree in layout.values():
        world *= degree
    for rows, out, grads in run_ranks(run, world, layout, options, timeout_s=180):
        torch.testing.assert_close(out, ref_out[rows], rtol=1e-5, atol=1e-6)
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            error = ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert error <= 1e-5, f"{name}: relative gradient error {error:.1e}"
