"""The learning run and the overhead benchmark run end to end (tiny budgets; no timing assertions)."""

from hetero.bench import overhead
from hetero.train import text_lm


def test_text_lm_trains_and_evaluates(capsys):
    curve = text_lm.train(minutes=5, batch_size=2, lr=2e-3, eval_every=2, seed=0, max_steps=4)
    assert [point[0] for point in curve] == [2, 4]
    assert all(0 < point[3] < 9 for point in curve)  # held-out bits per byte of a byte model
    assert "held-out" in capsys.readouterr().out


def test_overhead_benchmark_reports_a_ratio(capsys):
    overhead.main(["--steps", "2"])
    out = capsys.readouterr().out
    assert "ratio hetero / plain" in out
    assert "largest loss difference 0.00e+00" in out  # same model, same data, same losses
