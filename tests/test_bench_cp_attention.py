"""``hetero bench cp-attention`` on 2 ranks at two small lengths: every method reports, and the peak memory
it allocates (counted tensor storages, so deterministic) grows linearly in S for the block all-gather and
the ring, with no (S/cp)×S term, while the masked baseline's grows faster."""

from hetero.bench.cp_attention import METHODS, run


def test_block_methods_hold_no_quadratic_mask():
    rows = run([1024, 2048], [2], heads=4, kv_heads=2, head_dim=16, repeats=1)
    peak = {(row["seq"], row["method"]): row["peak_bytes"] for row in rows}
    growth = {method: peak[(2048, method)] / peak[(1024, method)] for method in METHODS}
    print("peak memory growth from S=1024 to 2048:", {m: round(g, 3) for m, g in growth.items()})
    assert growth["block all-gather"] <= 2.01 and growth["ring"] <= 2.01
    assert growth["masked all-gather"] > 2.5
    assert peak[(2048, "ring")] < peak[(2048, "block all-gather")] < peak[(2048, "masked all-gather")]
