"""Where heterogeneity pays: the planner's best heterogeneous plan against the Megatron-style baseline
(every module on the LLM's grid, the encoders in its first stage, the layers split evenly) across
workloads, on a cluster.

    python -m hetero.plan.sweep [--cluster h100_64] [--plot sweep.png]

Every point starts from ``vlm_7b`` (a 7B Llama-shaped LLM, a 0.4B SigLIP-shaped encoder, one 378 px image
per 4096-token sequence, 256 sequences per step: at most 1M tokens, in a power of two of sequences) and changes one thing: images per sequence, the encoder's
size, video frames per sample (2x2-merged frames after a 1024-token text), several encoders, the
context (the extra context filled with images) or a frozen encoder. Each point prints the gain
(baseline step / best heterogeneous step) and its region: at least +50%, at least +20%, or below.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from hetero.config import load_experiment
from hetero.models import default_registry
from hetero.models.gpt.config import GPTConfig
from hetero.models.vit.config import ViTConfig
from hetero.plan.cluster import ClusterSpec, load_cluster
from hetero.plan.cost import describe
from hetero.plan.report import heterogeneous_gain
from hetero.plan.search import BASELINES, Plan, Planner
from hetero.plan.workload import Workload, priced

TOKENS_PER_STEP = 256 * 4096
# (name, hidden, layers, heads, ffn): SigLIP-so400m, a ViT-g-sized tower, InternViT-6B's shape (25 heads: no
# tensor parallelism divides them), and one as large with 24 heads
ENCODERS = (("0.4B", 1152, 27, 16, 4304), ("1.1B", 1408, 40, 16, 6144), ("5.9B", 3200, 45, 25, 12800),
            ("5.5B/24 heads", 3072, 45, 24, 12288))


@dataclass
class Point:
    axis: str
    value: str
    workload: Workload


def _base() -> tuple[GPTConfig, ViTConfig]:
    experiment = load_experiment("vlm_7b")
    registry = default_registry()
    return experiment.model_config("llm", registry), experiment.model_config("vision", registry)


def _workload(llm: GPTConfig, encoders: dict[str, ViTConfig], per_sequence: float, context: int,
              training: str = "full") -> Workload:
    described = {name: priced(describe(name, "vit", config), training) for name, config in encoders.items()}
    # sequences per step: a power of two (about TOKENS_PER_STEP tokens), so that every data-parallel degree
    # of the 64 devices divides them, as it would in a run set up for this cluster
    sequences = 1 << (TOKENS_PER_STEP // context).bit_length() - 1
    return Workload(describe("llm", "gpt", llm, context), described, sequences, dict.fromkeys(encoders, per_sequence))


def points() -> list[Point]:
    llm, vision = _base()
    found = []
    for images in (1, 2, 4, 5):  # 729 tokens each, inside the 4096 context
        found.append(Point("images per 4k sequence", str(images), _workload(llm, {"vision": vision}, images, 4096)))
    for name, hidden, layers, heads, ffn in ENCODERS:
        tower = dataclasses.replace(vision, hidden_size=hidden, num_layers=layers, num_heads=heads, ffn_hidden_size=ffn)
        found.append(Point("encoder size", name, _workload(llm, {"vision": tower}, 1, 4096)))
    frames = dataclasses.replace(vision, image_size=392, merge=2)  # 28 x 28 patches -> 196 tokens a frame
    for count in (8, 32, 128):
        context = 1024 + count * frames.feature_tokens
        found.append(Point("video frames per sample", str(count), _workload(llm, {"vision": frames}, count, context)))
    for count in (1, 2, 3):
        towers = {f"vision{i}": vision for i in range(count)}
        found.append(Point("encoders (one image each)", str(count), _workload(llm, towers, 1, 4096)))
    for context in (4096, 16384, 65536, 131072):  # text keeps 4096 - 729 tokens, images fill the rest
        images = 1 + (context - 4096) / vision.feature_tokens
        found.append(Point("context (filled with images)", f"{context // 1024}k",
                           _workload(llm, {"vision": vision}, images, context)))
    for images in (1, 4):
        found.append(Point("frozen encoder, images per 4k", str(images),
                           _workload(llm, {"vision": vision}, images, 4096, training="forward")))
    return found


@dataclass
class Result:
    point: Point
    plans: dict[str, list[Plan]]

    @property
    def gain(self) -> float | None:
        return heterogeneous_gain(self.plans, "megatron")

    @property
    def best(self) -> Plan | None:
        hetero = [p[0] for mode, p in self.plans.items() if mode not in BASELINES and p]
        return min(hetero, key=lambda p: p.step_s) if hetero else None

    @property
    def region(self) -> str:
        gain = self.gain
        return "-" if gain is None else ">= +50%" if gain >= 1.5 else ">= +20%" if gain >= 1.2 else "< +20%"


def sweep(cluster: ClusterSpec) -> list[Result]:
    return [Result(point, Planner(cluster, point.workload).plans()) for point in points()]


def table(results: list[Result]) -> str:
    lines = ["| axis | value | Megatron-style step | best heterogeneous step | its placement | gain | region |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        base = r.plans["megatron"][0].step_s if r.plans["megatron"] else None
        best = r.best
        lines.append(f"| {r.point.axis} | {r.point.value} | {'%.3f s' % base if base else 'no fit'} | "
                     f"{'%.3f s' % best.step_s if best else 'no fit'} | {best.mode if best else '-'} | "
                     f"{'%+.0f%%' % ((r.gain - 1) * 100) if r.gain else '-'} | {r.region} |")
    return "\n".join(lines)


def plot(results: list[Result], cluster: ClusterSpec, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = list(dict.fromkeys(r.point.axis for r in results))
    fig, panels = plt.subplots(1, len(axes), figsize=(3.2 * len(axes), 3.6), sharey=True)
    for panel, axis in zip(panels, axes):
        rows = [r for r in results if r.point.axis == axis and r.gain is not None]
        panel.plot([r.point.value for r in rows], [r.gain for r in rows], marker="o", color="black")
        for level, color in ((1.2, "tab:orange"), (1.5, "tab:green")):
            panel.axhline(level, color=color, linewidth=0.8, linestyle="--")
        panel.axhline(1.0, color="grey", linewidth=0.6)
        panel.set(title=axis, xlabel=axis.split(" (")[0])
    panels[0].set_ylabel("Megatron-style step / best heterogeneous step")
    fig.suptitle(f"predicted gain on {cluster.world_size} devices of {cluster.name} (dashed: +20%, +50%)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="h100_64", help="cluster YAML or a shipped name (default h100_64)")
    parser.add_argument("--plot", metavar="PNG", help="write the gains per axis as a figure")
    args = parser.parse_args(argv)
    cluster = load_cluster(args.cluster)
    results = sweep(cluster)
    print(table(results))
    if args.plot:
        plot(results, cluster, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
