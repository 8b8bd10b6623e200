"""How a parallel run is compared with the same model in one process.

Every rank of the parallel run returns a ``Record``: the losses of every step (each step a list of
values, e.g. the combined loss then each module's), the world-wide gradient norm of every step *before*
clipping, and the whole gradient of every parameter it holds after the first step, under the reference
model's name. The reference returns the same from one process. ``check_parity`` then requires:

- every rank to report the same losses and norms (they are world-wide values);
- every rank's losses to be within ``tolerance`` (relative) of the reference's at every step, and its
  gradient norm at the first step (same weights, same data); later steps' norms within
  ``LATER_NORM_TOLERANCE``: the weights of two fp32 runs drift apart over AdamW steps (AdamW turns float
  noise in near-zero gradients into lr-sized differences), and norms feel it first. Measured: the VLM's
  20 steps, 2e-8 at step 1 and up to 2.3e-5 by step 17; the GPT under tp2, 3e-8 at step 1 and 1.6e-4 at
  step 6, while every loss stays within 1e-5;
- every copy of a gradient (DP and TP replicas, FSDP shards gathered) to equal every other copy
  exactly, and to be within ``tolerance`` (relative, in norm) of the reference's;
- together, the ranks to hold every gradient of the reference and nothing else.

Comparing norms before the clip catches an error that scales every gradient alike, which the clip
would hide from the gradients themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hetero.config import OptimizerConfig

LATER_NORM_TOLERANCE = 1e-3


@dataclass
class Record:
    losses: list[list[float]] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    # per edge, the bytes this rank sent in the first step: forward to the other module's ranks, forward
    # within its own replica group (completing what crossed), backward to the other module's ranks
    edge_bytes: dict[str, tuple[int, int, int]] = field(default_factory=dict)


def relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-30)


def check_parity(ranks: list[Record], reference: Record, what: str, tolerance: float = 1e-5,
                 grad_tolerance: float | None = None, later_norm_tolerance: float = LATER_NORM_TOLERANCE) -> str:
    """Raise ``AssertionError`` naming the first disagreement; return a one-line summary of the errors.
    ``grad_tolerance``: the gradients' (``tolerance`` unless given)."""
    grad_tolerance = tolerance if grad_tolerance is None else grad_tolerance
    first = ranks[0]
    for rank, record in enumerate(ranks):
        assert record.losses == first.losses, f"{what}: rank {rank} reports other losses than rank 0"
        assert record.grad_norms == first.grad_norms, f"{what}: rank {rank} reports other grad norms than rank 0"
    assert len(first.losses) == len(reference.losses), f"{what}: {len(first.losses)} steps vs {len(reference.losses)}"
    loss_error = 0.0
    for step, (got, want) in enumerate(zip(first.losses, reference.losses)):
        assert len(got) == len(want), f"{what}: step {step + 1} has {len(got)} losses, the reference {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            loss_error = max(loss_error, relative(a, b))
            assert relative(a, b) <= tolerance, f"{what}: step {step + 1} loss {i}: {a} vs reference {b}"
    norm_errors = [relative(a, b) for a, b in zip(first.grad_norms, reference.grad_norms)]
    assert len(norm_errors) == len(reference.grad_norms), f"{what}: a grad norm per step"
    for step, error in enumerate(norm_errors):
        bound = tolerance if step == 0 else later_norm_tolerance
        assert error <= bound, (f"{what}: step {step + 1} grad norm before clipping {first.grad_norms[step]} vs "
                                f"{reference.grad_norms[step]}")
    held: dict[str, tuple[int, torch.Tensor]] = {}
    for rank, record in enumerate(ranks):
        for name, grad in record.grads.items():
            if name in held:
                other, copy = held[name]
                assert torch.equal(grad, copy), f"{what}: gradient {name} differs between ranks {other} and {rank}"
            else:
                held[name] = (rank, grad)
    missing, extra = sorted(set(reference.grads) - set(held)), sorted(set(held) - set(reference.grads))
    assert not missing and not extra, f"{what}: gradients missing {missing}, unexpected {extra}"
    grad_error, worst = 0.0, ""
    for name, want in reference.grads.items():
        error = ((held[name][1] - want).norm() / want.norm().clamp(min=1e-30)).item()
        if error > grad_error:
            grad_error, worst = error, name
        assert error <= grad_tolerance, f"{what}: gradient {name} relative error {error:.1e}"
    return (f"{what}: worst loss rel error {loss_error:.1e}, grad norm {norm_errors[0]:.1e} at step 1 and "
            f"{max(norm_errors[1:], default=0):.1e} later, gradient {grad_error:.1e} ({worst})")


