"""DiLoCo: replicas train alone for H inner steps, then average their pseudo-gradients in one outer step.

Every replica keeps the global weights of the last sync (the anchor). After every ``H / fragments`` inner
optimizer steps one fragment of the parameters (streaming DiLoCo; one fragment is plain DiLoCo) syncs:

    delta_i = anchor - theta_i             (this replica's pseudo-gradient)
    delta   = sum_i C(delta_i) / n         (compressed, with error feedback when on)
    anchor  <- Nesterov SGD step on anchor with gradient delta (outer_lr, outer_momentum)
    theta_i <- anchor

Error feedback and outer momentum: the residual of round t is added to the pseudo-gradient of round t+1
*before* compression, so the outer Nesterov step only ever sees what the replicas exchanged and its
momentum buffer stays identical on every replica (no replica-local correction enters the momentum).
``error_decay`` < 1 scales the residual by that factor each round before the delta joins it: SparseLoCo's
decayed error feedback, which with ``outer_momentum`` 0 takes the outer momentum's place.
``auto`` keeps error feedback for sparsified pseudo-gradients (topk, randomk drop most of each delta) and
leaves it off for int8/int4: on the text task of ``bench compression`` (H=32, 3 seeds) int4 with and
without it ended at 2.3002 and 2.2996 ± 0.027 against 2.3118 uncompressed, so the residual buffer (one
more copy of the weights) buys nothing measurable there.

Overlap (``overlap_steps`` = tau > 0): a round's delta is taken tau inner steps before the round ends and
its exchange runs in the background (``background``) while those steps train; at the round's end the
anchor takes the outer step and each replica merges: ``keep`` sets theta_i <- anchor + (theta_i -
theta_i at the send), so every inner step's progress enters exactly one pseudo-gradient; ``mix`` sets
theta_i <- lerp(anchor, theta_i, overlap_alpha), torchft's Streaming DiLoCo merge. The anchors stay bitwise
equal on every replica either way.

The outer sync runs over a ``Collective``: the module's dp group, or torchft's fault-tolerant replica
groups, where a round that fails to commit is dropped and the replica returns to its anchor.
"""

from __future__ import annotations

import math
import copy
from typing import Iterable

import torch
from torch import nn

from hetero.parallel.compression.background import BackgroundRound
from hetero.parallel.compression.codecs import Codec
from hetero.parallel.compression.collective import Collective
from hetero.parallel.compression.config import DiLoCoConfig
from hetero.parallel.data import local_data, split_like


