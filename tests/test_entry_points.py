"""The learning run and the benchmarks run end to end (tiny budgets; no timing assertions)."""

import subprocess

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


def test_boundary_benchmark_passes_its_checks():
    done = subprocess.run(["hetero", "bench", "boundary"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 4 and all(v.startswith("PASS") for v in verdicts)
