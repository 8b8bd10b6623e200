"""``hetero plan``: choose per-module layouts and a placement for a cluster, before renting it.

    hetero plan --cluster h100_64 vlm_7b --contexts 4096,16384,65536,131072 --plot plan.png
    hetero plan --calibrate this-machine.yaml              # measure this machine's constants
    hetero plan --cluster this-machine.yaml colocated_vlm --as-configured
"""

from __future__ import annotations

import dataclasses

import argparse
import json
from pathlib import Path

from hetero.errors import ConfigError


def add_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="search per-module layouts and placements with a cost model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("config", nargs="*", metavar="CONFIG [OVERRIDE ...]", help="as for hetero layout")
    plan.add_argument("--cluster", help="cluster YAML (or a shipped name in configs/cluster/)")
    plan.add_argument("--calibrate", metavar="OUT.yaml", help="measure this machine and write its cluster YAML")
    plan.add_argument("--ranks", type=int, default=2, help="--calibrate: ranks measuring at once (default 2)")
    plan.add_argument("--contexts", default="", help="LLM context lengths to plan for, e.g. 4096,32768")
    plan.add_argument("--tokens-per-step", type=int, default=0, help="tokens per step (default: the config's)")
    plan.add_argument(
        "--extra-context", choices=("images", "mixed"), default="images",
        help="what fills a longer context: more images after the configured text (default), or text and "
             "images in their configured shares",
    )
    plan.add_argument("--clip-frames", type=int, default=32,
                      help="frames per clip of a video module (default 32, what hetero data video-clips writes)")
    plan.add_argument("--top", type=int, default=3, help="also list the N fastest plans of any mode")
    plan.add_argument("--gpus", type=int, default=0,
                      help="devices in all, the last node partly used (e.g. 17: two nodes of 8 and one more)")
    plan.add_argument("--as-configured", action="store_true", help="predict the config's own layouts only")
    plan.add_argument("--plot", metavar="PNG", help="plot the placement modes across --contexts")
    plan.add_argument("--json", metavar="PATH", help="write the plans as JSON")
    plan.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from hetero.config import split_config_and_overrides
    from hetero.config import load_experiment
    from hetero.graph import build_graph
    from hetero.plan.calibrate import calibrate
    from hetero.plan.cluster import load_cluster
    from hetero.plan.report import format_context, plan_json, plan_row, plot
    from hetero.plan.search import Planner, predict_configured
    from hetero.plan.workload import workload_of

    if not args.calibrate and not args.cluster:
        raise ConfigError("hetero plan needs --cluster CLUSTER.yaml (or --calibrate OUT.yaml to measure this machine)")
    name, overrides = split_config_and_overrides(args.config)
    experiment = load_experiment(name, overrides)
    placement = build_graph(experiment, args.registry()).placement if args.as_configured else None
    if args.calibrate:
        cluster = calibrate(args.ranks, name=Path(args.calibrate).stem)
        Path(args.calibrate).write_text(cluster.to_yaml())
        print(f"wrote {args.calibrate}:\n{cluster.to_yaml()}")
        if not args.config and not args.cluster:
            return
    else:
        cluster = load_cluster(args.cluster)
    if args.gpus:
        cluster = dataclasses.replace(cluster, nodes=-(-args.gpus // cluster.gpus_per_node), gpus=args.gpus)
    if placement is not None:
        plan = predict_configured(experiment, placement, cluster, args.clip_frames)
        print(f"{experiment.name} as configured on {cluster.name}: {plan.model_flops / 1e12:.3g} TFLOP per step")
        print(plan_row(plan, cluster))
        if args.json:
            Path(args.json).write_text(json.dumps(plan_json(plan), indent=2))
        return
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c] or [0]
    except ValueError:
        raise ConfigError(f"--contexts={args.contexts!r}: give comma-separated integers, e.g. 4096,32768") from None
    if args.plot and len(contexts) < 2:
        raise ConfigError("--plot compares contexts: give at least two with --contexts")
    results, report = [], []
    for context in contexts:
        workload = workload_of(experiment, context or None, args.tokens_per_step or None, args.extra_context,
                               cluster.device.activation_bytes, args.clip_frames)
        plans = Planner(cluster, workload).plans()
        results.append((workload.llm.seq, plans))
        print(format_context(workload.llm.seq, workload, plans, cluster, args.top), end="\n\n", flush=True)
        report.append({"context": workload.llm.seq, "sequences": workload.sequences,
                       "model_flops": workload.model_flops,
                       "best": {m: plan_json(p[0]) if p else None for m, p in plans.items()}})
    if args.json:
        Path(args.json).write_text(json.dumps({"cluster": cluster.name, "experiment": experiment.name,
                                               "contexts": report}, indent=2))
    if args.plot:
        title = f"{experiment.name} on {cluster.name}: predicted (extra context: {args.extra_context})"
        plot(results, cluster, title, Path(args.plot))
        print(f"wrote {args.plot}")
