"""The planner against a published run: Megatron-Bridge's Qwen3.5-VL non-colocated SFT tutorial.

    python -m hetero.plan.published [--cluster h100_64] [--no-tiles]

The run (``megatron_mimo/qwen35-vl-non-colocated-sft``, H100s): the 27B language model at TP4·PP2·DP2 on
16 GPUs either with the vision encoder whole inside pipeline stage 0 (Megatron's homogeneous VLM, the
best of the authors' sweep) or with the encoder alone on a 17th GPU. Throughput is active tokens per
second per GPU, so the heterogeneous run divides by 17. Published gains per dataset (CORD-v2, RDR,
MedPix) at each (sequence length, global batch) are in ``PUBLISHED``.

The model: Qwen3.5-27B's dimensions (every layer priced as softmax attention: its Gated-DeltaNet layers
have no counterpart in the cost model) and Qwen3-VL's encoder (27 layers of width 1152, 16 heads,
patch 16, 2×2 merging); one ~1000 px image per sample: 3,844 patches, 961 LLM tokens. The printed
decomposition says what each side's step is made of, and how large the encoder's cost inside stage 0
would have to be for the published gain.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from hetero.models.gpt.config import GPTConfig
from hetero.models.vit.config import ViTConfig
from hetero.plan.cluster import ClusterSpec, load_cluster
from hetero.plan.cost import Choice, ModuleCost, describe
from hetero.plan.search import Plan, Planner
from hetero.plan.workload import Workload

# (sequence length, global batch) -> published active-tokens/s/GPU gain per dataset (CORD-v2, RDR, MedPix)
PUBLISHED = {
    (2048, 32): (0.310, 0.299, 0.236),
    (2048, 64): (0.355, 0.447, 0.398),
    (4096, 32): (0.230, 0.233, 0.233),
    (4096, 64): (0.302, 0.306, 0.275),
}
LLM_LAYOUT = Choice(tp=4, cp=1, pp=2, dp=2)
BASELINE_GPUS, HETERO_GPUS = 16, 17


def qwen35_27b(seq_len: int) -> GPTConfig:
    return GPTConfig(vocab_size=248_320, hidden_size=5120, num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256,
                     ffn_hidden_size=17_408, seq_len=seq_len)


def qwen3_vl_encoder(llm_width: int, side: int = 62, max_patches: int = 0) -> ViTConfig:
    """Qwen3-VL's encoder on images of ``side`` x ``side`` patches of 16 px (``max_patches``: at native
    resolution, the largest image's patches, which activation memory must hold)."""
    return ViTConfig(image_size=side * 16, patch_size=16, channels=3, hidden_size=1152, num_layers=27, num_heads=16,
                     ffn_hidden_size=4304, out_size=llm_width, class_token=False, merge=2, max_patches=max_patches)


def image_side(seq_len: int, scaled: bool) -> int:
    """Patches per image side: 62 (3,844 patches, 961 tokens) at every context, or (``scaled``) the image's
    share of the context kept at 2048's (961 of 2048 tokens), as when preprocessing bounds an image's
    pixels by the sequence budget."""
    return round(62 * math.sqrt(seq_len / 2048)) // 2 * 2 if scaled else 62


def bridge_workload(seq_len: int, global_batch: int, scaled: bool = False, native: bool = False) -> Workload:
    """``native``: images at native resolution, the largest filling the context (4 patches a token)."""
    llm = qwen35_27b(seq_len)
    encoder = qwen3_vl_encoder(llm.hidden_size, image_side(seq_len, scaled), 4 * seq_len if native else 0)
    return Workload(describe("llm", "gpt", llm), {"vision": describe("vision", "vit", encoder)},
                    sequences=global_batch, per_sequence={"vision": 1.0})


