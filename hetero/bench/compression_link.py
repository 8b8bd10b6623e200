"""Step time on a slow link: how much of each method's communication stays exposed, quality in the same runs.

    hetero bench compression --link [--seeds 0 1] [--steps 512] [--latency-ms 5] [--comm-factor 10]

First the text task runs with per-step fp32 DP and no simulated link: its step time ``c`` and its bytes
per step ``B``. The link's bandwidth is then set so that one fp32 step's all-reduce takes ``comm-factor`` ×
``c`` on it (latency included): with the default 10, per-step fp32 DP spends about 10/11 of its step
communicating. Each method then runs without the link (its compute-only step: its collectives cross local
gloo) and on it (``parallel.simulated_link``): fp32 DP, and by default the best compressed method blocking
and with its rounds overlapped. Each row gives both step times, their ratio, and the held-out loss of the
runs on the link, paired with fp32's on the same seed.
"""

from __future__ import annotations

from dataclasses import replace

from hetero.bench.compression_tasks import Method, run_text
from hetero.bench.seed_stats import mean_std, paired_gap
from hetero.parallel.compression.link import LinkConfig
from hetero.testing.multiprocess import run_ranks


def _runs(method: Method, seeds: list[int], steps: int, ranks: int) -> list[dict]:
    out = []
    for seed in seeds:
        results = run_ranks(run_text, ranks, method, seed, steps, steps, timeout_s=3600)
        out.append(results[0] | {"seed": seed, "bytes": sum(r["bytes"] for r in results) / ranks,
                                 "step_s": max(r["step_s"] for r in results)})  # the slowest rank sets the pace
    return out


def print_link(methods: list[Method], seeds: list[int], steps: int, ranks: int, latency_ms: float,
               comm_factor: float) -> list[dict]:
    """``methods``: compressed methods to put on the link beside per-step fp32. Returns the printed rows."""
    base = _runs(Method("fp32 all-reduce"), seeds, steps, ranks)
    compute = mean_std([r["step_s"] for r in base])[0]
    fp32_bytes = mean_std([r["bytes"] for r in base])[0] / steps
    seconds = comm_factor * compute - latency_ms / 1e3
    if seconds <= 0:
        raise ValueError(f"--latency-ms={latency_ms} alone exceeds {comm_factor} x the {compute * 1e3:.1f} ms step")
    link = LinkConfig(latency_ms=latency_ms, gbit_s=fp32_bytes * 8 / seconds / 1e9)
    print(f"[link] fp32 step without the link {compute * 1e3:.2f} ms; {fp32_bytes / 2**20:.3f} MiB/step; link "
          f"{link.gbit_s * 1e3:.3f} Mbit/s, {latency_ms} ms latency", flush=True)
    rows = []
    for method in [Method("fp32 all-reduce")] + methods:
        off = base if method.name == "fp32 all-reduce" else _runs(method, seeds, steps, ranks)
        on = _runs(replace(method, link=link), seeds, steps, ranks)
        rows.append(_row(method.name, off, on, base, compute, steps))
        print(f"[link] {method.name}: {rows[-1]['off_ms']:.2f} ms/step without the link, "
              f"{rows[-1]['on_ms']:.2f} on it", flush=True)
    print(f"\nText task on a simulated link, {ranks} ranks, {steps} steps, {len(seeds)} seeds")
    print(f"{'method':<50} {'MiB/step':>9} {'ms/step':>8} {'on link':>8} {'x own':>6} {'x fp32':>7} {'exposed':>8} "
          f"{'loss':>7} {'paired gap':>17}")
    for r in rows:
        print(f"{r['method']:<50} {r['mib']:9.4f} {r['off_ms']:8.2f} {r['on_ms']:8.2f} {r['own']:6.3f} "
              f"{r['fp32']:7.3f} {r['exposed']:8.1%} {r['loss']:7.4f} {r['gap']:+9.4f} ± {r['gap_std']:.4f}")
    print("(ms/step: without the link, then on it; x own: on the link over the method's own step without it; "
          "x fp32: over fp32 DP's step without it; exposed: the share of the step on the link spent waiting for "
          "it; loss and paired gap (to fp32 on the same seed) from the runs on the link)")
    return rows


def _row(name: str, off: list[dict], on: list[dict], base: list[dict], compute: float, steps: int) -> dict:
    off_s, on_s = (mean_std([r["step_s"] for r in runs])[0] for runs in (off, on))
    gap, gap_std = paired_gap(on, base)
    return {"method": name, "mib": mean_std([r["bytes"] for r in on])[0] / steps / 2**20, "off_ms": off_s * 1e3,
            "on_ms": on_s * 1e3, "own": on_s / off_s, "fp32": on_s / compute, "exposed": max(0.0, 1 - off_s / on_s),
            "loss": mean_std([r["loss"] for r in on])[0], "gap": gap, "gap_std": gap_std}
