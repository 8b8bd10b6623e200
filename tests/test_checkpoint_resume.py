"""Resuming the training job from its checkpoints, end to end under torchrun (``hetero train``).

- Same layouts: steps N+1.. after a resume at step N equal the uninterrupted run's losses bit for bit,
  with every kind of rank-local state in play (int8 error feedback, DiLoCo mid-round, compressed boundary
  and pipeline edges under lazy sampling) and with the checkpoint written asynchronously.
- New layouts (LLM tp2·pp2 -> tp1·dp4, vision dp4 -> dp2): the weights and optimizer states
  reshard, the losses stay within 1e-5 relative of the uninterrupted run and the streamed samples are its
  very samples. That run is also the check of the job's outputs: progress lines with every communicator's
  bytes, held-out accuracy, summary, wandb offline run. Likewise experts (ep2 -> ep1).
- GeneZip under tp2: its job's outputs, and its region budget crossing the checkpoint bit for bit.
"""

import json
import subprocess
import sys

COMMON = ["train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.steps=8", "train.checkpoint.every=4"]


def hetero_train(tmp_path, run, experiment, *overrides):
    paths = [f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / run}"]
    if not any(o.startswith("train.wandb=") for o in overrides):
        paths.append("train.wandb=disabled")
    common = [c for c in COMMON if not any(o.startswith(c.split("=")[0] + "=") for o in overrides)]
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", experiment, *common, *overrides, *paths],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(tmp_path, run, experiment):
    rows = [json.loads(line) for line in (tmp_path / run / experiment / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}  # the steps' records


# Every kind of rank-local state at once, on compressed_edges_vlm moved onto 4 ranks (vision dp2 on ranks
# 2-3, the LLM pp2·dp2 on ranks 0-3, a mixed placement; images cross from ranks 2-3 to the first stage on
# 0-1): int8 error feedback for the encoder's gradients; DiLoCo for the LLM with rounds at steps 3
# and 6, so the resume at step 4 falls inside a round (replicas hold different inner weights); 2-bit
# activations / 4-bit gradients on the boundary and the LLM's stage edge under lazy sampling (each batch
# serves 4 steps), so the compensation state crosses the resume. The checkpoint is written asynchronously.
EVERY_LOCAL_STATE = ["world_size=4", "placement=auto", "llm.layout.offset=0", "vision.layout.offset=2",
                     "vision.compression.grad.method=int8",
                     "llm.compression.diloco.inner_steps=3", "train.checkpoint.async_save=true"]


def test_resume_with_the_same_layouts_continues_bit_for_bit(tmp_path):
    experiment = "compressed_edges_vlm"
    out = hetero_train(tmp_path, "straight", experiment, *EVERY_LOCAL_STATE)
    checkpoints = tmp_path / "straight" / experiment / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000008"]
    (line,) = [line for line in out.splitlines() if line.startswith("step     4 | loss")]
    for name in ("boundary.vision->llm.forward", "boundary.vision->llm.backward", "pipeline.llm.forward",
                 "pipeline.llm.backward", "ec_memory", "grad_sync.vision", "grad_sync.llm", "ef_residual.vision"):
        assert f"{name}=" in line, line

    out = hetero_train(tmp_path, "resumed", experiment, *EVERY_LOCAL_STATE,
                       f"train.checkpoint.resume={checkpoints / 'step_000004'}")
    assert f"resumed from {checkpoints / 'step_000004'} at step 4" in out
    assert "start afresh" not in out
    straight, resumed = losses(tmp_path, "straight", experiment), losses(tmp_path, "resumed", experiment)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert [resumed[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]


# The colocated VLM saved at LLM tp2·pp2·dp1 / vision dp4, resumed at step 4 under LLM tp1·dp4 / vision dp2
# (every degree changes, DP both ways; test_builtin_resume resumes the digits from dp to tp). The training split streams from the shards (``train.stream_buffer``): every resumed step trains on
# the very sample ids of the uninterrupted run, none missing or repeated (test_stream.py checks the reader).
BEFORE = ["llm.layout.tp=2", "llm.layout.dp=1", "llm.layout.pp=2", "batch.micro_batch_size=4",
          "vision.layout.dp=4", "vision.micro_batch_size=1"]
AFTER = ["placement=auto", "llm.layout.tp=1", "llm.layout.dp=4", "llm.layout.pp=1", "batch.micro_batch_size=1",
         "vision.layout.dp=2", "vision.layout.ranks=[0,1]", "vision.micro_batch_size=2"]
STREAMED = ["batch.global_batch_size=16", "train.checkpoint.keep=0", "train.stream_buffer=64", "train.sample_log=true"]


def samples(tmp_path, run):
    lines = (tmp_path / run / "colocated_vlm" / "samples.jsonl").read_text().splitlines()
    return {row["step"]: row["ids"] for row in map(json.loads, lines)}


def test_resume_under_new_layouts_reshards_and_matches(tmp_path):
    out = hetero_train(tmp_path, "straight", "colocated_vlm", *BEFORE, *STREAMED, "train.wandb=offline")
    assert "--nproc_per_node=4" in out
    assert "boundary.vision->llm.forward=" in out and "grad_sync.vision=" in out and "pipeline.llm.forward=" in out
    assert "step     8 | held-out loss" in out and "llm: loss" in out and "digit accuracy" in out
    assert "summary: steps 8" in out
    runs = list((tmp_path / "straight" / "colocated_vlm" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))  # the offline run's log file
    assert (tmp_path / "digits" / "manifest.json").is_file()  # shards written on first use
    straight_ids = samples(tmp_path, "straight")
    assert sorted(straight_ids) == list(range(1, 9))
    consumed = [i for step in range(1, 9) for i in straight_ids[step]]
    assert len(consumed) == len(set(consumed)) == 8 * 16  # less than an epoch: no sample twice

    checkpoint = tmp_path / "straight" / "colocated_vlm" / "checkpoints" / "step_000004"
    out = hetero_train(tmp_path, "resharded", "colocated_vlm", *AFTER, *STREAMED,
                       f"train.checkpoint.resume={checkpoint}")
    assert "weights and optimizer states were resharded" in out
    straight, resumed = losses(tmp_path, "straight", "colocated_vlm"), losses(tmp_path, "resharded", "colocated_vlm")
    assert sorted(resumed) == [5, 6, 7, 8]
    errors = [abs(resumed[s] - straight[s]) / abs(straight[s]) for s in range(5, 9)]
    print("relative loss errors after resharding, steps 5-8:", [f"{e:.1e}" for e in errors])
    assert max(errors) < 1e-5
    resharded_ids = samples(tmp_path, "resharded")
    assert sorted(resharded_ids) == [5, 6, 7, 8]
    assert all(resharded_ids[s] == straight_ids[s] for s in resharded_ids)


def test_resume_from_ep2_under_ep1_continues_the_run(tmp_path):
    """moe_vlm's experts split over ep2, resumed at step 4 with every expert on every rank (ep1): each
    rank's experts come out of the ep2 shards (steps 5-6: the weights, then the optimizer states).
    Capacity-limited routing reports its dropped fraction."""
    capacity = ["llm.model.capacity_factor=1.0", "train.steps=6"]
    out = hetero_train(tmp_path, "straight", "moe_vlm", *capacity)
    (line,) = [line for line in out.splitlines() if line.startswith("step     4 | loss")]
    assert "all_to_all.llm=" in line and "balance_loss" in line and "z_loss" in line, line
    dropped = float(line.split("dropped ")[1].split("%")[0])
    print("step 4:", line.split(" | ")[-1], f"(dropped {dropped}%)")
    assert 0 < dropped < 50
    checkpoint = tmp_path / "straight" / "moe_vlm" / "checkpoints" / "step_000004"
    out = hetero_train(tmp_path, "resharded", "moe_vlm", *capacity, "llm.layout.ep=1",
                       f"train.checkpoint.resume={checkpoint}")
    assert "weights and optimizer states were resharded" in out and "all_to_all.llm=" not in out
    straight, resumed = losses(tmp_path, "straight", "moe_vlm"), losses(tmp_path, "resharded", "moe_vlm")
    assert sorted(resumed) == [5, 6]
    errors = [abs(resumed[s] - straight[s]) / abs(straight[s]) for s in range(5, 7)]
    print("relative loss errors after resuming ep2 -> ep1, steps 5-6:", [f"{e:.1e}" for e in errors])
    assert max(errors) < 1e-5


def test_genezip_trains_under_tp2_and_resume_carries_the_region_budget(tmp_path):
    """genezip: the DNA compressor alone under tp2, genome shards written on first use (per window), its
    progress and held-out lines and checkpoints (every 2 steps and at the last, step 5). Its region budget
    (the controller's biases and EMAs, model buffers that change after every step) crosses the checkpoint:
    steps 3-5 after a resume at step 2 equal the uninterrupted run's. (Resuming the lone job on one
    process is checked in test_faults.py.)"""
    small = ["batch.global_batch_size=4", "batch.micro_batch_size=4", "dna.model.seq_len=256", "train.steps=5",
             "train.checkpoint.every=2", "train.checkpoint.keep=0", f"train.genome_dir={tmp_path / 'genome'}"]
    out = hetero_train(tmp_path, "straight", "genezip", *small)
    assert "--nproc_per_node=2" in out
    assert "step     5 | loss" in out and "dna loss" in out and "ratio" in out
    (heldout,) = [line for line in out.splitlines() if line.startswith("step     5 | held-out")]
    for metric in ("bits per base", "bpt.intergenic", "bpt.coding", "fewest per window"):
        assert metric in heldout, heldout
    assert (tmp_path / "genome" / "window256" / "manifest.json").is_file()
    checkpoints = tmp_path / "straight" / "genezip" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000002", "step_000004", "step_000005"]
    hetero_train(tmp_path, "resumed", "genezip", *small, f"train.checkpoint.resume={checkpoints / 'step_000002'}")
    straight, resumed = losses(tmp_path, "straight", "genezip"), losses(tmp_path, "resumed", "genezip")
    assert sorted(resumed) == [3, 4, 5]
    assert [resumed[s] for s in (3, 4, 5)] == [straight[s] for s in (3, 4, 5)]
