"""What a training run reports: a progress line on the console, the same metrics to wandb and, one JSON
object per logged step, to ``<run dir>/metrics.jsonl`` (appended to, so a resumed run continues it).
That file's records: a logged step ``{"step", "loss", ...}``, a skipped step ``{"step", "skipped"}``, a
held-out evaluation ``{"step", "heldout": {...}, "seconds"}`` and, at the end, ``{"summary": {...}}``;
floats as Python writes them (full precision). ``hetero eval`` logs the same under ``<run dir>/eval``.

wandb runs offline by default (``train.wandb=offline``) and writes its run directory under the run's
folder, so no network or account is ever needed; ``train.wandb=disabled`` turns it off. Only one rank
(rank 0) logs.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetero.config import ExperimentConfig


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError


class RunLog:
    def __init__(self, experiment: ExperimentConfig, run_dir: Path, enabled: bool, job_type: str = "train"):
        self.enabled = enabled
        self.wandb: Any = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.history = (run_dir / "metrics.jsonl").open("a")
        self.sample_ids = None  # samples.jsonl, opened by the first samples() call
        print(f"run {experiment.name}: {run_dir}", flush=True)
        if experiment.train.wandb != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self.wandb = wandb.init(
                project=experiment.train.wandb_project,
                name=experiment.name,
                dir=str(run_dir),
                mode=experiment.train.wandb,
                config=asdict(experiment),
                job_type=job_type,
            )

    def progress(self, step: int, metrics: dict[str, float], comm: dict[str, int]) -> None:
        if not self.enabled:
            return
        traffic = " ".join(f"{name}={_bytes(value)}" for name, value in comm.items() if value)
        residuals = " ".join(f"{k}={v:.3g}" for k, v in metrics.items() if k.startswith("ef_residual.") and v)
        if metrics.get("ec_memory_bytes"):
            residuals += f" ec_memory={_bytes(metrics['ec_memory_bytes'])}"
        for key in (k for k in metrics if k.startswith("expert_load.")):
            name = key.removeprefix("expert_load.")
            residuals += (f" {name} experts max/mean {metrics[key]:.2f}, dropped "
                          f"{metrics[f'expert_dropped.{name}']:.1%}")
        fields = [f"step {step:5d}", f"loss {metrics['loss']:.4f}{_module_losses(metrics)}",
                  f"{metrics['samples_per_s']:7.1f} samples/s", f"{metrics['step_s'] * 1e3:7.1f} ms",
                  f"data wait {metrics['data_wait_ms']:.1f} ms ({metrics['data_wait_ms'] / (metrics['step_s'] * 1e3):.0%})"
                  if "data_wait_ms" in metrics else "",
                  f"grad norm {metrics['grad_norm']:.3f}", traffic, residuals.strip(),
                  f"data skipped {int(metrics['data/skipped'])}" if metrics.get("data/skipped") else ""]
        print(" | ".join(f for f in fields if f), flush=True)
        if self.wandb is not None:
            self.wandb.log(metrics | {f"bytes/{k}": v for k, v in comm.items()}, step=step)
        self.history.write(json.dumps({"step": step} | metrics | {f"bytes/{k}": v for k, v in comm.items()}) + "\n")
        self.history.flush()

    def samples(self, step: int, ids) -> None:
        """The ids of the samples step ``step`` trained on, one JSON line (``train.sample_log``)."""
        if not self.enabled:
            return
        if self.sample_ids is None:
            self.sample_ids = (self.run_dir / "samples.jsonl").open("a")
        self.sample_ids.write(json.dumps({"step": step, "ids": [int(i) for i in ids]}) + "\n")
        self.sample_ids.flush()

    def resumed(self, path: Path, step: int, same_local: bool, fresh_optimizers: list[str] = ()) -> None:
        if not self.enabled:
            return
        print(f"resumed from {path} at step {step}", flush=True)
        if fresh_optimizers:
            print(f"{', '.join(fresh_optimizers)}: the checkpoint holds no optimizer state for (some of) its trained "
                  f"parameters, frozen when it was saved; AdamW starts afresh there", flush=True)
        if not same_local:
            print(
                "layouts or compression settings differ from the checkpoint's: weights and optimizer states were "
                "resharded; error-feedback buffers, DiLoCo's outer state, edge compensation and the RNG start afresh",
                flush=True,
            )

    def skipped(self, step: int, where: dict[str, list[str]]) -> None:
        """A step skipped on every rank because of non-finite values: which modules, on which ranks (when
        known: a job that checks after its gradient sync sees them everywhere)."""
        if not self.enabled:
            return
        found = "; ".join(f"{name} on {', '.join(ranks)}" if ranks else name for name, ranks in where.items())
        print(f"step {step:5d} | skipped: non-finite loss or gradients in {found}; nothing was updated", flush=True)
        if self.wandb is not None:
            self.wandb.log({"skipped_step": 1}, step=step)
        self.history.write(json.dumps({"step": step, "skipped": where}) + "\n")
        self.history.flush()

    def evaluation(self, step: int, heldout: dict[str, float], seconds: float) -> None:
        """Held-out figures: the combined ``loss`` and, per module, its loss, parts and metrics
        (``<module>.<name>``), e.g. ``held-out loss 2.1234 | llm: loss 2.1234, digit accuracy 0.938``."""
        if not self.enabled:
            return
        modules: dict[str, list[str]] = {}
        for key, value in heldout.items():
            if "." in key:
                module, name = key.split(".", 1)
                modules.setdefault(module, []).append(f"{name.replace('_', ' ')} {value:.4g}")
        shown = "".join(f" | {module}: {', '.join(parts)}" for module, parts in modules.items())
        print(f"step {step:5d} | held-out loss {heldout['loss']:.4f}{shown} | {seconds:.0f} s", flush=True)
        if self.wandb is not None:
            self.wandb.log({f"heldout/{key}": value for key, value in heldout.items()}, step=step)
        self.history.write(json.dumps({"step": step, "heldout": heldout, "seconds": seconds}) + "\n")
        self.history.flush()

    def evaluating(self, sources: dict[str, Path], step: int) -> None:
        """``hetero eval``: which checkpoint each module's weights come from."""
        if not self.enabled:
            return
        modules: dict[Path, list[str]] = {}
        for module, path in sources.items():
            modules.setdefault(path, []).append(module)
        loaded = "; ".join(f"{', '.join(names)} from {path}" for path, names in modules.items())
        print(f"evaluating step {step}: {loaded}", flush=True)

    def finish(self, summary: dict[str, float]) -> None:
        """Print and log the job's summary, then leave the process group (every rank calls it)."""
        if self.enabled:
            print("summary: " + ", ".join(f"{k} {v:.4g}" for k, v in summary.items()), flush=True)
            self.history.write(json.dumps({"summary": summary}) + "\n")
            self.history.close()
            if self.wandb is not None:
                self.wandb.summary.update(summary)
                self.wandb.finish()
                print(f"wandb offline run: {self.wandb.dir if hasattr(self.wandb, 'dir') else self.run_dir}",
                      flush=True)
        dist.barrier()
        dist.destroy_process_group()


def _module_losses(metrics: dict[str, float]) -> str:
    """`` | llm loss 1.2345 | dna loss 0.9 (prediction 0.8, ratio 0.1)``: each module's loss when more than
    one module has one, and every module's named parts."""
    losses = [key.removesuffix(".loss") for key in metrics if key.endswith(".loss")]
    shown = ""
    for module in losses:
        parts = [f"{key.split('.', 1)[1]} {value:.4f}" for key, value in metrics.items()
                 if key.startswith(f"{module}.") and key != f"{module}.loss"]
        if len(losses) > 1 or parts:
            shown += f" | {module} loss {metrics[f'{module}.loss']:.4f}" + (f" ({', '.join(parts)})" if parts else "")
    return shown
