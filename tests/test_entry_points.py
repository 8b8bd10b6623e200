"""The learning run and the benchmarks run end to end (tiny budgets; no timing assertions)."""

import math
import re
import subprocess
import sys


def test_the_text_lm_trains_and_evaluates_on_one_rank(tmp_path):
    """``hetero train text_lm``: the LLM alone on real text, held-out losses (nats per byte) in range."""
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", "text_lm", "train.steps=4", "train.log_every=2",
         "train.eval_every=2", "train.eval_batches=2", "train.wandb=disabled", f"train.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    heldout = [line for line in done.stdout.splitlines() if "held-out loss" in line]
    assert [line.split("|")[0].strip() for line in heldout] == ["step     2", "step     4"]
    losses = [float(line.split("held-out loss ")[1].split()[0]) for line in heldout]
    assert all(0 < loss < math.log(256) + 1 for loss in losses)  # a byte model's nats per byte


def test_overhead_benchmark_reports_a_ratio():
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "bench", "overhead", "--steps", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ratio hetero / plain" in done.stdout
    # same model, same data, both clipping at 1.0: the norms differ only in summation order (hetero sums
    # the per-tensor squares in float64), so the clipped updates agree to rounding
    differences = re.search(r"loss (\S+), gradient norm (\S+)", done.stdout)
    assert differences and max(float(differences[1]), float(differences[2])) < 1e-5, done.stdout


def test_dechunk_benchmark_times_the_scan_beside_the_loop():
    done = subprocess.run(["hetero", "bench", "dechunk", "--lengths", "8", "100", "--batch", "2", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("|") for line in done.stdout.splitlines()[1:]]
    assert [int(row[0]) for row in rows] == [8, 100]
    assert all(float(row[-1]) <= 1e-6 for row in rows)  # the scan's states match the loop's


def test_boundary_benchmark_passes_its_checks():
    done = subprocess.run(["hetero", "bench", "boundary"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 4 and all(v.startswith("PASS") for v in verdicts)


def test_compression_benchmark_prints_bytes_and_losses():
    done = subprocess.run(
        ["hetero", "bench", "compression", "--tasks", "text", "--seeds", "0", "1", "--steps", "32",
         "--methods", "int4 + EF"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line[:34].strip(): line.split() for line in done.stdout.splitlines()
            if " ± " in line and not line.startswith("method")}
    assert set(rows) == {"fp32 all-reduce", "int4 + EF"}
    fewer = float(rows["int4 + EF"][-10])  # ... fewer, loss, ±, std, paired gap, ±, its std, gap/std, accuracy, EF residual
    assert 7 < fewer < 8  # 4-bit codes plus one bf16 scale per 64 entries: 32/4.25 = 7.53


def test_compression_fan_in_prints_flat_bytes_for_shared_topk():
    done = subprocess.run(["hetero", "bench", "compression", "--fan-in", "--params", "20000"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line[:22].strip(): [int(b.replace(",", "")) for b in re.findall(r"([\d,]+) \(", line[22:])]
            for line in done.stdout.splitlines()}
    shared, topk = rows["shared top-k 1%"], rows["top-k 1%"]
    assert len(shared) == 4 and shared[-1] < 1.32 * shared[0] and topk[-1] == 21 * topk[0]


def test_activation_compression_benchmark_prints_bytes_losses_and_memory():
    done = subprocess.run(
        ["hetero", "bench", "activation-compression", "--tasks", "llm_pp2", "--seeds", "0", "--steps", "8",
         "--methods", "int2 fwd", "--memory-samples"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line[:38].strip(): line.split() for line in done.stdout.splitlines()
            if " ± " in line and not line.startswith("method")}
    assert set(rows) == {"fp32", "int2 fwd / int4 bwd, Clapping"}
    fewer = float(rows["int2 fwd / int4 bwd, Clapping"][-9])  # ... fewer, loss, ±, std, gap, gap/std, lazy, acc, mem
    assert 9.8 < fewer < 9.9  # 2+4 bits plus a bf16 scale per 64 entries each way: 64/6.5 = 9.85
    assert rows["int2 fwd / int4 bwd, Clapping"][-1] == "512KB"  # one step's rows: 4 microbatches of 4x64x64


def test_video_memory_benchmark_prints_every_policy(tmp_path):
    """Tiny budgets: the whole path (shards, pretraining, router, Context Forcing students, evaluation,
    the long clip) runs and prints a row per policy; bounded policies' KV stays flat over the long clip."""
    done = subprocess.run(
        ["hetero", "bench", "video-memory", "--frames", "10", "--a-len", "2", "--gap", "4", "--budget", "3",
         "--window", "1", "--long", "2", "--train-clips", "8", "--heldout-clips", "4", "--batch", "2",
         "--pretrain-steps", "2", "--router-steps", "1", "--student-steps", "1", "--data", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0] for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("full", "sliding", "sink_window", "slow_fast", "learned")}
    assert rows == {"full", "sliding", "sink_window", "slow_fast", "learned"}
    assert "holds: bounded KV flat over the long clip" in done.stdout


def test_genezip_benchmark_prints_every_model(tmp_path):
    """Tiny budgets: genome shards, the three models trained, two held-out batches evaluated; a row per
    model with its BPT per region and the floor check; the targets sweep (GeneZip at two more ratios),
    trained two at a time."""
    done = subprocess.run(
        ["hetero", "bench", "genezip", "--steps", "2", "--window", "512", "--hidden", "16", "--main-layers", "1",
         "--encoder-layers", "1", "--local-window", "16", "--batch", "2", "--seeds", "0", "--eval-batches", "2",
         "--jobs", "2", "--data", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0]: line for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("genezip", "hnet", "fixed")}
    assert set(rows) == {"genezip", "hnet", "fixed"}
    assert "yes" in rows["fixed"]  # a token every 4 bases: 16 per 64-base window, above the floor of 4
    paired = done.stdout.split("GeneZip - H-Net, paired by seed (0)")[1].splitlines()
    assert paired[1].split(":")[0].strip() == "bits_per_base" and "parameters" in paired[5]
    sweep = done.stdout.split("targets sweep")[1].splitlines()[2:]
    assert [line.split()[0] for line in sweep if line.strip()] == ["1.5", "2", "3"]
    assert "(11.09)" in sweep[2]  # intergenic at 3 × coding, at an average of 4 bases per token
