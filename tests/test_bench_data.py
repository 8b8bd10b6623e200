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


def test_the_row_bytes_benchmark_holds_each_rank_to_its_rows(tmp_path, monkeypatch):
    from hetero.bench import row_bytes

    monkeypatch.chdir(tmp_path)  # the digits' shards are written under the working directory
    ranks = row_bytes.measured()
    assert [r["held"] for r in ranks] == [{"images": 11, "tokens": 0, "labels": 0}] * 4 + \
        [{"images": 0, "tokens": 22, "labels": 22}] * 4  # ViT dp4: 44/4 rows; LLM dp2: 44/2 rows
    assert all(r["compact"] < r["global"] / 4 for r in ranks)
    small, large = row_bytes.simulated([64, 4096], rows=8, seq_len=32768)
    assert large["rows"] == 64 * small["rows"] and large["global"] > 60 * small["global"]
    assert small["llm"] < large["llm"] < 1.05 * small["llm"]  # flat but for a few bytes of bookkeeping per row
