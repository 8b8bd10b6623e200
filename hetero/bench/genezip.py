"""GeneZip against H-Net with one ratio target and against fixed-stride chunking, on held-out real DNA.

    hetero bench genezip [--steps 600] [--target-bpt 4] [--intergenic-ratio 2] [--seeds 0 1]

Data: a bacterial chromosome that ships in pyrodigal's wheel, coding/intergenic labels from pyrodigal's gene
calls (``hetero.data.genome``); the last 10% of the chromosome is held out. Three models with the same
blocks, widths, steps, batches and seed, at the same average bases per token (BPT):

- ``genezip``: dynamic chunking with the Region-Aware Ratio: intergenic DNA aims at ``--intergenic-ratio``
  times the coding target, the two chosen so the training windows average ``--target-bpt``;
- ``hnet``: dynamic chunking with ``--target-bpt`` everywhere (H-Net's single ratio);
- ``fixed``: a token every ``--target-bpt`` bases (no router).

Annotations enter only GeneZip's ratio loss in training; evaluation routes raw DNA. Reported on every
held-out window: bits per base of next-base prediction (overall and per region), the achieved BPT per
region against its target, and the fewest chunk starts in any routing window and any sequence (the
floor is ``--min-boundaries`` per window of ``--routing-window`` bases).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace

import torch

from hetero.data.genome import REGIONS, GenomeOptions, GenomeWindows, ensure_genome_shards
from hetero.kinds.genezip.model import GeneZip
from hetero.kinds.genezip.config import GeneZipConfig
from hetero.kinds.genezip.objectives import bits_per_base, genezip_loss, heldout_metrics

VARIANTS = ("genezip", "hnet", "fixed")


def region_targets(average: float, intergenic_ratio: float, coding_fraction: float) -> dict[str, float]:
    """Per-region BPT with intergenic = ratio × coding whose token count matches ``average`` everywhere:
    coding_fraction / N_c + (1 - coding_fraction) / (ratio · N_c) = 1 / average."""
    coding = average * (coding_fraction + (1 - coding_fraction) / intergenic_ratio)
    return {"intergenic": coding * intergenic_ratio, "coding": coding}


def variant_configs(base: GeneZipConfig, targets: dict[str, float]) -> dict[str, GeneZipConfig]:
    return {
        "genezip": replace(base, region_bpt=targets),
        "hnet": replace(base, region_bpt={}),
        "fixed": replace(base, routing="fixed", region_bpt={}),
    }


def train(config: GeneZipConfig, data: GenomeWindows, steps: int, lr: float, seed: int) -> tuple[GeneZip, list[float]]:
    torch.manual_seed(seed)
    model = GeneZip(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    losses = []
    for step in range(steps):
        batch = data.batch(step)
        loss = genezip_loss(config, model(batch["bases"]), batch["bases"], batch["regions"])
        optimizer.zero_grad()
        loss.total(config).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.prediction.detach().mean()))
    return model, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero bench genezip", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=512, help="bases per sequence")
    parser.add_argument("--target-bpt", type=float, default=4.0, help="average bases per token of every model")
    parser.add_argument("--intergenic-ratio", type=float, default=2.0,
                        help="GeneZip's intergenic BPT target over its coding target")
    parser.add_argument("--routing-window", type=int, default=64)
    parser.add_argument("--min-boundaries", type=int, default=4, help="the routing floor per routing window")
    parser.add_argument("--max-boundaries", type=int, default=0, help="the routing ceiling (0: none)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--encoder-layers", type=int, default=2, help="per stage, as decoder layers")
    parser.add_argument("--main-layers", type=int, default=2)
    parser.add_argument("--local-window", type=int, default=64)
    parser.add_argument("--ratio-weight", type=float, default=0.3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--data", default="data/genome")
    parser.add_argument("--eval-batches", type=int, default=0,
                        help="held-out batches of 64 windows to evaluate (0: the whole held-out split)")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    manifest = ensure_genome_shards(args.data, GenomeOptions(window=args.window))
    coding_fraction = manifest["meta"]["coding_fraction"]["train"]
    targets = region_targets(args.target_bpt, args.intergenic_ratio, coding_fraction)
    base = GeneZipConfig(
        seq_len=args.window, hidden_size=args.hidden, encoder_layers=args.encoder_layers,
        decoder_layers=args.encoder_layers, main_layers=args.main_layers, local_window=args.local_window,
        target_bpt=args.target_bpt, ratio_weight=args.ratio_weight, routing_window=args.routing_window,
        min_boundaries=args.min_boundaries, max_boundaries=args.max_boundaries,
    )
    configs = variant_configs(base, targets)
    heldout = GenomeWindows(args.data, "heldout", 64)
    print(f"train coding fraction {coding_fraction:.3f}; GeneZip targets "
          + ", ".join(f"{k} {v:.2f}" for k, v in targets.items()) + f"; others {args.target_bpt:g} everywhere")
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in args.variants}
    for seed in args.seeds:
        train_data = GenomeWindows(args.data, "train", args.batch, seed)
        for name in args.variants:
            started = time.perf_counter()
            model, losses = train(configs[name], train_data, args.steps, args.lr, seed)
            result = heldout_metrics(model, itertools.islice(heldout.ordered_batches(), args.eval_batches or None))
            result["params"] = float(sum(p.numel() for p in model.parameters()))
            result["seconds"] = time.perf_counter() - started
            rows[name].append(result)
            print(f"seed {seed} {name}: final train {bits_per_base(torch.tensor(losses[-50:]).mean()):.4f} "
                  f"bits/base, held-out {result['bits_per_base']:.4f}, {result['seconds']:.0f} s", flush=True)
    print_table(rows, configs, args)
    return 0


def print_table(rows: dict[str, list[dict[str, float]]], configs: dict[str, GeneZipConfig], args) -> None:
    def mean(name: str, key: str) -> float:
        return sum(r[key] for r in rows[name]) / len(rows[name])

    print(f"\nheld-out DNA, {len(args.seeds)} seed(s), {args.steps} steps; BPT achieved (target)")
    header = f"{'model':8} {'params':>7} {'bits/base':>9} " + " ".join(f"{'bits ' + r:>16}" for r in REGIONS)
    header += " " + " ".join(f"{'BPT ' + r:>20}" for r in REGIONS) + f" {'BPT':>6} {'floor ok':>9}"
    print(header)
    floor = args.min_boundaries
    for name in rows:
        targets = configs[name].region_targets()
        line = f"{name:8} {mean(name, 'params'):7.0f} {mean(name, 'bits_per_base'):9.4f} "
        line += " ".join(f"{mean(name, 'bits.' + r):16.4f}" for r in REGIONS) + " "
        line += " ".join(f"{mean(name, 'bpt.' + r):12.2f} ({float(targets[i]):5.2f})" for i, r in enumerate(REGIONS))
        fewest = min(r["fewest_per_window"] for r in rows[name])
        line += f" {mean(name, 'bpt'):6.2f} {'yes' if fewest >= floor else 'NO':>5} ({fewest:.0f})"
        print(line)
    if "genezip" in rows:
        for i, region in enumerate(REGIONS):
            target = float(configs["genezip"].region_targets()[i])
            off = mean("genezip", f"bpt.{region}") / target - 1
            print(f"GeneZip's {region} BPT is {off:+.1%} off its target {target:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
