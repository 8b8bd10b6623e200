"""GeneZip under TP and DP matches one process: the loss (next-base prediction plus the Region-Aware
Ratio loss) over a batch of real genome windows and every gradient, fp32, one and two chunking stages."""

import pytest
import torch

from hetero.data.genome import annotated_genome
from hetero.kinds.genezip.model import BoundaryRouter, GeneZip
from hetero.kinds.genezip.config import GeneZipConfig
from hetero.kinds.genezip.objectives import genezip_loss
from hetero.kinds.genezip.plan import parallelize_genezip
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.options import ParallelOptions
from hetero.parallel.placement import place
from hetero.testing.grads import synced_full_grads
from hetero.testing.multiprocess import run_ranks

BATCH, LENGTH = 4, 96


def config(stages: int) -> GeneZipConfig:
    return GeneZipConfig(
        seq_len=LENGTH, hidden_size=32, num_heads=4, main_layers=1, local_window=8, stages=stages,
        region_bpt={"coding": 3.0, "intergenic": 6.0}, routing_window=32, min_boundaries=2, max_boundaries=12,
    )


def windows() -> tuple[torch.Tensor, torch.Tensor]:
    bases, regions, _ = annotated_genome()
    starts = [20_000 + 5_000 * i for i in range(BATCH)]  # some windows hold gene ends: both regions
    take = lambda a: torch.stack([torch.tensor(a[s : s + LENGTH], dtype=torch.long) for s in starts])  # noqa: E731
    return take(bases), take(regions)


def build(stages: int) -> GeneZip:
    torch.manual_seed(0)
    model = GeneZip(config(stages))
    # A random key projection puts boundary probabilities around 1/2, so routing picks a mix of
    # chunk starts of its own, besides those the floor forces.
    for router in (m for m in model.modules() if isinstance(m, BoundaryRouter)):
        torch.nn.init.orthogonal_(router.wk.weight)
    return model


def loss_of(model, bases, regions):
    """The batch's loss over these rows, scaled so the rows' parts sum to the whole batch's."""
    return genezip_loss(model.config, model(bases), bases, regions).total(model.config).sum() / BATCH


def reference(stages, bases, regions):
    model = build(stages)
    loss = loss_of(model, bases, regions)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run(rank, world_size, layout_kwargs, options, stages, bases, regions):
    mesh = build_module_meshes(place({"dna": LayoutSpec(**layout_kwargs)}, world_size))["dna"]
    model = parallelize_genezip(build(stages), mesh, options)
    rows = torch.arange(BATCH).tensor_split(mesh.layout.dp)[mesh.coord.dp]
    loss = loss_of(model, bases[rows], regions[rows])
    loss.backward()
    named = list(model.named_parameters())
    return loss.item(), synced_full_grads(named, mesh, options)


@pytest.mark.parametrize(
    "layout,options,stages",
    [({"tp": 2}, ParallelOptions(), 1), ({"dp": 2}, ParallelOptions(), 1),
     ({"dp": 2}, ParallelOptions(fsdp=True), 1),
     ({"tp": 2, "dp": 2}, ParallelOptions(activation_checkpointing=True), 2)],
    ids=["tp2", "dp2", "dp2+fsdp", "tp2·dp2+checkpointing, 2 stages"],
)
def test_genezip_parity(layout, options, stages):
    bases, regions = windows()
    ref_loss, ref_grads = reference(stages, bases, regions)
    world = 1
    for degree in layout.values():
        world *= degree
    results = run_ranks(run, world, layout, options, stages, bases, regions, timeout_s=240)
    dp = layout.get("dp", 1)
    losses = [loss for loss, _ in results]
    total = sum(losses[:: world // dp]) if dp > 1 else losses[0]  # one rank per dp replica
    loss_error = abs(total - ref_loss) / abs(ref_loss)
    errors = {}
    for _, grads in results:
        assert set(grads) == set(ref_grads)
        for name, grad in grads.items():
            error = ((grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp(min=1e-30)).item()
            errors[name] = max(error, errors.get(name, 0.0))
    worst = max(errors, key=errors.get)
    print(f"\ngenezip parity {layout}: loss rel error {loss_error:.1e}, worst gradient {worst} {errors[worst]:.1e}")
    assert loss_error <= 1e-5
    assert errors[worst] <= 1e-5, f"{worst}: relative gradient error {errors[worst]:.1e}"