@dataclass
class Comparison:
    seq_len: int
    global_batch: int
    llm_alone: ModuleCost  # the LLM at the Megatron-style plan's layout and microbatches, no encoder
    megatron: Plan  # the encoder in stage 0, the layers split evenly
    tuned: Plan  # the encoder in stage 0, stage 0's layers chosen
    hetero: Plan  # the encoder on a GPU of its own

    def gain(self, baseline: Plan) -> float:
        """Per-GPU throughput of the heterogeneous run over ``baseline``'s, minus 1."""
        return baseline.step_s * BASELINE_GPUS / (self.hetero.step_s * HETERO_GPUS) - 1

    def needed_baseline_s(self, gain: float) -> float:
        """The baseline step the published ``gain`` implies, given the heterogeneous step predicted."""
        return (1 + gain) * self.hetero.step_s * HETERO_GPUS / BASELINE_GPUS


def _same_layout(plans: list[Plan], name: str = "llm") -> Plan:
    """The fastest of ``plans`` whose LLM runs at LLM_LAYOUT (any microbatch size, recomputation or not)."""
    matching = [p for p in plans if (c := p.choices[name]).tp == LLM_LAYOUT.tp and c.cp == 1 and c.pp == LLM_LAYOUT.pp
                and c.dp == LLM_LAYOUT.dp]
    if not matching:
        raise RuntimeError(f"no plan with the LLM at {LLM_LAYOUT.label()} fits")
    return min(matching, key=lambda p: p.step_s)


def compare(cluster: ClusterSpec, seq_len: int, global_batch: int, scaled: bool = False) -> Comparison:
    workload = bridge_workload(seq_len, global_batch, scaled)
    sixteen = Planner(dataclasses.replace(cluster, nodes=2, gpus=BASELINE_GPUS), workload)
    megatron = _same_layout(sixteen.homogeneous(BASELINE_GPUS, even=True))
    tuned = _same_layout(sixteen.homogeneous(BASELINE_GPUS))
    alone = sixteen.model.module_cost(workload.llm, megatron.choices["llm"], global_batch)
    seventeen = Planner(dataclasses.replace(cluster, nodes=3, gpus=HETERO_GPUS), workload)
    options = [(c, cost) for c, cost in seventeen.llm_options(BASELINE_GPUS)
               if (c.tp, c.cp, c.pp, c.dp) == (LLM_LAYOUT.tp, 1, LLM_LAYOUT.pp, LLM_LAYOUT.dp)]
    plans = [p for choice, cost in options if (p := seventeen.three_sides(HETERO_GPUS, 1, 0, choice, cost)) is not None]
    hetero = min(plans, key=lambda p: p.step_s)
    return Comparison(seq_len, global_batch, alone, megatron, tuned, hetero)


def eight_gpu_memory_gib(cluster: ClusterSpec, seq_len: int, global_batch: int, native: bool) -> float:
    """The least memory per GPU of any Megatron-style layout (even or tuned split) of the run on 8 GPUs,
    fitting or not."""
    roomy = dataclasses.replace(cluster, nodes=1, gpus=8, device=dataclasses.replace(cluster.device, memory_gib=1e9))
    planner = Planner(roomy, bridge_workload(seq_len, global_batch, native=native))
    return min(p.memory_gib for even in (True, False) for p in planner.homogeneous(8, even))


def _stages(plan: Plan) -> str:
    cost = plan.costs["llm"]
    return f"{cost.microbatches} microbatches of {plan.choices['llm'].micro}, {cost.microbatch_s * 1e3:.0f} ms a slot"


