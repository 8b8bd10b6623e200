"""Every built-in dataset resumes at another layout on the samples it left: a job saved after step 1 under
one layout and resumed under another trains step 2 on the sample ids (``train.sample_log``) that the
uninterrupted job trained step 2 on, and logs no other step (none missing, none repeated)."""

import json
import subprocess
import sys

import pytest

# experiment: (its dataset, the layout it resumes at)
RESHARDED = {
    "colocated_vlm": ("digits", ["world_size=2", "vision.layout.dp=2", "vision.micro_batch_size=22",
                                 "llm.layout.tp=1", "llm.layout.dp=2"]),
    "dna_vlm": ("digits_dna", ["llm.layout.tp=4", "llm.layout.dp=1", "llm.micro_batch_size=16"]),
    "full_graph": ("multimodal", ["llm.layout.tp=1", "llm.layout.dp=2", "llm.micro_batch_size=2"]),
    "video": ("video_clips", ["video.layout.tp=1", "video.layout.dp=2", "batch.micro_batch_size=4"]),
    "genezip": ("genome", ["dna.layout.tp=1", "dna.layout.dp=2", "batch.micro_batch_size=8"]),
    "text_lm": ("stdlib_text", ["world_size=2", "llm.layout.dp=2", "batch.micro_batch_size=8"]),
    "long_context_native_vlm": ("photo_documents", ["llm.layout.tp=4", "llm.layout.cp=1"]),
}


def sample_ids(tmp_path, experiment: str, name: str, *overrides: str) -> dict[int, list[int]]:
    run_dir = tmp_path / name
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", experiment, "train.steps=2",
                           "train.eval_every=0", "train.log_every=1", "train.sample_log=true", "train.wandb=disabled",
                           "train.checkpoint.every=1", "train.checkpoint.keep=0", f"train.run_dir={run_dir}",
                           f"train.data_dir={tmp_path / 'digits'}", f"train.genome_dir={tmp_path / 'genome'}",
                           f"train.clip_dir={tmp_path / 'clips'}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / experiment / "samples.jsonl").open()]
    return {line["step"]: line["ids"] for line in lines}


@pytest.mark.parametrize("experiment", RESHARDED)
def test_a_builtin_dataset_resumes_at_another_layout_on_the_samples_it_left(tmp_path, experiment):
    dataset, layout = RESHARDED[experiment]
    whole = sample_ids(tmp_path, experiment, "whole")
    saved = tmp_path / "whole" / experiment / "checkpoints" / "step_000001"
    resumed = sample_ids(tmp_path, experiment, "resumed", f"train.checkpoint.resume={saved}", *layout)
    print(f"\n{dataset}: step 2's ids {whole[2][:8]}...")
    assert sorted(whole) == [1, 2] and len(set(map(tuple, whole.values()))) == 2  # the steps differ
    assert resumed == {2: whole[2]}
