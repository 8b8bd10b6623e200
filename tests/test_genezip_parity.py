"""GeneZip under TP, DP and FSDP2 matches one process: 3 AdamW steps through the runtime on real genome
windows, fp32, one and two chunking stages. Per step the loss (next-base prediction plus the Region-Aware
Ratio loss) and its parts and the gradient norm, every replica's gradients at the first step
(``hetero.testing.parity``)."""

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.genome import annotated_genome
from hetero.kinds.genezip.config import GeneZipConfig
from hetero.kinds.genezip.model import BoundaryRouter, GeneZip
from hetero.kinds.genezip.objectives import genezip_loss
from hetero.parallel.options import ParallelOptions
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, load_weights, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_bf16_parity, check_parity, record_reference, record_run

BATCH, LENGTH, STEPS, LR = 4, 96, 3, 3e-3


def config(stages: int) -> GeneZipConfig:
    return GeneZipConfig(
        seq_len=LENGTH, hidden_size=32, num_heads=4, main_layers=1, local_window=8, stages=stages,
        region_bpt={"coding": 3.0, "intergenic": 6.0}, routing_window=32, min_boundaries=2, max_boundaries=12,
    )


def batches() -> list[dict[str, torch.Tensor]]:
    bases, regions, _ = annotated_genome()
    out = []
    for step in range(STEPS):
        starts = [20_000 + 5_000 * i + 997 * step for i in range(BATCH)]  # some windows hold gene ends
        take = lambda a: torch.stack([torch.tensor(a[s : s + LENGTH], dtype=torch.long) for s in starts])  # noqa: E731
        out.append({"dna": take(bases), "dna_regions": take(regions)})
    return out


def build(stages: int) -> GeneZip:
    torch.manual_seed(0)
    model = GeneZip(config(stages))
    # A random key projection puts boundary probabilities around 1/2, so routing picks a mix of chunk
    # starts of its own, besides those the floor forces.
    for router in (m for m in model.modules() if isinstance(m, BoundaryRouter)):
        torch.nn.init.orthogonal_(router.wk.weight)
    return model


def reference(stages: int, precision: str = "fp32") -> Record:
    model = build(stages)

    def losses(batch, step):
        terms = genezip_loss(model.config, model(batch["dna"]), batch["dna"], batch["dna_regions"])
        return [terms.total(model.config).sum() / BATCH, terms.prediction.sum() / BATCH, terms.ratio.sum() / BATCH]

    return record_reference({"dna": model}, {"dna": OptimizerConfig(lr=LR)}, batches(), losses, precision=precision)


def run(rank, world_size, layout, options, stages):
    blocks = {"dna": module("genezip", config(stages), layout, OptimizerConfig(lr=LR), options)}
    runtime = build_runtime(experiment(world_size, blocks, global_batch=BATCH, microbatches=1))
    load_weights(runtime, "dna", build(stages).state_dict())
    return record_run(runtime, batches(), ("dna.loss", "dna.prediction", "dna.ratio"))


@pytest.mark.parametrize(
    "layout,options,stages",
    [({"tp": 2}, ParallelOptions(), 1), ({"dp": 2}, ParallelOptions(), 1),
     ({"dp": 2}, ParallelOptions(fsdp=True), 1),
     ({"tp": 2, "dp": 2}, ParallelOptions(activation_checkpointing=True), 2)],
    ids=["tp2", "dp2", "dp2+fsdp", "tp2·dp2+checkpointing, 2 stages"],
)
def test_genezip_parity(layout, options, stages):
    world = layout.get("tp", 1) * layout.get("dp", 1)
    results = run_ranks(run, world, layout, options, stages, timeout_s=240)
    what = f"genezip parity {layout} fsdp={options.fsdp} checkpointing={options.activation_checkpointing} stages={stages}"
    print("\n" + check_parity(results, reference(stages), what))


def test_genezip_bf16_parity():
    """tp2 under bf16 autocast against one process under the same autocast (``check_bf16_parity``)."""
    results = run_ranks(run, 2, {"tp": 2}, ParallelOptions(precision="bf16"), 1, timeout_s=240)
    print("\n" + check_bf16_parity(results, reference(1, "bf16"), reference(1), "genezip bf16 tp2"))
