"""GeneZip against H-Net with one ratio target and against fixed-stride chunking, on held-out real DNA.

    hetero bench genezip [--steps 600] [--target-bpt 4] [--intergenic-ratio 2] [--sweep 1.5 3] [--seeds 0 1]
                         [--jobs 2]

Data: a bacterial chromosome that ships in pyrodigal's wheel, coding/intergenic labels from pyrodigal's gene
calls (``hetero.data.genome``); the last 10% of the chromosome is held out. Its shards are the set of
``--window`` bases in ``--data``/window<N>, where ``hetero train`` keeps its own (``train.genome_dir``): a
set already there is reused, whichever command wrote it. Three models with the same
blocks, steps, batches and seed, at the same average bases per token (BPT):

- ``genezip``: dynamic chunking with the Region-Aware Ratio: intergenic DNA aims at ``--intergenic-ratio``
  times the coding target, the two chosen so the training windows average ``--target-bpt``;
- ``hnet``: dynamic chunking with ``--target-bpt`` everywhere (H-Net's single ratio), as wide as
  ``--hnet-hidden``: by default the width nearest GeneZip's parameter count, which its region classifier raises;
- ``fixed``: a token every ``--target-bpt`` bases (no router).

Annotations enter only GeneZip's training (its ratio loss and its region budget's classifier); evaluation
routes raw DNA. Reported on every
held-out window, as mean ± std over seeds: bits per base of next-base prediction (overall and per region),
the achieved BPT per region against its target, and the fewest chunk starts in any routing window and any
sequence (the floor is ``--min-boundaries`` per window of ``--routing-window`` bases); then GeneZip against
H-Net paired by seed: the differences in bits/base, their mean ± std, the average BPTs' difference,
parameters and seconds. Each of those comes twice: as trained, and at equal rate, where each dynamic model
routes the held-out DNA at exactly ``--target-bpt`` on average (one log-odds shift of its router found on the
held-out bases, no labels: ``hetero.models.genezip.rate``). The targets sweep
trains GeneZip alone at each ``--sweep`` intergenic/coding ratio (the same average BPT, every seed) and
reports each region's achieved BPT against its target. ``--jobs`` trains that many models at once, one
process each with the cores divided evenly (the runs are independent).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import torch

from hetero.data.genome import REGIONS, GenomeOptions, GenomeWindows, ensure_genome_shards, genome_shards
from hetero.data.shards import ShardError
from hetero.errors import ConfigError
from hetero.models.genezip.model import GeneZip
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.objectives import bits_per_base, genezip_loss, heldout_metrics
from hetero.models.genezip.rate import matched_rate_shift
from hetero.parallel.layout import Layout

VARIANTS = ("genezip", "hnet", "fixed")


def region_targets(average: float, intergenic_ratio: float, coding_fraction: float) -> dict[str, float]:
    """Per-region BPT with intergenic = ratio × coding whose token count matches ``average`` everywhere:
    coding_fraction / N_c + (1 - coding_fraction) / (ratio · N_c) = 1 / average."""
    coding = average * (coding_fraction + (1 - coding_fraction) / intergenic_ratio)
    return {"intergenic": coding * intergenic_ratio, "coding": coding}


def variant_configs(base: GeneZipConfig, targets: dict[str, float], hnet_hidden: int) -> dict[str, GeneZipConfig]:
    """Each variant's config; ``hnet_hidden`` 0 widens H-Net to GeneZip's parameter count (``matched_width``)."""
    genezip = replace(base, region_bpt=targets)
    hnet = replace(base, region_bpt={})
    hnet = replace(hnet, hidden_size=hnet_hidden or matched_width(hnet, parameter_count(genezip)))
    configs = {"genezip": genezip, "hnet": hnet, "fixed": replace(base, routing="fixed", region_bpt={})}
    for name, config in configs.items():
        errors = config.errors(name, Layout(tp=1, cp=1, dp=1, pp=1, ranks=(0,)))
        if errors:
            raise ConfigError("; ".join(errors))
    return configs


def parameter_count(config: GeneZipConfig) -> int:
    return sum(p.numel() for p in GeneZip(config).parameters())


def matched_width(config: GeneZipConfig, params: int) -> int:
    """The hidden width whose parameter count is nearest ``params``, in steps of twice the head count (so each
    head stays even for the rotary embedding); ties go to the wider model."""
    step = 2 * config.num_heads
    width, best = step, None
    while True:
        count = parameter_count(replace(config, hidden_size=width))
        if best is None or abs(count - params) <= abs(best[1] - params):
            best = (width, count)
        if count >= params:
            return best[0]
        width += step


def train(config: GeneZipConfig, data: GenomeWindows, steps: int, lr: float, seed: int) -> tuple[GeneZip, list[float]]:
    torch.manual_seed(seed)
    model = GeneZip(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = 0.1 * steps
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=warmup / steps)
    losses = []
    for step in range(steps):
        decay = 1.0 if step < warmup else schedule.get_last_lr()[0] / lr  # as OptimizerConfig.decay_at
        batch = data.batch(step)
        output = model(batch["bases"])
        loss = genezip_loss(config, output, batch["bases"], batch["regions"])
        optimizer.zero_grad()
        loss.total(config).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if model.budget is not None:
            statistics = model.budget.statistics(output.region_logits, output.routings[0].boundary, batch["regions"])
            model.budget.update(statistics, decay)
        losses.append(float(loss.prediction.detach().mean()))
    return model, losses


@dataclass(frozen=True)
class Run:
    """One model to train and evaluate: a variant at an intergenic/coding ratio, from one seed."""

    name: str
    ratio: float
    seed: int
    config: GeneZipConfig


def train_and_evaluate(run: Run, args: argparse.Namespace, threads: int) -> dict:
    """Held-out metrics as trained, and under ``"matched"`` at the average ``--target-bpt`` (with the shift)."""
    torch.set_num_threads(threads)
    train_data = GenomeWindows(args.data, "train", args.batch, run.seed)
    heldout = GenomeWindows(args.data, "heldout", 64)
    batches = lambda: itertools.islice(heldout.ordered_batches(), args.eval_batches or None)  # noqa: E731
    started = time.perf_counter()
    model, losses = train(run.config, train_data, args.steps, args.lr, run.seed)
    result = heldout_metrics(model, batches())
    result["params"] = float(sum(p.numel() for p in model.parameters()))
    result["seconds"] = time.perf_counter() - started
    if run.config.routing == "fixed":  # its rate is its stride
        result["matched"] = dict(result, shift=0.0)
    else:
        shift = matched_rate_shift(model, batches(), args.target_bpt)
        result["matched"] = heldout_metrics(model, batches(), shift) | {
            "shift": shift, "params": result["params"], "seconds": result["seconds"]}
    result["train_bits_per_base"] = float(bits_per_base(torch.tensor(losses[-50:]).mean()))
    if model.budget is not None:
        result["bias"] = model.budget.bias.tolist()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero bench genezip", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=512, help="bases per sequence")
    parser.add_argument("--target-bpt", type=float, default=4.0, help="average bases per token of every model")
    parser.add_argument("--intergenic-ratio", type=float, default=2.0,
                        help="GeneZip's intergenic BPT target over its coding target")
    parser.add_argument("--sweep", type=float, nargs="*", default=[1.5, 3.0],
                        help="further intergenic/coding ratios at which GeneZip alone trains")
    parser.add_argument("--routing-window", type=int, default=64)
    parser.add_argument("--min-boundaries", type=int, default=4, help="the routing floor per routing window")
    parser.add_argument("--max-boundaries", type=int, default=0, help="the routing ceiling (0: none)")
    parser.add_argument("--hidden", type=int, default=64, help="width of GeneZip and of the fixed-stride model")
    parser.add_argument("--hnet-hidden", type=int, default=0,
                        help="H-Net's width (0: the one nearest GeneZip's parameter count)")
    parser.add_argument("--encoder-layers", type=int, default=2, help="per stage, as decoder layers")
    parser.add_argument("--main-layers", type=int, default=2)
    parser.add_argument("--local-window", type=int, default=64)
    parser.add_argument("--ratio-weight", type=float, default=0.3)
    parser.add_argument("--region-channels", type=int, default=GeneZipConfig.region_channels,
                        help="width of GeneZip's region classifier")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--jobs", type=int, default=1, help="models trained at once, one process each")
    parser.add_argument("--data", default="data/genome",
                        help="genome shard sets, one per window length under it (as train.genome_dir)")
    parser.add_argument("--eval-batches", type=int, default=0,
                        help="held-out batches of 64 windows to evaluate (0: the whole held-out split)")
    args = parser.parse_args(argv)

    args.data = genome_shards(args.data, args.window)
    try:
        manifest = ensure_genome_shards(args.data, GenomeOptions(window=args.window))
    except (FileExistsError, ShardError) as err:
        raise ConfigError(f"--data: {err}") from err
    coding_fraction = manifest["meta"]["coding_fraction"]["train"]
    base = GeneZipConfig(
        seq_len=args.window, hidden_size=args.hidden, encoder_layers=args.encoder_layers,
        decoder_layers=args.encoder_layers, main_layers=args.main_layers, local_window=args.local_window,
        target_bpt=args.target_bpt, ratio_weight=args.ratio_weight, routing_window=args.routing_window,
        min_boundaries=args.min_boundaries, max_boundaries=args.max_boundaries, region_channels=args.region_channels,
    )
    targets = region_targets(args.target_bpt, args.intergenic_ratio, coding_fraction)
    configs = variant_configs(base, targets, args.hnet_hidden)
    print(f"train coding fraction {coding_fraction:.3f}; GeneZip targets "
          + ", ".join(f"{k} {v:.2f}" for k, v in targets.items()) + f"; others {args.target_bpt:g} everywhere; "
          f"H-Net {configs['hnet'].hidden_size} wide")
    runs = [Run(name, args.intergenic_ratio, seed, configs[name]) for seed in args.seeds for name in args.variants]
    runs += [Run("genezip", ratio, seed, replace(base, region_bpt=region_targets(args.target_bpt, ratio, coding_fraction)))
             for ratio in args.sweep if ratio != args.intergenic_ratio for seed in args.seeds]
    results = run_all(runs, args)
    rows = {name: [result for run, result in zip(runs, results) if run.name == name and run.ratio == args.intergenic_ratio]
            for name in args.variants}
    equal_rate = f"at equal rate (each dynamic model shifted to {args.target_bpt:g} bases per token on the held-out DNA)"
    for title, key in (("as trained", None), (equal_rate, "matched")):
        chosen = {name: [result[key] if key else result for result in results] for name, results in rows.items()}
        print_table(title, chosen, configs, args)
        if {"genezip", "hnet"} <= set(args.variants):
            print_paired(chosen["genezip"], chosen["hnet"], args.seeds)
    if "genezip" in args.variants:
        print_sweep(runs, results, args)
    return 0


def run_all(runs: list[Run], args: argparse.Namespace) -> list[dict]:
    """Every run's held-out metrics in order, ``args.jobs`` at a time, each printed as it ends."""
    jobs = max(1, min(args.jobs, len(runs)))
    threads = max(1, (os.cpu_count() or 1) // jobs)

    def report(run: Run, result: dict) -> None:
        print(f"seed {run.seed} {run.name} (ratio {run.ratio:g}): final train {result['train_bits_per_base']:.4f} "
              f"bits/base, held-out {result['bits_per_base']:.4f}, BPT intergenic {result['bpt.intergenic']:.2f} "
              f"coding {result['bpt.coding']:.2f}"
              + (", router bias intergenic {:+.2f} coding {:+.2f}".format(*result["bias"]) if "bias" in result else "")
              + f", {result['seconds']:.0f} s; at BPT {args.target_bpt:g} (shift {result['matched']['shift']:+.3f}): "
              f"held-out {result['matched']['bits_per_base']:.4f}", flush=True)

    results = []
    if jobs == 1:
        for run in runs:
            results.append(train_and_evaluate(run, args, threads))
            report(run, results[-1])
        return results
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(train_and_evaluate, run, args, threads) for run in runs]
        for run, future in zip(runs, futures):
            results.append(future.result())
            report(run, results[-1])
    return results


