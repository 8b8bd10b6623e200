"""Methods trained over several seeds, compared with a baseline: what the compression benchmarks print."""

from __future__ import annotations

import statistics


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def compare(results: dict[str, list[dict]], baseline: str, steps: int) -> list[dict]:
    """One row per method from its runs (``loss``, ``bytes`` over the run, ``accuracy`` or None): bytes per
    step, ``fewer`` (the baseline's bytes over the method's), loss mean and seed std, the gap to the
    baseline's mean loss, also in units of the larger of the two stds, and the mean accuracy."""
    base = results[baseline]
    base_bytes = statistics.mean(r["bytes"] for r in base) / steps
    base_mean, base_std = mean_std([r["loss"] for r in base])
    rows = []
    for name, runs in results.items():
        mean, std = mean_std([r["loss"] for r in runs])
        bytes_per_step = statistics.mean(r["bytes"] for r in runs) / steps
        spread = max(std, base_std) or float("nan")
        accuracy = None if runs[0]["accuracy"] is None else statistics.mean(r["accuracy"] for r in runs)
        rows.append({
            "method": name, "bytes_per_step": bytes_per_step,
            "fewer": base_bytes / bytes_per_step if bytes_per_step else float("inf"),
            "loss": mean, "std": std, "gap": mean - base_mean, "gap_in_std": (mean - base_mean) / spread,
            "accuracy": accuracy,
        })
    return rows
