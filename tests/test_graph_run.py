"""The four-module graph's training job end to end under torchrun (``hetero train full_graph``, mixed
placement on 4 ranks), with compression on every edge and on gradient syncs set in the same config: the
progress lines carry each module's loss and every communicator's bytes, held-out metrics and a summary
come out, and a run resumed from its step-2 checkpoint repeats the uninterrupted run's steps 3-4 bit
for bit (edge compensation state, error-feedback residuals and optimizer states included)."""

import json
import subprocess
import sys

import pytest

from hetero.config import load_experiment
from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph

# int8 activations on every edge, int4 or int8 gradients back, per-sample error compensation on two of
# them; int8 error feedback for the vision encoder's gradient sync and top-k (10%) with error feedback for
# the video generator's.
EDGE_CODECS = [
    "edges=[{src: vision, dst: llm, compression: {forward: {method: int8}, backward: {method: int4}, "
    "compensation: per_sample}},"
    "{src: dna, dst: llm, compression: {forward: {method: int8}, backward: {method: int8}, compensation: none}},"
    "{src: llm, dst: video, compression: {forward: {method: int8}, backward: {method: int4}, "
    "compensation: per_sample}}]",
    "vision.compression.grad.method=int8", "video.compression.grad.method=topk", "video.compression.grad.ratio=0.1",
]
# A mixed placement on 4 ranks (one torchrun launch of 8 costs about a minute of start-up on this machine;
# the 8-rank placements are checked against one process in test_graph_parity.py): both encoders and the
# generator dp2 on ranks 0-1, the LLM tp1·pp2 on ranks 2-3.
FOUR_RANKS = ["world_size=4", "llm.layout.tp=1", "llm.layout.offset=2", "video.layout.offset=0"]
COMMON = [*FOUR_RANKS, "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.steps=4",
          "train.checkpoint.every=2", "train.wandb=disabled", *EDGE_CODECS]


def hetero_train(tmp_path, run, *overrides):
    data = [f"train.data_dir={tmp_path / 'digits'}", f"train.genome_dir={tmp_path / 'genome'}",
            f"train.clip_dir={tmp_path / 'clips'}", f"train.run_dir={tmp_path / run}"]
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", "full_graph", *COMMON, *overrides, *data],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def metrics(tmp_path, run):
    rows = [json.loads(line) for line in (tmp_path / run / "full_graph" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row for row in rows if "loss" in row}  # the steps' records


def test_the_graph_trains_compressed_and_resumes_bit_for_bit(tmp_path):
    out = hetero_train(tmp_path, "straight")
    assert "--nproc_per_node=4" in out
    (line,) = [line for line in out.splitlines() if line.startswith("step     4 | loss")]
    for part in ("llm loss", "dna loss", "video loss"):
        assert part in line, line
    for edge in ("vision->llm", "dna->llm", "llm->video"):
        for direction in ("forward", "backward"):
            assert f"boundary.{edge}.{direction}=" in line, line
    for name in ("pipeline.llm.forward", "pipeline.llm.backward", "grad_sync.vision", "grad_sync.dna",
                 "grad_sync.video"):
        assert f"{name}=" in line, line
    (heldout,) = [line for line in out.splitlines() if line.startswith("step     4 | held-out")]
    assert "llm: loss" in heldout and "digit accuracy" in heldout and "gc accuracy" in heldout, heldout
    assert "video: loss" in heldout and "dna: loss" in heldout and "bits per base" in heldout, heldout
    assert "summary: steps 4" in out

    checkpoint = tmp_path / "straight" / "full_graph" / "checkpoints" / "step_000002"
    out = hetero_train(tmp_path, "resumed", f"train.checkpoint.resume={checkpoint}")
    assert f"resumed from {checkpoint} at step 2" in out and "start afresh" not in out
    straight, resumed = metrics(tmp_path, "straight"), metrics(tmp_path, "resumed")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "llm.loss", "dna.loss", "video.loss", "grad_norm"):
            assert resumed[step][key] == straight[step][key], (step, key)


def test_a_conditioned_generator_without_its_edge_is_refused():
    experiment = load_experiment("full_graph", ["edges=[{src: vision, dst: llm}, {src: dna, dst: llm}]"])
    with pytest.raises(ConfigError, match=r"video: its input condition takes exactly one edge, got 0; add an edge"):
        build_graph(experiment)