def spread(values: list[float], digits: int) -> str:
    """``mean ± std`` over seeds (the sample std; just the mean for one seed)."""
    mean = statistics.fmean(values)
    return f"{mean:.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def print_table(title: str, rows: dict[str, list[dict[str, float]]], configs: dict[str, GeneZipConfig], args) -> None:
    print(f"\n{title}: held-out DNA, {len(args.seeds)} seed(s), {args.steps} steps; mean ± std over seeds; "
          "BPT achieved (target)")
    header = f"{'model':8} {'params':>7} {'bits/base':>17} " + " ".join(f"{'bits ' + r:>17}" for r in REGIONS)
    header += " " + " ".join(f"{'BPT ' + r:>22}" for r in REGIONS) + f" {'BPT':>13} {'floor ok':>9}"
    print(header)
    floor = args.min_boundaries
    for name, results in rows.items():
        targets = configs[name].region_targets()
        column = lambda key, digits: spread([r[key] for r in results], digits)  # noqa: E731
        line = f"{name:8} {results[0]['params']:7.0f} {column('bits_per_base', 4):>17} "
        line += " ".join(f"{column('bits.' + r, 4):>17}" for r in REGIONS) + " "
        line += " ".join(f"{column('bpt.' + r, 2):>14} ({float(targets[i]):5.2f})" for i, r in enumerate(REGIONS))
        fewest = min(r["fewest_per_window"] for r in results)
        line += f" {column('bpt', 2):>13} {'yes' if fewest >= floor else 'NO':>5} ({fewest:.0f})"
        print(line)
    if "shift" in next(iter(rows.values()))[0]:
        for name, results in rows.items():
            print(f"{name}'s log-odds shift per seed: " + ", ".join(f"{r['shift']:+.3f}" for r in results))
    if "genezip" in rows:
        for i, region in enumerate(REGIONS):
            target = float(configs["genezip"].region_targets()[i])
            offs = [r[f"bpt.{region}"] / target - 1 for r in rows["genezip"]]
            print(f"GeneZip's {region} BPT is off its target {target:.2f} by "
                  + ", ".join(f"{off:+.1%}" for off in offs) + " (per seed)")