# bf16 keeps 8 significant bits (a rounding step of 2^-8 = 3.9e-3): where a parallel run rounds at other
# points than one process (TP's partial sums, CP's merged blocks, microbatch slices) the worst gradient
# elements move by a few steps. Measured worst over every kind and layout tested: losses (every step)
# 1.3e-4, step-1 norm 8.5e-4, gradients 1.2e-2; the bounds are a few times those. Later norms are not
# compared: AdamW turns those gradient differences into lr-sized weight differences, and GPT tp2's norm
# at step 3 (lr 1e-2) was 7% off while its losses stayed within 1.2e-4.
BF16_TOLERANCE, BF16_GRAD_TOLERANCE = 2e-3, 5e-2
# What bf16 moves a module's step-1 gradients by against fp32 at the least (measured: 9.5e-3 to 7.4e-2 for
# the worst parameter of each module); a module whose ``precision`` were ignored would sit at fp32 parity.
BF16_SHIFT = 2e-3


def check_bf16_parity(ranks: list[Record], bf16: Record, fp32: Record, what: str) -> str:
    """A bf16 run against the one-process reference under the same autocast (``check_parity`` at the bf16
    bounds), and proof that bf16 ran: every module's worst step-1 gradient sits at least ``BF16_SHIFT``
    from the fp32 reference's."""
    summary = check_parity(ranks, bf16, what, BF16_TOLERANCE, BF16_GRAD_TOLERANCE, later_norm_tolerance=math.inf)
    held = {name: grad for record in ranks for name, grad in record.grads.items()}
    shifts: dict[str, float] = {}
    for name, want in fp32.grads.items():
        module = name.split(".", 1)[0]
        error = ((held[name] - want).norm() / want.norm().clamp(min=1e-30)).item()
        shifts[module] = max(shifts.get(module, 0.0), error)
    for module, shift in shifts.items():
        assert shift >= BF16_SHIFT, (f"{what}: {module}'s gradients are within {shift:.1e} of fp32's: its bf16 "
                                     f"precision did not take effect")
    return summary + "; worst gradient shift from fp32 " + ", ".join(f"{m} {s:.1e}" for m, s in shifts.items())


def record_run(runtime, batches: Iterable[dict], keys: Sequence[str] = ("loss",)) -> Record:
    """Train ``runtime`` (a ``hetero.runtime.Runtime``) on ``batches``: each step's metrics named by
    ``keys``, its gradient norm before clipping, and every gradient this rank holds after the first step
    (``module_grads``: collective over each module's ranks)."""
    from hetero.testing.experiments import module_grads

    record = Record()
    for step, batch in enumerate(batches):
        metrics = runtime.train_step(batch)
        record.losses.append([metrics[key] for key in keys])
        record.grad_norms.append(metrics["grad_norm"])
        if step == 0:
            record.grads = module_grads(runtime)
            record.edge_bytes = {name: tuple(edge.counters().get(key, 0) for key in (
                "forward.cross_sent_bytes", "forward.intra_sent_bytes", "backward.cross_sent_bytes"))
                for name, edge in runtime.edges.items()}
    return record


def record_reference(
    modules: Mapping[str, nn.Module],
    optim: Mapping[str, OptimizerConfig],
    batches: Iterable[dict],
    losses: Callable[[dict, int], list[torch.Tensor]],
    clip: float = 0.0,
    before_step: Callable[[int], None] | None = None,
    precision: str = "fp32",
) -> Record:
    """The same as ``record_run`` for ``modules`` in one process: per module AdamW (``optim``, its
    learning rate per step), ``losses(batch, step)`` (the first is backpropagated, all are recorded), one
    gradient-norm clip over every module (``clip`` > 0), gradients named ``<module>.<parameter>``.
    ``precision="bf16"``: the losses computed under bf16 autocast (fp32 weights and gradients), as the
    runtime computes a module's stage."""
    params = [p for m in modules.values() for p in m.parameters()]
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=optim[name].lr, betas=(optim[name].beta1, optim[name].beta2),
                                          weight_decay=optim[name].weight_decay, eps=optim[name].eps)
                  for name, m in modules.items()}
    record = Record()
    for step, batch in enumerate(batches):
        if before_step is not None:
            before_step(step)
        for opt in optimizers.values():
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            values = losses(batch, step)
        values[0].backward()
        norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip > 0 else torch.nn.utils.get_total_norm(
            [p.grad for p in params if p.grad is not None])
        record.grad_norms.append(float(norm))
        if step == 0:
            record.grads = {f"{name}.{n}": p.grad.clone() for name, m in modules.items() for n, p in m.named_parameters()}
        for name, opt in optimizers.items():
            for group in opt.param_groups:
                group["lr"] = optim[name].lr_at(step)
            opt.step()
        record.losses.append([float(v.detach()) for v in values])
    return record