class DiLoCo:
    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        comm: Collective,
        config: DiLoCoConfig,
        codec: Codec | None,
        feedback: str,
    ):
        if not config.enabled:
            raise ValueError("DiLoCo needs inner_steps > 0")
        self.params = dict(named_params)
        self.comm, self.config, self.codec, self.feedback = comm, config, codec, feedback
        self.period = config.inner_steps // config.fragments
        self.fragments = _split_evenly(list(self.params), [local_data(p).numel() for p in self.params.values()],
                                       config.fragments)
        self.anchor = {n: nn.Parameter(local_data(p).detach().clone()) for n, p in self.params.items()}
        self.outer = torch.optim.SGD(
            list(self.anchor.values()), lr=config.outer_lr, momentum=config.outer_momentum,
            nesterov=config.outer_momentum > 0,
        )
        self.residual: dict[str, torch.Tensor] = {}
        self.codec_state: dict[int, dict] = {}
        self.inner_step = 0
        self.rounds = 0
        self.overlap = config.overlap_steps
        self.background = BackgroundRound(next(iter(self.anchor.values())).device)
        if self.overlap:
            comm.gate = self.background.gate  # the round's collectives issue where the training thread lets them
        self.sent: dict[str, torch.Tensor] = {}  # the weights a round in flight started from

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    def after_inner_step(self) -> int | None:
        """Count one inner optimizer step; land the fragment whose round ends here, returning its index
        (else None). With ``overlap_steps`` a round's exchange starts that many steps before it ends."""
        self.inner_step += 1
        position = self.inner_step % self.period
        fragment = ((self.inner_step + self.overlap) // self.period - 1) % len(self.fragments)
        self.background.advance()
        if self.overlap and position == self.period - self.overlap:
            self._send(fragment)
        if position:
            return None
        self._land(fragment)
        return fragment

    def _delta(self, names: list[str]) -> torch.Tensor:
        return torch.cat([(self.anchor[n] - local_data(self.params[n])).reshape(-1) for n in names])

    @torch.no_grad()
    def _send(self, fragment: int) -> None:
        """Start the round of ``fragment`` in the background, from the weights as they are now."""
        names = self.fragments[fragment]
        self.sent = {n: local_data(self.params[n]).clone() for n in names}
        self.background.start(self._exchange, fragment, self._delta(names))

    @torch.no_grad()
    def _land(self, fragment: int) -> None:
        names = self.fragments[fragment]
        total = self.background.finish() if self.overlap else self._exchange(fragment, self._delta(names))
        if total is None:  # a dropped round: back to the last agreed weights
            for n in names:
                local_data(self.params[n]).copy_(self.anchor[n])
            return
        for anchor in self.anchor.values():
            anchor.grad = None
        for n, mean in zip(names, split_like(total / self.comm.size, [self.anchor[n] for n in names])):
            self.anchor[n].grad = mean.clone()
        self.outer.step()
        for n in names:
            local = local_data(self.params[n])
            if not self.overlap:
                local.copy_(self.anchor[n])
            elif self.config.overlap_merge == "keep":  # the new global weights + this replica's progress since the send
                local.sub_(self.sent[n]).add_(self.anchor[n])
            else:
                local.copy_(torch.lerp(self.anchor[n], local, self.config.overlap_alpha))
        self.sent = {}
        self.rounds += 1

    def _exchange(self, fragment: int, delta: torch.Tensor) -> torch.Tensor | None:
        """One round's collectives: the sum over replicas of the (compressed) ``delta``, or None if the
        round failed to commit (error feedback and codec state then stay as they were)."""
        names = self.fragments[fragment]
        self.comm.start_round()
        state = self.codec_state.setdefault(fragment, {})
        saved_state = copy.deepcopy(state)
        saved_residual = {n: self.residual[n].clone() for n in names if n in self.residual}
        if self.codec is None:
            self.comm.all_reduce(delta)
            total = delta
        elif self.feedback == "ef":
            residual = torch.cat([self.residual.get(n, torch.zeros_like(self.anchor[n])).reshape(-1) for n in names])
            if self.config.error_decay != 1:
                residual.mul_(self.config.error_decay)
            total = self.codec.exchange_with_feedback(delta, residual, self.comm, state)
            for n, r in zip(names, split_like(residual, [self.anchor[n] for n in names])):
                self.residual[n] = r.clone()
        else:
            total, _ = self.codec.exchange(delta, self.comm, state)
        if self.comm.commit_round():
            return total
        self.codec_state[fragment] = saved_state
        for n in names:
            if n in saved_residual:
                self.residual[n] = saved_residual[n]
            else:
                self.residual.pop(n, None)
        return None

    def close(self) -> None:
        self.background.close()

    def residual_norm(self) -> float:
        if self.background.in_flight:
            self.background.peek()  # the round's thread writes the residuals until it ends
        return math.sqrt(sum(float(r.double().pow(2).sum()) for r in self.residual.values()))

    def state_dict(self) -> dict:
        """A round in flight is waited for: its result is saved, and lands after a resume as it would have."""
        in_flight = None
        if self.background.in_flight:
            in_flight = {"total": self.background.peek(), "sent": {n: t.clone() for n, t in self.sent.items()}}
        return {
            "in_flight": in_flight,
            "anchor": {n: a.detach().clone() for n, a in self.anchor.items()},
            "outer": self.outer.state_dict(),
            "residual": {n: r.clone() for n, r in self.residual.items()},
            "codec_state": {i: dict(s) for i, s in self.codec_state.items()},
            "inner_step": self.inner_step,
            "rounds": self.rounds,
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for n, a in state["anchor"].items():
                self.anchor[n].copy_(a)
        self.outer.load_state_dict(state["outer"])
        self.residual = {n: r.clone() for n, r in state["residual"].items()}
        self.codec_state = {int(i): dict(s) for i, s in state["codec_state"].items()}
        self.inner_step = int(state["inner_step"])
        self.rounds = int(state["rounds"])
        flight = state["in_flight"]
        if flight is not None:
            self.sent = {n: t.clone() for n, t in flight["sent"].items()}
            self.background.restore(flight["total"])


def _split_evenly(names: list[str], sizes: list[int], parts: int) -> list[list[str]]:
    """Consecutive runs of ``names`` with about equal total size, one per part (each non-empty)."""
    if parts > len(names):
        raise ValueError(f"cannot split {len(names)} parameters into {parts} DiLoCo fragments")
    total = sum(sizes)
    fragments: list[list[str]] = [[] for _ in range(parts)]
    running = 0
    for i, (name, size) in enumerate(zip(names, sizes)):
        part = min(parts - 1, running * parts // total)
        part = max(part, parts - (len(names) - i))  # as many names left as parts still to fill
        fragments[part].append(name)
        running += size
    return fragments if all(fragments) else _split_by_count(names, parts)


def _split_by_count(names: list[str], parts: int) -> list[list[str]]:
    step = len(names) / parts
    return [names[round(i * step) : round((i + 1) * step)] for i in range(parts)]