def print_paired(genezip: list[dict[str, float]], hnet: list[dict[str, float]], seeds: list[int]) -> None:
    """GeneZip against H-Net seed by seed (a seed gives both the same training batches): the differences,
    their mean ± std, and whether GeneZip's held-out bits/base is at most H-Net's + half the paired std."""
    print(f"\nGeneZip - H-Net, paired by seed ({', '.join(map(str, seeds))}); mean ± std")
    for key in ("bits_per_base", *(f"bits.{r}" for r in REGIONS)):
        differences = [g[key] - h[key] for g, h in zip(genezip, hnet)]
        print(f"{key:>16}: " + ", ".join(f"{d:+.4f}" for d in differences) + f"; {spread(differences, 4)}")
    ratios = [g["bpt"] / h["bpt"] - 1 for g, h in zip(genezip, hnet)]
    print(f"{'average BPT':>16}: GeneZip's off H-Net's by " + ", ".join(f"{r:+.1%}" for r in ratios))
    print(f"{'parameters':>16}: {genezip[0]['params']:.0f} / {hnet[0]['params']:.0f} "
          f"({genezip[0]['params'] / hnet[0]['params']:.2f}x); seconds {statistics.fmean(g['seconds'] for g in genezip):.0f} "
          f"/ {statistics.fmean(h['seconds'] for h in hnet):.0f} a model")
    differences = [g["bits_per_base"] - h["bits_per_base"] for g, h in zip(genezip, hnet)]
    if len(differences) > 1:
        mean, std = statistics.fmean(differences), statistics.stdev(differences)
        print(f"GeneZip's bits/base at most H-Net's + 0.5 x the paired std: {'yes' if mean <= 0.5 * std else 'no'} "
              f"({mean:+.4f} against {0.5 * std:.4f})")


def print_sweep(runs: list[Run], results: list[dict[str, float]], args) -> None:
    ratios = sorted({run.ratio for run in runs if run.name == "genezip"})
    print(f"\nGeneZip's targets sweep at average BPT {args.target_bpt:g}, mean over {len(args.seeds)} seed(s): "
          "achieved (target), off")
    print(f"{'ratio':>5} " + " ".join(f"{'BPT ' + r:>30}" for r in REGIONS) + f" {'BPT':>6} {'bits/base':>9}")
    for ratio in ratios:
        swept = [(run, result) for run, result in zip(runs, results) if run.name == "genezip" and run.ratio == ratio]
        chosen, targets = [result for _, result in swept], swept[0][0].config.region_targets()
        line = f"{ratio:5g} "
        for i, region in enumerate(REGIONS):
            achieved = statistics.fmean(r[f"bpt.{region}"] for r in chosen)
            line += f"{achieved:>14.2f} ({float(targets[i]):5.2f}) {achieved / float(targets[i]) - 1:+7.1%} "
        line += f"{statistics.fmean(r['bpt'] for r in chosen):6.2f} {statistics.fmean(r['bits_per_base'] for r in chosen):9.4f}"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
