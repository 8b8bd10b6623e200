"""Throughput, model FLOPs and communication of one vision-language experiment, and its scaling.

    hetero bench throughput [CONFIG] [key=value ...] [--steps 10] [--warmup 3] [--peak-tflops X]
                            [--json PATH] [--wandb] [--scaling {none,weak,strong} --scales 1,2,4]

CONFIG is an experiment name or YAML path and the overrides are Hydra's, as for ``hetero layout``. Only
vision-language experiments run here (``vision`` a vit and ``llm`` a gpt, optionally ``dna`` a genezip),
with the runtime and data of ``hetero train`` (``hetero.runtime``, ``hetero.data.splits``). Started by hand, the ranks
are processes on this machine (gloo), at most 8; started by torchrun (``launch/bench.py``,
``slurm/bench.sbatch``), every process is one rank of the launched job, and ``--scaling weak|strong``
scales the experiment to the launched world size.

Measured per run, after ``--warmup`` steps: the step time (the slowest rank's time of each step, a
barrier before each; the median over the ``--steps`` timed steps), tokens/s (global batch × LLM
sequence length per step time), samples/s, model FLOPs per step per module (Megatron's per-layer
count from ``hetero.kinds.flops``: attention included, training = 3 × forward, recomputation not
counted again; GeneZip's dynamic chunking counted by torch's flop counter on one batch of real
windows), TFLOPs/s per rank (FLOPs / step time / world size) and MFU against ``--peak-tflops`` (the
declared per-rank peak; without it, the GPU's dense bf16 datasheet peak from ``device_peaks``, and n/a on
CPU or an unlisted GPU). Bytes per step per communicator (world-summed, as
``hetero train`` logs them): the boundary per edge and direction, the LLM's stage edges and each
module's gradient sync, from the counters over the timed steps, plus DTensor's own collectives (tensor
parallelism, loss parallelism, the sharded gradient norm), which those counters do not see: counted in
one extra, untimed step under a dispatch mode, per group and collective, as wire bytes (the ring
algorithm's, as the gradient syncs count theirs).

Scaling (``--scaling weak|strong``): scale k multiplies world_size, each module's layout.dp,
layout.offset and layout.size (when set) by k; weak scaling also multiplies the global batch by k.
Speedup is tokens/s over the smallest scale's, efficiency the speedup over the ratio of scales (for
strong scaling that is the step-time speedup over k; for weak, tokens/s per rank relative to the base).
On this 2-core machine every rank shares the same cores: the figures measure overheads, not a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetero.bench.device_peaks import local_device_peak_tflops
from hetero.config import ExperimentConfig, load_experiment
from hetero.graph import build_graph
from hetero.errors import ConfigError
from hetero.kinds.flops import TRAINING_MULTIPLIER, counted_forward_flops
from hetero.models import default_registry
from hetero.parallel.layout import format_ranks
from hetero.parallel.placement import Placement, infer_world_size

SUPPORTED = {"vision": "vit", "llm": "gpt", "dna": "genezip"}  # dna is optional
SCALING_MODES = ("none", "weak", "strong")
MAX_RANKS = 8  # hetero.testing.multiprocess runs 1 to 8 ranks


# ----------------------------------------------------------------------------------------------------
# Pure parts: what runs, the FLOPs, the scaled overrides.


def check_supported(experiment: ExperimentConfig) -> None:
    """ConfigError unless the experiment is a vision-language model this benchmark can run."""
    kinds = {name: module.kind for name, module in experiment.modules.items()}
    wanted = {name: kind for name, kind in SUPPORTED.items() if name != "dna" or name in kinds}
    if kinds != wanted:
        found = ", ".join(f"{name} ({kind})" for name, kind in kinds.items()) or "none"
        raise ConfigError(
            f"{experiment.name}: hetero bench throughput runs vision-language experiments only: modules vision "
            f"(kind vit) and llm (kind gpt), optionally dna (kind genezip), e.g. colocated_vlm or dna_vlm; this "
            f"experiment has {found}"
        )


def scaled_overrides(experiment: ExperimentConfig, k: int, mode: str) -> list[str]:
    """Hydra overrides that scale ``experiment`` k-fold: world_size, each module's layout.dp, layout.offset
    and layout.size (when set) times k; ``weak`` also multiplies batch.global_batch_size by k, ``strong``
    keeps it. A module placed by an explicit ``layout.ranks`` list cannot be scaled (ConfigError)."""
    if mode not in ("weak", "strong"):
        raise ConfigError(f"--scaling {mode!r}: scaled overrides exist for weak and strong scaling only")
    if k < 1:
        raise ConfigError(f"scale {k} must be >= 1")
    listed = [name for name, module in experiment.modules.items() if module.layout.ranks is not None]
    if listed:
        raise ConfigError(
            f"{', '.join(f'{n}.layout.ranks' for n in listed)}: a module placed by an explicit rank list cannot "
            f"be scaled; place it with {listed[0]}.layout.offset (and .size or .dp) instead"
        )
    world = experiment.world_size
    if world is None:
        world = infer_world_size({name: module.layout for name, module in experiment.modules.items()})
    overrides = [f"++world_size={k * world}"]
    for name, module in experiment.modules.items():
        layout = module.layout
        if layout.dp is not None:
            overrides.append(f"++{name}.layout.dp={k * layout.dp}")
        if layout.offset:
            overrides.append(f"++{name}.layout.offset={k * layout.offset}")
        if layout.size is not None:
            overrides.append(f"++{name}.layout.size={k * layout.size}")
    if mode == "weak":
        overrides.append(f"++batch.global_batch_size={k * experiment.batch.global_batch_size}")
    return overrides


def model_flops(experiment: ExperimentConfig, dna_forward_per_sample: float | None = None) -> dict[str, float]:
    """Model FLOPs of one training step per module (each kind's closed form, ``Kind.forward_flops``, per
    sample), and their ``total``. ``dna_forward_per_sample``: the DNA module's counted forward FLOPs per
    sample (no closed form; see ``dna_forward_flops_per_sample``)."""
    batch = experiment.batch.global_batch_size
    kinds = default_registry()
    flops = {}
    for name, module in experiment.modules.items():
        forward = kinds[module.kind].forward_flops(experiment.model_config(name, kinds))
        if forward is None and name == "dna":
            if dna_forward_per_sample is None:
                raise ValueError("a dna module needs its counted forward FLOPs per sample")
            forward = dna_forward_per_sample
        if forward is None:
            raise ValueError(f"{name}: a {module.kind} module has no closed form of its FLOPs")
        flops[name] = TRAINING_MULTIPLIER * forward * batch
    flops["total"] = sum(flops.values())
    return flops


def dna_forward_flops_per_sample(experiment: ExperimentConfig) -> float:
    """GeneZip's forward FLOPs per window, counted on the first training batch of real windows with the
    runtime's initial weights (dynamic chunking makes the count depend on both)."""
    from hetero.models.genezip.model import GeneZip
    from hetero.data.splits import load

    windows = load(experiment, build_graph(experiment, default_registry()), "train").batch(0)["dna"]
    with torch.random.fork_rng():
        torch.manual_seed(experiment.seed + list(experiment.modules).index("dna"))  # the runtime's seed for it
        model = GeneZip(experiment.model_config("dna", default_registry()))
    return counted_forward_flops(model, windows) / windows.shape[0]


