"""The built-in datasets' jobs train bit for bit the same whether each rank holds only the rows its
modules read (``train.data.per_rank``, the default: compact batches) or every rank the global batch:
every step's loss, loss parts and pre-clip gradient norm, and the held-out figures, ``==``. Layouts with
dp > 1, so that ranks do hold different rows: the main job (vision dp4 beside an LLM at tp2·dp2), the VLM
on digits and DNA (vision and DNA dp2 on their own ranks, an LLM at tp2·dp2 across all four), the video
generator at dp2, GeneZip at dp2, and packed rows of photographs at native resolution (vision dp4, each
replica holding its images' patches alone, beside an LLM at tp2·dp2)."""

import json
import subprocess
import sys

import pytest

JOBS = {
    "colocated_vlm": [],
    "dna_vlm": [],
    "video": ["video.layout.tp=1", "video.layout.dp=2", "batch.micro_batch_size=4"],
    "genezip": ["dna.layout.tp=1", "dna.layout.dp=2", "batch.micro_batch_size=8"],
    "long_context_native_vlm": ["llm.model.seq_len=1024", "llm.layout.cp=1", "llm.layout.dp=2",
                                "llm.micro_batch_size=2"],
}


def run(tmp_path, experiment: str, per_rank: bool, overrides: list[str]) -> list[dict]:
    """Every record of ``metrics.jsonl`` (steps, the evaluation, the summary) but the timings."""
    run_dir = tmp_path / f"per_rank_{per_rank}"
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", experiment, "train.steps=3",
                           "train.log_every=1", "train.eval_every=3", "train.eval_batches=2", "train.wandb=disabled",
                           f"train.data.per_rank={str(per_rank).lower()}", f"train.run_dir={run_dir}",
                           f"train.data_dir={tmp_path / 'digits'}", f"train.genome_dir={tmp_path / 'genome'}",
                           f"train.clip_dir={tmp_path / 'clips'}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [untimed(row) for row in map(json.loads, next(run_dir.glob("*/metrics.jsonl")).open())]


def untimed(record):
    if not isinstance(record, dict):
        return record
    return {k: untimed(v) for k, v in record.items() if k not in ("samples_per_s", "step_s", "data_wait_ms", "seconds")}


@pytest.mark.parametrize("experiment", JOBS)
def test_compact_batches_train_bit_for_bit_as_global_ones(tmp_path, experiment):
    compact = run(tmp_path, experiment, True, JOBS[experiment])
    whole = run(tmp_path, experiment, False, JOBS[experiment])
    steps = [row for row in compact if "grad_norm" in row]
    print(f"\n{experiment}: per step (loss, grad norm) {[(r['loss'], r['grad_norm']) for r in steps]}")
    assert len(steps) == 3 and len(compact) == len(whole) and any("heldout" in str(row) for row in compact)
    assert compact == whole
