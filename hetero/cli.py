"""The ``hetero`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from hetero.errors import ConfigError


def registry():
    """The registry of module kinds the commands build graphs of: the built-in kinds and the installed
    packages' (``hetero.models.default_registry()``). Assembled here, at the entry point, and passed down:
    the contract's packages never import ``hetero.models``. Other modules' commands get it as
    ``args.registry()``."""
    from hetero.models import default_registry

    return default_registry()


def _layout(args: argparse.Namespace) -> None:
    from hetero.config import load_experiment, split_config_and_overrides
    from hetero.graph import build_graph
    from hetero.parallel.rank_map import format_rank_map, rank_map
    from hetero.data import splits

    name, overrides = split_config_and_overrides(args.config)
    experiment = load_experiment(name, overrides)
    graph = build_graph(experiment, registry())
    splits.open_sources(experiment, graph)
    description = rank_map(experiment, graph.placement, {name: graph.training(name) for name in graph.nodes})
    if args.params:
        from hetero.parallel.rank_params import rank_shares

        shares = {(share.rank, share.module): share for share in rank_shares(graph)}
        for row in description["ranks"]:
            share = shares[row["rank"], row["module"]]
            row |= {"parameters": share.parameters, "checkpoint_bytes": share.checkpoint_bytes}
    print(json.dumps(description, indent=2) if args.json else format_rank_map(description))


def _launch(args: argparse.Namespace) -> int:
    """``hetero train`` and ``hetero eval``: check everything that can be checked here, then torchrun."""
    import subprocess

    from hetero.config import load_experiment, split_config_and_overrides
    from hetero.graph import build_graph
    from hetero.data import splits
    from hetero.train.job import check_trains, weights_to_evaluate

    name, overrides = split_config_and_overrides(args.config)
    selection = [f"experiment={name}"] if name else []
    experiment = load_experiment(name, overrides)
    graph = build_graph(experiment, registry())
    evaluates = args.command == "eval"
    if evaluates:
        weights_to_evaluate(experiment, graph)  # there is a checkpoint, complete, of these models
    else:
        check_trains(experiment, graph)
    splits.open_sources(experiment, graph)
    splits.prepare(experiment, graph)  # here, so that a directory holding something else stops no rank
    nproc = args.nproc or graph.placement.world_size
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        f"--max-restarts={args.max_restarts}", "-m", "hetero.train.run", *(["--eval"] if evaluates else []),
        *selection, *overrides,
    ]
    print(" ".join(command), flush=True)
    return subprocess.call(command)


BENCHMARKS = {
    "activation-compression": "hetero.bench.activation_compression",
    "balance": "hetero.bench.balance",
    "boundary": "hetero.bench.boundary",
    "compression": "hetero.bench.compression",
    "cp-attention": "hetero.bench.cp_attention",
    "data": "hetero.bench.data",
    "frozen": "hetero.bench.frozen",
    "dechunk": "hetero.bench.dechunk",
    "genezip": "hetero.bench.genezip",
    "hf-load": "hetero.bench.hf_load",
    "graph": "hetero.bench.graph",
    "moe": "hetero.bench.moe",
    "overhead": "hetero.bench.overhead",
    "packing": "hetero.bench.packing",
    "plan-accuracy": "hetero.bench.plan_accuracy",
    "qwen-tower": "hetero.bench.qwen_tower",
    "row-bytes": "hetero.bench.row_bytes",
    "scale": "hetero.bench.scale",
    "schedules": "hetero.bench.schedules",
    "sources": "hetero.bench.sources",
    "throughput": "hetero.bench.throughput",
    "video-memory": "hetero.bench.video_memory",
    "vlm": "hetero.bench.vlm",
}


def _bench(args: argparse.Namespace) -> int | None:
    import importlib

    return importlib.import_module(BENCHMARKS[args.name]).main(args.options)


def _convert(args: argparse.Namespace) -> None:
    if args.vlm:
        from hetero.interop.vlm_export import convert_vlm

        out = convert_vlm(args.checkpoint, args.out, registry())
        print(f"wrote the VLM of {args.checkpoint} to {out} (Hugging Face, the class it was imported from)")
        return
    from hetero.interop.hf_export import convert_checkpoint

    out = convert_checkpoint(args.checkpoint, args.module, args.out, registry())
    print(f"wrote {args.module} of {args.checkpoint} to {out} (Hugging Face format)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero", description=__doc__)
    parser.set_defaults(registry=registry)
    commands = parser.add_subparsers(dest="command", required=True)
    layout = commands.add_parser(
        "layout",
        help="print an experiment's rank map without starting any process",
        description="Dry run: validate an experiment and print which module runs on which rank.",
    )
    layout.add_argument(
        "config",
        nargs="*",
        metavar="CONFIG [OVERRIDE ...]",
        help="experiment name (configs/experiment/) or YAML path, then Hydra overrides like llm.layout.tp=2",
    )
    layout.add_argument("--json", action="store_true", help="print the map as JSON")
    layout.add_argument("--params", action="store_true",
                        help="also each rank's parameters and the bytes it reads from init.hf, counted on the meta "
                             "device through the real parallelization")
    layout.set_defaults(run=_layout)
    train = commands.add_parser(
        "train",
        help="train an experiment on this node (runs torchrun with the experiment's world size)",
        description="Train an experiment on one node: torchrun -m hetero.train.run with the right --nproc_per_node.",
    )
    train.add_argument("config", nargs="*", metavar="CONFIG [OVERRIDE ...]", help="as for hetero layout")
    train.add_argument("--nproc", type=int, default=0, help="processes (default: the experiment's world_size)")
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="times torchrun restarts every rank after one fails; each restart resumes from the newest checkpoint",
    )
    train.set_defaults(run=_launch)
    evaluate = commands.add_parser(
        "eval",
        help="evaluate a checkpoint on the held-out split under any layouts (runs torchrun like hetero train)",
        description="Held-out figures of a checkpoint, as a training run's evaluation prints and logs them (under "
        "<run dir>/eval): the run's newest checkpoint (train.run_dir, train.checkpoint.dir or .resume), else each "
        "module's init.checkpoint, loaded under the layouts this experiment and its overrides give. No optimizer "
        "step, no checkpoint written.",
    )
    evaluate.add_argument("config", nargs="*", metavar="CONFIG [OVERRIDE ...]", help="as for hetero layout")
    evaluate.add_argument("--nproc", type=int, default=0, help="processes (default: the experiment's world_size)")
    evaluate.set_defaults(run=_launch, max_restarts=0)
    data = commands.add_parser("data", help="inspect an experiment's data, write an example dataset or the "
                               "built-in shard sets")
    from hetero.data import digits, example, genome, inspect

    datasets = data.add_subparsers(dest="dataset", required=True)
    inspect.add_parser(datasets)
    example.add_parser(datasets)
    digits.add_parser(datasets)
    genome.add_parser(datasets)
    bench = commands.add_parser(
        "bench",
        help="run a benchmark (figures measured side by side in one run)",
        description="Run a benchmark; options after the name go to it (e.g. hetero bench overhead --steps 50).",
    )
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own options")
    bench.set_defaults(run=_bench)
    convert = commands.add_parser(
        "convert",
        help="write a module of a hetero checkpoint in Hugging Face format",
        description="Convert one module of a hetero train checkpoint (a step_* directory) to a Hugging Face "
        "checkpoint (config.json, safetensors, index). The other way needs no conversion: init.hf: PATH.",
    )
    convert.add_argument("checkpoint", help="a step_* directory written by hetero train")
    convert.add_argument("out", help="the Hugging Face checkpoint directory to write")
    convert.add_argument("--module", default="llm", help="which module (default: llm)")
    convert.add_argument("--vlm", "--llava", dest="vlm", action="store_true",
                         help="write the vit, (projector) and gpt modules as one whole VLM, a LLaVA, Qwen2.5-VL or "
                         "Qwen3-VL (modules imported from one with init.hf)")
    convert.set_defaults(run=_convert)
    from hetero.interop.tiny_llava import add_parser as add_tiny_llava
    from hetero.interop.tiny_vlm import add_parser as add_tiny_vlm
    from hetero.plan.command import add_parser as add_plan

    add_tiny_llava(commands)
    add_tiny_vlm(commands)

    add_plan(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
    except ConfigError as err:
        print(f"hetero: error: {err}", file=sys.stderr)
        return 2
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