# ----------------------------------------------------------------------------------------------------
# On the ranks.


def measure(rank: int, world_size: int, experiment: ExperimentConfig, steps: int, warmup: int) -> dict[str, Any]:
    """One rank's run: its step times, the world's bytes per communicator over the timed steps, and the
    world's DTensor collectives in one more step."""
    from hetero.bench.dtensor_collectives import DTensorCollectives, dtensor_owners
    from hetero.runtime import build_runtime
    from hetero.data.splits import load_splits
    from hetero.train.job import communicator_bytes

    trainer = build_runtime(experiment, default_registry())
    meshes = {name: module.mesh for name, module in trainer.modules.items()}
    data = load_splits(experiment, trainer.graph, ("train",))
    reuse = experiment.train.sample_reuse
    times, before = [], {}
    for step in range(warmup + steps):
        if step == warmup:
            before = communicator_bytes(trainer)
        batch = data["train"].batch(step // reuse)
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    after = communicator_bytes(trainer)
    batch = data["train"].batch((warmup + steps) // reuse)
    dist.barrier()
    with DTensorCollectives(dtensor_owners(experiment, meshes)) as counter:
        trainer.train_step(batch)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, counter.counts)
    collectives: dict[str, dict[str, dict[str, int]]] = {}
    for counts in gathered:
        for label, kinds in counts.items():
            for kind, entry in kinds.items():
                total = collectives.setdefault(label, {}).setdefault(kind, {"calls": 0, "bytes": 0})
                total["calls"] += entry["calls"]
                total["bytes"] += entry["bytes"]
    return {
        "times": times,
        "bytes": {name: (after[name] - before[name]) / steps for name in after},
        "collectives": {label: dict(sorted(kinds.items())) for label, kinds in sorted(collectives.items())},
    }


# ----------------------------------------------------------------------------------------------------
# The driver.


def absolute_paths(experiment: ExperimentConfig) -> ExperimentConfig:
    """The same experiment with its data and run folders absolute (ranks may start in another folder)."""
    cfg = experiment.train
    train = replace(cfg, **{key: str(Path(getattr(cfg, key)).resolve()) for key in ("data_dir", "genome_dir", "clip_dir", "run_dir")})
    return replace(experiment, train=train)


def ensure_shards(experiment: ExperimentConfig) -> None:
    from hetero.data.splits import prepare

    prepare(experiment, build_graph(experiment, default_registry()))


def _layouts(placement: Placement) -> dict[str, dict[str, Any]]:
    return {
        name: {axis: getattr(layout, axis) for axis in ("tp", "cp", "dp", "pp")} | {"ranks": list(layout.ranks)}
        for name, layout in placement.layouts.items()
    }


def summarize(
    experiment: ExperimentConfig, placement: Placement, per_rank: list[dict[str, Any]], flops: dict[str, float],
    peak_tflops: float | None,
) -> dict[str, Any]:
    """One run's figures from every rank's measurements."""
    step_times = [max(times) for times in zip(*(r["times"] for r in per_rank))]
    step_s = statistics.median(step_times)
    world = placement.world_size
    batch = experiment.batch.global_batch_size
    seq_len = experiment.model_config("llm", default_registry()).seq_len
    tflops = flops["total"] / step_s / world / 1e12
    measured = per_rank[0]
    dtensor = {label: sum(e["bytes"] for e in kinds.values()) for label, kinds in measured["collectives"].items()}
    return {
        "world_size": world,
        "layouts": _layouts(placement),
        "global_batch_size": batch,
        "seq_len": seq_len,
        "tokens_per_step": batch * seq_len,
        "step_s": step_s,
        "step_s_per_step": step_times,
        "tokens_per_s": batch * seq_len / step_s,
        "samples_per_s": batch / step_s,
        "model_flops_per_step": flops,
        "tflops_per_s_per_rank": tflops,
        "peak_tflops_per_rank": peak_tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "bytes_per_step": measured["bytes"] | dtensor,
        "dtensor_collectives_per_step": measured["collectives"],
    }


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"


def format_run(run: dict[str, Any]) -> str:
    """One run as a readable two-column table."""
    layouts = " | ".join(
        f"{name} tp{l['tp']}·cp{l['cp']}·dp{l['dp']}·pp{l['pp']} on ranks {format_ranks(l['ranks'])}"
        for name, l in run["layouts"].items()
    )
    flops = " | ".join(f"{name} {_flops(value)}" for name, value in run["model_flops_per_step"].items())
    mfu = (
        f"{run['mfu'] * 100:.2f}% of {run['peak_tflops_per_rank']:g} TFLOP/s"
        if run["mfu"] is not None
        else "n/a (declare the per-rank peak with --peak-tflops; GPUs in bench/device_peaks.py are looked up)"
    )
    rows = [
        ("layouts", layouts),
        ("global batch", f"{run['global_batch_size']} samples × {run['seq_len']} tokens"),
        ("step time", f"{run['step_s'] * 1e3:.1f} ms (median of {len(run['step_s_per_step'])} steps, slowest rank)"),
        ("tokens/s", f"{run['tokens_per_s']:.0f} ({run['tokens_per_s'] / run['world_size']:.0f} per rank)"),
        ("samples/s", f"{run['samples_per_s']:.1f}"),
        ("model FLOPs/step", flops),
        ("TFLOP/s per rank", f"{run['tflops_per_s_per_rank']:.4g}"),
        ("MFU", mfu),
    ]
    rows += [(f"bytes/step {name}", _size(value)) for name, value in run["bytes_per_step"].items()]
    for label, kinds in run["dtensor_collectives_per_step"].items():
        shown = ", ".join(f"{kind} ×{e['calls']} ({_size(e['bytes'])})" for kind, e in kinds.items())
        rows.append((f"collectives {label}", shown))
    width = max(len(key) for key, _ in rows)
    title = f"{run['config']} ({run['world_size']} ranks" + (f", scale {run['scale']}" if run["scaling"] != "none" else "")
    title += f"; {run['steps']} timed steps after {run['warmup']} warmup)"
    return "\n".join([title] + [f"  {key:<{width}}  {value}" for key, value in rows])


def add_scaling(runs: list[dict[str, Any]]) -> None:
    """Speedup (tokens/s over the smallest scale's) and efficiency (speedup over the scale ratio)."""
    base = min(runs, key=lambda run: run["scale"])
    for run in runs:
        speedup = run["tokens_per_s"] / base["tokens_per_s"]
        run["speedup"] = speedup
        run["scaling_efficiency"] = speedup * base["scale"] / run["scale"]


def format_scaling(runs: list[dict[str, Any]]) -> str:
    mode = runs[0]["scaling"]
    meaning = "step-time speedup / scale" if mode == "strong" else "tokens/s per rank relative to the base scale"
    lines = [
        f"{mode} scaling of {runs[0]['config']} (efficiency: {meaning})",
        f"{'scale':>5} {'ranks':>5} {'batch':>6} {'step ms':>9} {'tokens/s':>10} {'tok/s/rank':>10} "
        f"{'TFLOP/s/rank':>12} {'speedup':>8} {'efficiency':>10}",
    ]
    for run in runs:
        lines.append(
            f"{run['scale']:>5} {run['world_size']:>5} {run['global_batch_size']:>6} {run['step_s'] * 1e3:9.1f} "
            f"{run['tokens_per_s']:10.0f} {run['tokens_per_s'] / run['world_size']:10.0f} "
            f"{run['tflops_per_s_per_rank']:12.4g} {run['speedup']:8.2f} {run['scaling_efficiency']:10.2f}"
        )
    return "\n".join(lines)


def _flat(prefix: str, value: Any) -> dict[str, float]:
    """Numbers of a nested dict as ``a/b/c`` keys (wandb's summary)."""
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for key, inner in value.items():
            out |= _flat(f"{prefix}/{key}" if prefix else str(key), inner)
        return out
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {}
    return {prefix: value}


def log_wandb(experiment: ExperimentConfig, runs: list[dict[str, Any]], options: dict[str, Any]) -> Path:
    """An offline wandb run under ``train.run_dir/<experiment>/bench-throughput`` whose summary holds every
    run's figures (prefixed ``scale<k>/`` in scaling mode; each scale also logged as one step)."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    import wandb

    folder = Path(experiment.train.run_dir) / experiment.name / "bench-throughput"
    folder.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=experiment.train.wandb_project, name=f"{experiment.name}-throughput", job_type="bench-throughput",
        dir=str(folder), mode="offline", config={"experiment": asdict(experiment), "bench": options},
    )
    try:
        for step, figures in enumerate(runs):
            flat = _flat("", {k: v for k, v in figures.items() if k not in ("layouts", "step_s_per_step")})
            run.log(flat, step=step)
            run.summary.update(flat if len(runs) == 1 else {f"scale{figures['scale']}/{k}": v for k, v in flat.items()})
        return Path(run.dir).parent
    finally:
        run.finish()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero bench throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config", nargs="*", metavar="CONFIG [OVERRIDE ...]", help="as for hetero layout")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="declared peak TFLOP/s of one rank (for MFU)")
    parser.add_argument("--json", type=Path, default=None, help="write the runs' figures to this file (a JSON list)")
    parser.add_argument("--wandb", action="store_true", help="log the figures to an offline wandb run under train.run_dir")
    parser.add_argument("--scaling", choices=SCALING_MODES, default="none", help="weak or strong scaling sweep")
    parser.add_argument("--scales", default="1,2,4", help="scales of a sweep, comma-separated (default 1,2,4)")
    return parser


def _scales(text: str) -> list[int]:
    try:
        scales = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--scales {text!r}: give positive integers separated by commas, e.g. 1,2,4") from None
    if not scales or scales[0] < 1:
        raise ConfigError(f"--scales {text!r}: give positive integers separated by commas, e.g. 1,2,4")
    return scales


def main(argv: list[str] | None = None) -> int:
    from hetero.config import split_config_and_overrides
    from hetero.testing.multiprocess import run_ranks

    args = build_parser().parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak-tflops {args.peak_tflops} must be > 0")
    name, overrides = split_config_and_overrides(args.config)
    base = load_experiment(name, overrides)
    check_supported(base)
    build_graph(base, default_registry()).placement
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one rank of the job
        return _main_launched(args, name, overrides, base)
    scales = [1] if args.scaling == "none" else _scales(args.scales)
    plans = []  # every scale's experiment, validated before anything runs
    for k in scales:
        extra = [] if args.scaling == "none" else scaled_overrides(base, k, args.scaling)
        try:
            experiment = load_experiment(name, [*overrides, *extra]) if extra else base
            check_supported(experiment)
            placement = build_graph(experiment, default_registry()).placement
        except ConfigError as err:
            raise ConfigError(f"{args.scaling} scaling, scale {k} ({' '.join(extra)}):\n{err}") from None
        if placement.world_size > MAX_RANKS:
            raise ConfigError(
                f"scale {k}: world_size={placement.world_size}, but this benchmark runs at most {MAX_RANKS} ranks "
                f"as processes on this machine; use smaller scales"
            )
        plans.append((k, [*overrides, *extra], absolute_paths(experiment), placement))
    runs = []
    for k, run_overrides, experiment, placement in plans:
        ensure_shards(experiment)
        budget = 120 + (args.warmup + args.steps + 1) * 60
        per_rank = run_ranks(
            measure, placement.world_size, experiment, args.steps, args.warmup,
            timeout_s=budget, collective_timeout_s=experiment.timeout_s,
        )
        runs.append(_record(args, name or base.name, run_overrides, k, experiment, placement, per_rank))
        print(format_run(runs[-1]), flush=True)
    if args.scaling != "none":
        add_scaling(runs)
        print(format_scaling(runs), flush=True)
    _write(args, runs, plans[0][2])
    return 0


def _record(args: argparse.Namespace, config: str, overrides: list[str], scale: int, experiment: ExperimentConfig,
            placement: Placement, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    dna = dna_forward_flops_per_sample(experiment) if "dna" in experiment.modules else None
    peak, device = local_device_peak_tflops()
    peak, source = (args.peak_tflops, "--peak-tflops") if args.peak_tflops is not None else (peak, f"{device} (datasheet)")
    return {
        "benchmark": "throughput", "config": config, "experiment": experiment.name, "overrides": overrides,
        "scaling": args.scaling, "scale": scale, "steps": args.steps, "warmup": args.warmup,
        "peak_source": source if peak else None,
    } | summarize(experiment, placement, per_rank, model_flops(experiment, dna), peak)


def _main_launched(args: argparse.Namespace, name: str, overrides: list[str], base: ExperimentConfig) -> int:
    """Under torchrun (one process per rank, on one node or many, e.g. slurm/bench.sbatch): join the
    launched world; with ``--scaling weak|strong`` a base experiment scales to it when the launched world
    is a multiple of the base's. Rank 0 reports."""
    from hetero.parallel.mesh import init_distributed

    launched = int(os.environ["WORLD_SIZE"])
    base_world = build_graph(base, default_registry()).placement.world_size
    extra: list[str] = []
    if launched != base_world:
        if args.scaling == "none" or launched % base_world:
            raise ConfigError(
                f"torchrun started {launched} ranks but {base.name} runs on world_size={base_world}; pass "
                f"--scaling weak|strong to scale it to the launched world (a multiple of {base_world}), or set "
                f"world_size and the layouts to match"
            )
        extra = scaled_overrides(base, launched // base_world, args.scaling)
    experiment = absolute_paths(load_experiment(name, [*overrides, *extra]))
    check_supported(experiment)
    placement = build_graph(experiment, default_registry()).placement
    rank = init_distributed(placement, experiment.backend, experiment.timeout_s)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # each node writes its own copy of the shards
        ensure_shards(experiment)
    dist.barrier()
    result = measure(rank, launched, experiment, args.steps, args.warmup)
    per_rank: list[Any] = [None] * launched
    dist.all_gather_object(per_rank, result)
    if rank == 0:
        run = _record(args, name or base.name, [*overrides, *extra], launched // base_world, experiment, placement,
                      per_rank)
        print(format_run(run), flush=True)
        _write(args, [run], experiment)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _write(args: argparse.Namespace, runs: list[dict[str, Any]], experiment: ExperimentConfig) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs, indent=2) + "\n")
        print(f"wrote {args.json}", flush=True)
    if args.wandb:
        options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        folder = log_wandb(experiment, runs, options)
        print(f"wandb offline run: {folder}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
