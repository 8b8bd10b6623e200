"""The Qwen-VL recipe end to end, as a user runs it (with fewer steps): ``hetero tiny-vlm``, ``hetero train
qwen_vl_sft`` on the example conversations (tower dp2 on ranks 0-1, LLM tp2 on ranks 2-3), ``hetero convert
--vlm``. Untrained (learning rates 0), the export is the source: every tensor bit for bit, config.json and
the side files byte for byte. Trained, transformers loads the export, and its loss on the job's held-out
batch equals the held-out loss the job reported at that step."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from hetero.cli import main
from hetero.config import load_experiment
from hetero.data.example import write_llava
from hetero.data.splits import load
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.tiny_vlm import write_tiny_vlm
from hetero.testing.kinds import build_graph
from hetero.testing.qwen_vl import transformers_loss

STEPS = 4
MODELS = {"qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
          "qwen3-vl": transformers.Qwen3VLForConditionalGeneration}


def train(tmp_path, *overrides):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "qwen_vl_sft", f"train.steps={STEPS}",
                           "train.log_every=2", f"train.eval_every={STEPS}", "train.eval_batches=1",
                           f"train.checkpoint.every={STEPS}", "train.wandb=disabled",
                           f"train.run_dir={tmp_path / 'runs'}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "qwen_vl_sft"
    heldout = [json.loads(line) for line in (run / "metrics.jsonl").open() if '"heldout"' in line][-1]["heldout"]
    return run / "checkpoints" / f"step_{STEPS:06d}", heldout["loss"]


def export_loss(path, family, batch) -> float:
    """The loss of the export on ``batch`` (hetero's rows)."""
    with torch.no_grad():
        return transformers_loss(MODELS[family].from_pretrained(path, dtype=torch.float32).eval(), batch).item()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_llava(tmp_path_factory.mktemp("example"), 96, seed=0)


def test_an_untrained_qwen3_vl_round_trip_is_bit_for_bit(tmp_path, data):
    source = write_tiny_vlm(tmp_path / "tiny", "qwen3-vl")
    step, _ = train(tmp_path, f"vision.init.hf={source}", f"train.data.path={data}", "vision.optim.lr=0",
                    "llm.optim.lr=0")
    assert main(["convert", str(step), str(tmp_path / "out"), "--vlm"]) == 0
    ours, theirs = HFCheckpoint(tmp_path / "out"), HFCheckpoint(source)
    assert sorted(ours.names()) == sorted(theirs.names())
    for name in theirs.names():
        assert torch.equal(ours.tensor(name), theirs.tensor(name)), name
    for file in ("config.json", "tokenizer.json", "chat_template.jinja", "preprocessor_config.json"):
        assert (tmp_path / "out" / file).read_bytes() == (source / file).read_bytes(), file


def test_a_trained_qwen2_5_vl_exports_what_the_job_evaluated(tmp_path, data):
    source = write_tiny_vlm(tmp_path / "tiny", "qwen2.5-vl")
    overrides = [f"vision.init.hf={source}", f"train.data.path={data}"]
    step, reported = train(tmp_path, *overrides)
    assert main(["convert", str(step), str(tmp_path / "out"), "--vlm"]) == 0
    experiment = load_experiment("qwen_vl_sft", overrides + ["train.data.per_rank=false"])
    heldout = load(experiment, build_graph(experiment), "heldout")
    batch = next(b for b in heldout.ordered_batches(None) if len(b["tokens"]) == heldout.global_batch_size)
    before, after = export_loss(source, "qwen2.5-vl", batch), export_loss(tmp_path / "out", "qwen2.5-vl", batch)
    print(f"\nheld-out loss: hetero reported {reported:.6f} at step {STEPS}; transformers on the export {after:.6f} "
          f"(on the source {before:.6f})")
    assert abs(after - reported) <= 1e-5 * reported and abs(before - after) > 0.01


def test_the_variants_compose(tmp_path, data):
    """The long-context variant (LLM cp2·tp2 on ranks 2-5, packed rows) and the frozen tower build from an
    imported Qwen-VL (their training: tests/test_qwen_vl_data.py runs the long-context one's rows)."""
    source = write_tiny_vlm(tmp_path / "tiny", "qwen2.5-vl")
    common = [f"vision.init.hf={source}", f"train.data.path={data}"]
    long = build_graph(load_experiment("qwen_vl_long_context", common))
    assert (long.nodes["llm"].layout.cp, long.nodes["llm"].layout.tp, long.nodes["llm"].config.seq_len) == (2, 2, 1024)
    frozen = load_experiment("qwen_vl_frozen_tower", common)
    assert not frozen.modules["vision"].trainable and frozen.modules["llm"].trainable
