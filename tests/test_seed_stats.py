"""The compression benchmarks' paired gap: each seed's loss against the baseline's on the same seed."""

import statistics

import pytest

from hetero.bench.seed_stats import compare


def runs(losses: dict[int, float]) -> list[dict]:
    return [{"seed": seed, "loss": loss, "bytes": 100.0, "accuracy": None} for seed, loss in losses.items()]


def test_the_gap_pairs_each_seed_with_the_baselines_and_cancels_the_seeds_spread():
    base = {0: 2.0, 1: 2.5, 2: 3.0}
    method = {2: 3.12, 0: 2.1, 1: 2.55}  # listed in another order: paired by seed, not by position
    rows = {r["method"]: r for r in compare({"fp32": runs(base), "m": runs(method)}, "fp32", steps=10)}
    differences = [method[s] - base[s] for s in base]
    assert rows["m"]["gap"] == pytest.approx(statistics.mean(differences))
    assert rows["m"]["gap_std"] == pytest.approx(statistics.stdev(differences))
    assert rows["m"]["gap_in_std"] == pytest.approx(statistics.mean(differences) / statistics.stdev(differences))
    assert rows["m"]["gap_std"] < 0.1 < rows["m"]["std"]  # the seeds' spread (0.5) is not the gap's
    assert (rows["fp32"]["gap"], rows["fp32"]["gap_std"], rows["fp32"]["gap_in_std"]) == (0.0, 0.0, 0.0)


def test_a_method_without_the_baselines_seeds_is_refused():
    with pytest.raises(ValueError, match=r"the method ran seeds \[0, 3\], the baseline \[0, 1\]"):
        compare({"fp32": runs({0: 2.0, 1: 2.5}), "m": runs({0: 2.1, 3: 2.6})}, "fp32", steps=10)
