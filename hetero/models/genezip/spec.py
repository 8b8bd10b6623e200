"""The ``genezip`` kind: the GeneZip DNA compressor of the rows that carry a genome window.

Reads ``dna`` (base ids) and ``dna_regions`` (coding / intergenic, for the Region-Aware Ratio targets) of
the rows with ``has_dna``; output ``embeddings`` (``max_tokens()`` × ``out_size``, when ``out_size`` > 0):
its compressed tokens, zero-padded, for another module. Loss: next-base prediction plus the ratio loss per
window, summed, over the global count of windows (parts ``prediction`` and ``ratio``; with a region budget
also ``region``, its classifier's loss; the counts its controller reads after every optimizer step are the
step statistics ``regions.STATISTICS``). Evaluation adds
bits per base (overall and per region), the bases per token achieved per region, and the fewest chunk
starts in any routing window and any window.
"""

from __future__ import annotations

import math

import torch

from hetero.data.genome import BASES, REGIONS
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.model import GeneZip, padded_tokens
from hetero.models.genezip.objectives import genezip_loss, region_nats, routing_counts
from hetero.models.genezip.plan import parallelize_genezip
from hetero.models.genezip.regions import STATISTICS
from hetero.kinds.columns import LONG, Column, Dim
from hetero.kinds.registry import Kind, Metric, Port, StageResult, StageStep


class GeneZipKind(Kind):
    name = "genezip"
    config = GeneZipConfig
    modality = "dna"

    def build(self, config: GeneZipConfig) -> GeneZip:
        return GeneZip(config)

    def parallelize(self, model, mesh, options):
        return parallelize_genezip(model, mesh, options)

    def data_keys(self, config: GeneZipConfig) -> tuple[str, ...]:
        return ("dna", "dna_regions")

    def columns(self, config: GeneZipConfig) -> tuple[Column, ...]:
        window = (Dim("seq_len", config.seq_len),)
        return (
            Column("dna", window, LONG, high=len(BASES), meaning=f"the bases {BASES}, hetero.data.genome.BASES",
                   fix="encode the bases with hetero.data.genome.encode (A C G T: 0..3, anything else: 4)"),
            Column("dna_regions", window, LONG, high=len(REGIONS),
                   meaning=f"the regions {', '.join(REGIONS)}, hetero.data.genome.REGIONS",
                   fix="label each base with its region's index in hetero.data.genome.REGIONS"),
        )

    def loss_parts(self, config: GeneZipConfig) -> tuple[str, ...]:
        return ("prediction", "ratio") + (("region",) if config.region_budget() else ())

    def step_statistics(self, config: GeneZipConfig) -> tuple[str, ...]:
        return STATISTICS if config.region_budget() else ()

    def after_step(self, model: GeneZip, config: GeneZipConfig, statistics: dict[str, float], decay: float) -> None:
        model.budget.update(torch.tensor([statistics[name] for name in STATISTICS], dtype=torch.float64), decay)

    def metric_names(self, config: GeneZipConfig, available) -> list[tuple[str, str]]:
        names = ["bits_per_base", *(f"bits.{r}" for r in REGIONS), *(f"bpt.{r}" for r in REGIONS), "bpt"]
        return [(n, "mean") for n in names] + [("fewest_per_window", "min"), ("fewest_per_sequence", "min")]

    def outputs(self, config: GeneZipConfig) -> dict[str, Port]:
        return {"embeddings": Port(config.out_size, tokens=config.max_tokens(), field="out_size")}

    def stage(self, model: GeneZip, step: StageStep) -> StageResult:
        config, bases, regions = step.config, step.data["dna"], step.data["dna_regions"]
        output = model(bases)
        terms = genezip_loss(config, output, bases, regions)
        result = StageResult(
            loss=terms.total(config).sum(), parts={"prediction": terms.prediction.sum(), "ratio": terms.ratio.sum()}
        )
        if model.budget is not None:
            result.parts["region"] = terms.region.sum()
            counts = model.budget.statistics(output.region_logits, output.routings[0].boundary, regions)
            result.parts |= dict(zip(STATISTICS, counts))
        if config.out_size:
            result.outputs["embeddings"] = padded_tokens(output, config)
        if not step.training:
            result.metrics = _heldout(output, bases, regions, config)
        return result


def _heldout(output, bases: torch.Tensor, regions: torch.Tensor, config: GeneZipConfig) -> dict[str, Metric]:
    nats, counted = region_nats(output, bases, regions)
    bits = nats / math.log(2)
    counts = routing_counts(output.routings[0], regions, config.routing_window)
    device = bases.device
    metrics = {"bits_per_base": Metric(bits.sum(), counted.sum())}
    for r, name in enumerate(REGIONS):
        metrics[f"bits.{name}"] = Metric(bits[r], counted[r])
        metrics[f"bpt.{name}"] = Metric(counts.bases[r].double(), counts.tokens[r].double())
    metrics["bpt"] = Metric(counts.bases.sum().double(), counts.tokens.sum().double())
    for key in ("fewest_per_window", "fewest_per_sequence"):
        metrics[key] = Metric(torch.tensor(float(getattr(counts, key)), dtype=torch.float64, device=device), reduce="min")
    return metrics
