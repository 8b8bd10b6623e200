"""Methods trained over several seeds, compared with a baseline: what the compression benchmarks print.

Every method runs each seed from the same initialization on the same batches as the baseline, so the
comparison is paired: the gap is the mean over seeds of each seed's loss difference to the baseline, with
the standard deviation of those differences. A gap within one such std is no measurable difference; the
seeds' own spread (which the differences cancel) is reported beside it.
"""

from __future__ import annotations

import statistics


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def paired_gap(runs: list[dict], base: list[dict]) -> tuple[float, float]:
    """The mean and std over seeds of ``runs``' loss minus the baseline's loss of the same ``seed``."""
    baseline = {r["seed"]: r["loss"] for r in base}
    seeds = [r["seed"] for r in runs]
    if sorted(seeds) != sorted(baseline):
        raise ValueError(f"a paired gap needs the baseline's seeds: the method ran seeds {sorted(seeds)}, the "
                         f"baseline {sorted(baseline)}")
    return mean_std([r["loss"] - baseline[r["seed"]] for r in runs])


def compare(results: dict[str, list[dict]], baseline: str, steps: int) -> list[dict]:
    """One row per method from its runs (``seed``, ``loss``, ``bytes`` over the run, ``accuracy`` or None,
    optionally ``params``): bytes per step, bits per parameter per step (``bits_per_param``, None without
    ``params``), ``fewer`` (the baseline's bytes over the method's), loss mean and seed std, the paired
    gap to the baseline (``gap`` ± ``gap_std``), the gap in units of that std (``gap_in_std``; 0 for a gap
    of exactly 0), and the mean accuracy."""
    base = results[baseline]
    base_bytes = statistics.mean(r["bytes"] for r in base) / steps
    rows = []
    for name, runs in results.items():
        mean, std = mean_std([r["loss"] for r in runs])
        gap, gap_std = paired_gap(runs, base)
        bytes_per_step = statistics.mean(r["bytes"] for r in runs) / steps
        accuracy = None if runs[0]["accuracy"] is None else statistics.mean(r["accuracy"] for r in runs)
        rows.append({
            "method": name, "bytes_per_step": bytes_per_step,
            "bits_per_param": 8 * bytes_per_step / runs[0]["params"] if "params" in runs[0] else None,
            "fewer": base_bytes / bytes_per_step if bytes_per_step else float("inf"),
            "loss": mean, "std": std, "gap": gap, "gap_std": gap_std,
            "gap_in_std": gap / gap_std if gap_std else (0.0 if gap == 0 else float("inf")),
            "accuracy": accuracy,
        })
    return rows
