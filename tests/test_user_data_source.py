"""A data format defined outside hetero (``examples/signal_encoder/source.py``), registered the way an
installed package registers it (an entry point of the group ``hetero.datasets``, beside its kind's in
``hetero.kinds``), trains a signal encoder and an LLM with ``hetero train``: the loss falls."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

EXPERIMENT = """
name: signals
world_size: 2
placement: colocated
batch: {{global_batch_size: 16, micro_batch_size: 16}}
audio:
  kind: signal
  model: {{length: 32, stride: 4, channels: 16, out_size: 32}}
  optim: {{lr: 3.0e-3}}
  layout: {{dp: 2}}
  micro_batch_size: 8
llm:
  kind: gpt
  model: {{vocab_size: 256, hidden_size: 32, num_layers: 2, num_heads: 4, seq_len: 24}}
  optim: {{lr: 3.0e-3}}
  layout: {{tp: 2}}
train: {{steps: 60, log_every: 10, eval_every: 30, wandb: disabled, run_dir: {runs},
        data: {{format: signals, options: {{frequencies: 4}}}}}}
edges:
  - {{src: audio, dst: llm}}
"""


def installed(site: Path) -> dict[str, str]:
    """An environment where the example is installed as a package: its metadata (a dist-info directory
    with the entry points of its pyproject.toml) and its code on the path."""
    info = site / "signal_encoder-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: signal-encoder\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[hetero.kinds]\nsignal = signal_encoder.kind:SignalKind\n\n"
                                           "[hetero.datasets]\nsignals = signal_encoder.source:SignalFormat\n")
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(EXAMPLES)])}


def test_a_registered_user_format_trains(tmp_path):
    env = installed(tmp_path / "site")
    config = tmp_path / "signals.yaml"
    config.write_text(EXPERIMENT.format(runs=tmp_path / "runs"))
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", str(config)], capture_output=True, text=True,
                          timeout=400, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step +\d+ \| loss ([0-9.]+)", done.stdout, flags=re.M)]
    heldout = [float(x) for x in re.findall(r"held-out loss ([0-9.]+)", done.stdout)]
    print(f"\nlosses every 10 steps: {losses}; held-out at 30 and 60: {heldout}")
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    assert len(heldout) == 2 and heldout[1] < heldout[0], heldout
