"""``hetero bench balance`` and ``hetero bench packing`` at small sizes: what they report is what they
measured (no timing is asserted)."""

import statistics

from hetero.bench import balance, packing


def test_the_balance_benchmark_compares_both_splits_on_the_same_images(capsys):
    result = balance.measure(steps=6, dp=4, samples=8, timed=2, max_patches=64)
    sizes = result["patches_per_image"]
    assert min(sizes) < max(sizes) <= 64  # native resolution: images of many patch counts
    for name in ("patches", "count"):
        assert len(result["ratios"][name]) == 6 and len(result["slowest"][name]) == 2
        assert all(r >= 1.0 for r in result["ratios"][name])
    # greedy largest-first never does worse than equal image counts on these steps
    assert statistics.mean(result["ratios"]["patches"]) <= statistics.mean(result["ratios"]["count"])
    balance.main(["--steps", "3", "--timed", "1", "--samples", "4", "--max-patches", "64"])
    out = capsys.readouterr().out
    assert "max/mean patches per replica" in out and "count split / patch split" in out


def test_the_packing_benchmark_trains_both_variants_on_the_same_documents(capsys):
    result = packing.measure(documents=40, seq_len=128, rows=4, rounds=1)
    useful = result["useful_tokens"]
    assert result["packed"]["rows"] < result["padded"]["rows"] == 40
    assert result["packed"]["positions"] >= useful and result["padded"]["positions"] == 40 * 128
    packing.main(["--documents", "24", "--seq-len", "128", "--rows", "4", "--rounds", "1"])
    assert "useful tokens/s, packed / padded" in capsys.readouterr().out
