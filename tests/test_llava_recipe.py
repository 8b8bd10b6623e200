"""LLaVA's two stages end to end from a whole imported LLaVA, as the README runs them (with fewer steps):
``hetero tiny-llava``, ``hetero train llava_stage1`` on caption shards (tower and LLM frozen),
``hetero train llava_stage2`` on conversations (the tower frozen; every module's sizes from the LLaVA,
its weights from stage 1's checkpoint), ``hetero convert --llava``. Each stage's export keeps what was
frozen bit for bit and changes what trained; transformers loads the last one and generates."""

import subprocess
import sys

import torch

from hetero.cli import main
from hetero.data.example import write_llava, write_webdataset
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.tiny_llava import write_tiny_llava


def train(tmp_path, stage, *overrides):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", stage, "train.steps=4", "train.log_every=2",
                           "train.eval_every=0", "train.eval_batches=1", "train.checkpoint.every=4",
                           "train.wandb=disabled", f"train.run_dir={tmp_path / 'runs'}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp_path / "runs" / stage / "checkpoints" / "step_000004"


def parts(path) -> dict[str, dict[str, torch.Tensor]]:
    checkpoint = HFCheckpoint(path)
    out: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}, "llm": {}}
    for name, tensor in checkpoint.tensors(checkpoint.names()):
        part = "vision" if name.startswith("vision_tower") else "projector" if "projector" in name else "llm"
        out[part][name] = tensor
    return out


def changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


def test_the_two_stages_run_from_an_imported_llava_to_one_that_transformers_generates_with(tmp_path):
    source = write_tiny_llava(tmp_path / "tiny_llava", "clip-llama")
    captions, conversations = write_webdataset(tmp_path / "captions", 160, 0), write_llava(tmp_path / "example", 160, 0)
    first = train(tmp_path, "llava_stage1", f"vision.init.hf={source}", f"train.data.path={tmp_path / 'captions'}")
    second = train(tmp_path, "llava_stage2", f"vision.init.hf={source}", f"vision.init.checkpoint={first}",
                   f"train.data.path={conversations}")
    assert captions
    for step, out in ((first, "stage1"), (second, "stage2")):
        assert main(["convert", str(step), str(tmp_path / out), "--llava"]) == 0
    before, after_1, after_2 = parts(source), parts(tmp_path / "stage1"), parts(tmp_path / "stage2")
    assert changed(before["vision"], after_1["vision"]) == changed(before["llm"], after_1["llm"]) == []
    assert len(changed(before["projector"], after_1["projector"])) == 4
    assert changed(before["vision"], after_2["vision"]) == []
    assert len(changed(after_1["projector"], after_2["projector"])) == 4
    assert len(changed(before["llm"], after_2["llm"])) == len(before["llm"])
    for name in ("config.json", "tokenizer.json", "chat_template.jinja", "processor_config.json"):
        assert (tmp_path / "stage2" / name).read_bytes() == (source / name).read_bytes(), name
    done = subprocess.run([sys.executable, "scripts/llava_generate.py", str(tmp_path / "stage2"), "astronaut"],
                          capture_output=True, text=True, timeout=300, cwd=__file__.rsplit("/tests/", 1)[0])
    assert done.returncode == 0 and done.stdout.startswith("astronaut: "), done.stdout + done.stderr[-2000:]
