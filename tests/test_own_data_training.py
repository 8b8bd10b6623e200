"""``hetero train own_data_vlm`` on LLaVA conversations about real images (``hetero data example``): a
tower and a projector at dp2 on ranks 0-1 and the LLM at tp2 on ranks 2-3. Each rank decoding only the
images its modules take trains bit for bit as every rank decoding every image; the same data through a
colocated layout (all three on ranks 0-1) gives the same losses step by step. Packed, and on a mixture of
conversations, image-caption shards and the digits."""

import json
import re
import subprocess
import sys

import pytest

from hetero.data.example import write_llava, write_webdataset


def run(tmp_path, name, *overrides):
    """Each step's loss and pre-clip gradient norm (``metrics.jsonl``), then the held-out loss."""
    data = tmp_path / "llava" / "conversations.json"
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm", f"train.data.path={data}",
                           "train.steps=3", "train.log_every=1", "train.eval_every=3", "train.wandb=disabled",
                           f"train.run_dir={tmp_path / name}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [row for row in map(json.loads, (tmp_path / name / "own_data_vlm" / "metrics.jsonl").open())
             if "loss" in row]  # the steps' records
    heldout = [float(x) for x in re.findall(r"held-out loss ([0-9.]+)", done.stdout)]
    return [(step["loss"], step["grad_norm"]) for step in steps], heldout


# packed rows only: one sample a row read per rank is test_a_mixture_read_per_rank_trains_bit_for_bit_as_read_everywhere's
@pytest.mark.parametrize("rows", ["packed"])
def test_per_rank_loading_and_colocation_train_the_same_on_the_same_conversations(tmp_path, rows):
    write_llava(tmp_path / "llava", 400, seed=0)
    pack = f"train.data.pack={str(rows == 'packed').lower()}"
    apart = run(tmp_path, "apart", pack)
    everything = run(tmp_path, "everything", pack, "train.data.per_rank=false")
    together = run(tmp_path, "together", pack, "world_size=2", "placement=colocated", "llm.layout.offset=0")
    print(f"\n{rows}: (loss, grad norm) per step, held-out: ranks apart {apart}, every rank every image "
          f"{everything}, colocated {together}")
    assert apart == everything  # bit for bit
    assert len(apart[0]) == len(together[0]) == 3 and len(apart[1]) == len(together[1]) == 1
    for (loss, norm), (loss_, norm_) in zip(apart[0], together[0]):
        assert abs(loss - loss_) <= 1e-5 * loss and abs(norm - norm_) <= 1e-4 * norm
    assert abs(apart[1][0] - together[1][0]) <= 2e-4 * apart[1][0]


def test_a_mixture_read_per_rank_trains_bit_for_bit_as_read_everywhere(tmp_path):
    """Conversations, image-caption shards and a built-in dataset (the digits, each a conversation about its
    image) drawn 2:1:1: per-rank loading trains bit for bit as reading everything, and each step holds
    digits and samples of the others."""
    path = write_llava(tmp_path / "llava", 300, seed=0)
    shards = write_webdataset(tmp_path / "shards", 200, seed=0)[0].parent
    mixture = (f"+train.data.mixture=[{{format: digits, weight: 1}}, {{format: llava, path: '{path}', weight: 2}}, "
               f"{{format: webdataset, path: '{shards}', weight: 1}}]")
    where = [f"train.data_dir={tmp_path / 'digits'}", "train.sample_log=true"]
    apart = run(tmp_path, "apart", mixture, *where)
    everything = run(tmp_path, "everything", mixture, *where, "train.data.per_rank=false")
    print(f"\nmixture: (loss, grad norm) per step, held-out: per rank {apart}, every rank everything {everything}")
    assert len(apart[0]) == 3 and len(apart[1]) == 1 and apart == everything  # bit for bit
    digits = 1621  # the digits' training split comes first in the mixture's sample ids
    for line in (tmp_path / "apart" / "own_data_vlm" / "samples.jsonl").open():
        ids = json.loads(line)["ids"]
        assert len(ids) == 16 and any(i < digits for i in ids) and any(i >= digits for i in ids)


NATIVE = """
name: native_own_data
world_size: 2
placement: colocated
batch: {{global_batch_size: 4, micro_batch_size: 4}}
vision:
  kind: vit
  model: {{image_size: 32, patch_size: 8, channels: 3, hidden_size: 32, num_layers: 1, num_heads: 2, out_size: 32,
          class_token: false, max_patches: 24}}
  layout: {{dp: 2}}
  micro_batch_size: 2
llm:
  kind: gpt
  model: {{vocab_size: 256, hidden_size: 32, num_layers: 1, num_heads: 2, seq_len: 512}}
  layout: {{cp: 2}}
train: {{steps: 3, log_every: 1, eval_every: 3, wandb: disabled, run_dir: {runs},
        data: {{format: llava, path: {data}, pack: true, per_rank: {per_rank}}}}}
edges:
  - {{src: vision, dst: llm}}
"""


def test_packed_native_resolution_rows_under_cp2_train_the_same_decoded_per_rank(tmp_path):
    data = write_llava(tmp_path / "llava", 200, seed=0)
    results = []
    for per_rank in ("true", "false"):
        config = tmp_path / f"native_{per_rank}.yaml"
        config.write_text(NATIVE.format(runs=tmp_path / per_rank, data=data, per_rank=per_rank))
        done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", str(config)], capture_output=True,
                              text=True, timeout=400, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = [row for row in map(json.loads, (tmp_path / per_rank / "native_own_data" / "metrics.jsonl").open())
                if "loss" in row]
        results.append([(row["loss"], row["grad_norm"]) for row in rows])
    print(f"\npacked native rows, LLM cp2 (loss, grad norm): per rank {results[0]}, every image {results[1]}")
    assert len(results[0]) == 3 and results[0] == results[1]
