"""``hetero train own_data_vlm`` on LLaVA conversations about real images (``hetero data example``): a
tower and a projector at dp2 on ranks 0-1 and the LLM at tp2 on ranks 2-3, against the same data through
a colocated layout (all three on ranks 0-1): the same losses, step by step, with one sample a row and
with samples packed."""

import re
import subprocess
import sys

import pytest

from hetero.data.example import write_llava


def losses(tmp_path, *overrides):
    data = tmp_path / "llava" / "conversations.json"
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm", f"train.data.path={data}",
                           "train.steps=3", "train.log_every=1", "train.eval_every=3", "train.wandb=disabled",
                           f"train.run_dir={tmp_path / 'runs'}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [float(x) for x in re.findall(r"^step +\d+ \| loss ([0-9.]+)", done.stdout, flags=re.M)]
    heldout = [float(x) for x in re.findall(r"held-out loss ([0-9.]+)", done.stdout)]
    return steps + heldout


@pytest.mark.parametrize("rows", ["one sample a row", "packed"])
def test_separate_and_colocated_layouts_train_the_same_on_the_same_conversations(tmp_path, rows):
    write_llava(tmp_path / "llava", 400, seed=0)
    pack = [f"train.data.pack={str(rows == 'packed').lower()}"]
    apart = losses(tmp_path, *pack)
    together = losses(tmp_path, *pack, "world_size=2", "placement=colocated", "llm.layout.offset=0")
    print(f"\n{rows}: losses (3 steps, then held-out): ranks apart {apart}, colocated {together}")
    assert len(apart) == len(together) == 4
    assert all(abs(a - b) <= 2e-4 * abs(a) for a, b in zip(apart, together)), (apart, together)