def report(cluster: ClusterSpec) -> str:
    rows = [compare(cluster, seq, gbs) for seq, gbs in PUBLISHED]
    lines = [
        f"Qwen3.5-VL 27B SFT, LLM at {LLM_LAYOUT.label().split(' ')[0]}, predicted on {cluster.name} "
        f"(GEMM tiles: {'on, ' + str(cluster.device.sms) + ' SMs' if cluster.device.sms else 'off'})",
        "",
        "| seq, GBS | Megatron-style (even split), 16 GPUs | tuned split, 16 GPUs | encoder on a 17th GPU | "
        "gain vs Megatron-style | gain vs tuned | published (CORD / RDR / MedPix) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        published = " / ".join(f"{g:+.1%}" for g in PUBLISHED[r.seq_len, r.global_batch])
        lines.append(f"| {r.seq_len}, {r.global_batch} | {r.megatron.step_s:.3f} s | {r.tuned.step_s:.3f} s | "
                     f"{r.hetero.step_s:.3f} s | {r.gain(r.megatron):+.1%} | {r.gain(r.tuned):+.1%} | {published} |")
    lines += [
        "",
        "Decomposition (seconds per step): the LLM alone at the same layout; what the encoder inside stage 0 "
        "adds (Megatron-style, even split); what the even split costs over the tuned one; the baseline's "
        "pipeline bubbles and communication; what the 17th GPU's side adds (fill and boundary); and the "
        "encoder's cost in stage 0 that the mean published gain implies.",
        "",
        "| seq, GBS | LLM alone | + encoder in stage 0 | even vs tuned split | baseline bubbles | baseline comm. | "
        "17th GPU: fill + boundary | encoder cost implied by published | implied / predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        alone = r.llm_alone.step_s
        added = r.megatron.step_s - alone
        base = r.megatron.costs["llm"]
        published = sum(PUBLISHED[r.seq_len, r.global_batch]) / 3
        implied = r.needed_baseline_s(published) - alone
        lines.append(
            f"| {r.seq_len}, {r.global_batch} | {alone:.3f} | {added:.3f} | {r.megatron.step_s - r.tuned.step_s:.3f} | "
            f"{base.bubble_s:.3f} | {r.megatron.breakdown()['comm_s']:.3f} | "
            f"{r.hetero.step_s - r.hetero.costs['llm'].step_s:.3f} | "
            f"{implied:.3f} | {implied / added:.2f}x |")
    lines += ["", "With each image's tokens scaled with the context (4096: "
              f"{image_side(4096, True)}x{image_side(4096, True)} patches, {image_side(4096, True) ** 2 // 4} tokens):", "",
              "| seq, GBS | Megatron-style | encoder on a 17th GPU | gain vs Megatron-style | gain vs tuned |",
              "|---|---|---|---|---|"]
    for seq, gbs in PUBLISHED:
        if seq == 2048:
            continue
        r = compare(cluster, seq, gbs, scaled=True)
        lines.append(f"| {seq}, {gbs} | {r.megatron.step_s:.3f} s | {r.hetero.step_s:.3f} s | {r.gain(r.megatron):+.1%} | "
                     f"{r.gain(r.tuned):+.1%} |")
    usable = cluster.device.usable_memory * cluster.device.memory_gib
    host = cluster.host
    lines += ["", f"Host: the 17th GPU's rank decodes every image of the step ({host.decode_ms_per_megapixel:g} ms a "
              f"megapixel, {host.loader_workers} workers): " + ", ".join(
                  f"{r.seq_len}/{r.global_batch} {r.hetero.host_s * 1e3:.0f} ms of a {r.hetero.costs['vision'].step_s:.3f} s "
                  f"encoder step" for r in rows)]
    lines += ["", f"Memory on 8 GPUs (the least of any Megatron-style layout; {usable:.0f} GiB usable), with 961-token "
              "images / at native resolution with images up to the whole context: " + ", ".join(
                  f"{seq}/{gbs} {eight_gpu_memory_gib(cluster, seq, gbs, False):.1f} / "
                  f"{eight_gpu_memory_gib(cluster, seq, gbs, True):.1f} GiB" for seq, gbs in PUBLISHED)]
    lines += ["", "Layouts: " + "; ".join(f"{r.seq_len}/{r.global_batch}: Megatron-style {_stages(r.megatron)}, "
                                         f"17 GPUs {_stages(r.hetero)} ({r.hetero.describe()})" for r in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", default="h100_64", help="cluster YAML or a shipped name (default h100_64)")
    parser.add_argument("--no-tiles", action="store_true", help="price every GEMM at the sustained rate (sms=0)")
    args = parser.parse_args(argv)
    cluster = load_cluster(args.cluster)
    if args.no_tiles:
        cluster = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, sms=0, attention_head_tile=0))
    print(report(cluster))


if __name__ == "__main__":
    main()
