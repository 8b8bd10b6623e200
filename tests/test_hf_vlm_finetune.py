"""A VLM fine-tuned from imported Hugging Face weights with ``hetero train``, end to end: a tiny random
SigLIP tower (``vision.init.hf``) and a tiny random Llama (``llm.init.hf``), joined by a projector module
trained from scratch, on the captioned digits, colocated on two ranks (tower dp2, projector dp2, LLM
tp2). The loss falls, and ``hetero convert`` writes both towers from the final checkpoint as
checkpoints that ``transformers`` loads, trained (no tensor equals the source's) and computing what
hetero's import of them computes."""

import re
import subprocess
import sys

import torch
import transformers
from test_hf_vision import images
from test_hf_import import imported

from hetero.cli import main
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.models.vit.hf import load_vit, vit_config
from hetero.models.vit.model import VisionEncoder

EXPERIMENT = """\
# @package _global_
defaults:
  - /hetero/module@vision
  - /hetero/module@projector
  - /hetero/module@llm
  - _self_
name: pretrained_vlm
world_size: 2
placement: colocated
batch: {{global_batch_size: 8, micro_batch_size: 4}}
vision: {{kind: vit, init: {{hf: {vision}}}, layout: {{dp: 2}}, optim: {{lr: 1.0e-3, warmup_steps: 0}}}}
projector:
  kind: projector
  model: {{in_size: 32, out_size: 32, tokens: 16}}
  layout: {{dp: 2}}
  optim: {{lr: 1.0e-3, warmup_steps: 0}}
llm: {{kind: gpt, init: {{hf: {llm}}}, model: {{seq_len: 48}}, layout: {{tp: 2}}, micro_batch_size: 8, optim: {{lr: 1.0e-3, warmup_steps: 0}}}}
train: {{steps: 40, eval_every: 0, log_every: 10, eval_batches: 1, wandb: disabled, checkpoint: {{every: 40}},
        data_dir: {data}, run_dir: {runs}}}
edges:
  - {{src: vision, dst: projector}}
  - {{src: projector, dst: llm}}
"""


def saved_towers(tmp_path):
    torch.manual_seed(0)
    vision = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_channels=1,
        image_size=32, patch_size=8, vision_use_head=False))
    vision.save_pretrained(tmp_path / "siglip")
    llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    llm.save_pretrained(tmp_path / "llama")


def test_a_vlm_fine_tuned_from_imported_towers_learns_and_exports(tmp_path):
    saved_towers(tmp_path)
    config = tmp_path / "pretrained_vlm.yaml"
    config.write_text(EXPERIMENT.format(vision=tmp_path / "siglip", llm=tmp_path / "llama", data=tmp_path / "digits",
                                        runs=tmp_path / "runs"))
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", str(config)], capture_output=True, text=True,
                          timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ \| loss ([0-9.]+)", done.stdout, flags=re.M)]
    print(f"\nlosses every 10 steps: {losses}")
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    step = tmp_path / "runs" / "pretrained_vlm" / "checkpoints" / "step_000040"
    for module in ("vision", "llm"):  # in this process: a start of its own would cost more than converting
        assert main(["convert", str(step), str(tmp_path / module), "--module", module]) == 0
    source, trained = HFCheckpoint(tmp_path / "siglip"), HFCheckpoint(tmp_path / "vision")
    assert sorted(trained.names()) == sorted(source.names())
    assert all(not torch.equal(source.tensor(n), trained.tensor(n)) for n in source.names() if "bias" not in n)
    tower = transformers.SiglipVisionModel.from_pretrained(tmp_path / "vision").eval()
    ours = VisionEncoder(vit_config(trained.config, {}))
    load_vit(ours, tmp_path / "vision")
    with torch.no_grad():
        expected, got = tower(pixel_values=images()).last_hidden_state, ours.eval()(images())
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
    llm = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llm", dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, got = llm(tokens).logits, imported(tmp_path / "llm").eval()(tokens)
    assert ((got - expected).abs().max() / expected.abs().max()).item() < 1e-5
