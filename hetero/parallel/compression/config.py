"""The ``compression:`` block of a module: how its gradients, or its DiLoCo pseudo-gradients, travel.

    vision:
      compression:
        grad: {method: int8}                         # every step, error feedback on by default
    llm:
      compression:
        diloco: {inner_steps: 32, pseudo_grad: {method: int4}}
        pipeline: {forward: {method: int2}, backward: {method: int4}}   # between its PP stages

``pipeline`` is described and checked in ``edge_config`` (its checks need the hidden size and
``train.sample_reuse``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero.parallel.compression.edge_config import EdgeCompressionConfig

METHODS = ("none", "topk", "shared_topk", "randomk", "int8", "int4", "powersgd")
FEEDBACK = ("auto", "ef", "ef21", "none")
OVERLAP_MERGES = ("keep", "mix")
SHARED_INDICES = ("turn", "union")


@dataclass
class CompressorConfig:
    method: str = "none"  # none (fp32 all-reduce) | topk | shared_topk | randomk | int8 | int4 | powersgd
    ratio: float = 0.01  # topk, shared_topk, randomk: fraction of entries sent
    segment: int = 1024  # topk, shared_topk: entries per selection segment (indices take log2(segment) bits)
    block_size: int = 64  # int8, int4 (and shared_topk's quantized values): entries sharing one scale
    # topk, shared_topk: values as fp32 (32), or int8 / int4 / 2-bit fitted codes (shared_topk sums them in
    # two phases; topk all-gathers them)
    value_bits: int = 32
    # shared_topk: whose top-k the replicas share: one replica's "turn" each call (indices flat in the
    # replicas), or the "union" of every replica's own (indices all-gathered)
    indices: str = "turn"
    rank: int = 4  # powersgd: rank of the approximation
    error_feedback: str = "auto"  # auto (ef for the biased methods) | ef | ef21 | none

    @property
    def feedback(self) -> str:
        if self.error_feedback != "auto":
            return self.error_feedback
        return "none" if self.method == "none" else "ef"

    def errors(self, where: str) -> list[str]:
        found = []
        if self.method not in METHODS:
            found.append(f"{where}.method={self.method!r} is not one of {', '.join(METHODS)}")
        if self.error_feedback not in FEEDBACK:
            found.append(f"{where}.error_feedback={self.error_feedback!r} is not one of {', '.join(FEEDBACK)}")
        if not 0 < self.ratio <= 1:
            found.append(f"{where}.ratio={self.ratio} must be in (0, 1]")
        if not 0 < self.segment <= 2**16:
            found.append(f"{where}.segment={self.segment} must be in 1..65536 (indices are uint16)")
        if self.block_size <= 0 or self.block_size % 2:
            found.append(f"{where}.block_size={self.block_size} must be a positive even number")
        elif self.value_bits == 2 and self.block_size % 4:
            found.append(f"{where}.block_size={self.block_size}: 2-bit values pack four a byte; use a multiple of 4")
        if self.rank < 1:
            found.append(f"{where}.rank={self.rank} must be at least 1")
        if self.indices not in SHARED_INDICES:
            found.append(f"{where}.indices={self.indices!r} is not one of {', '.join(SHARED_INDICES)}")
        elif self.indices != "turn" and self.method != "shared_topk":
            found.append(f"{where}.indices={self.indices} chooses shared_topk's entries; set {where}.method=shared_topk "
                         f"or indices=turn")
        if self.value_bits not in (32, 8, 4, 2):
            found.append(f"{where}.value_bits={self.value_bits} is not one of 32, 8, 4, 2")
        elif self.value_bits != 32 and self.method not in ("topk", "shared_topk"):
            found.append(f"{where}.value_bits={self.value_bits} quantizes the values of topk and shared_topk; set "
                         f"{where}.method=topk or shared_topk, or value_bits=32")
        if self.method == "none" and self.error_feedback in ("ef", "ef21"):
            found.append(f"{where}.error_feedback={self.error_feedback} needs a compressing method; set {where}.method")
        if self.method == "powersgd" and self.error_feedback == "ef21":
            found.append(f"{where}: powersgd supports error_feedback ef or none, not ef21")
        return found


@dataclass
class DiLoCoConfig:
    # H: local optimizer steps between outer syncs (0: DiLoCo off). The inner learning rate is the module's
    # optim.lr; the EF/DiLoCo analysis scales it as 1/(H sqrt(T)) for T outer rounds. H=1 with outer_lr=1
    # and outer_momentum=0 compresses every step's optimizer update instead of its gradient.
    inner_steps: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    fragments: int = 1  # streaming DiLoCo: sync one fragment of the layers every inner_steps/fragments steps
    pseudo_grad: CompressorConfig = field(default_factory=CompressorConfig)
    # with error feedback: the residual carried into each round times this (SparseLoCo's decayed error
    # feedback, used with outer_momentum 0 in place of the outer momentum); 1 keeps all of it
    error_decay: float = 1.0
    # Overlap: a round's exchange starts this many inner steps before the round ends and runs in the
    # background meanwhile (0: it blocks at the round's end). Where it lands the replica takes the new
    # global weights and, by overlap_merge, "keep"s its own progress of those steps on top, or "mix"es as
    # torchft's Streaming DiLoCo: lerp(global, local, overlap_alpha) (alpha 0 drops that progress).
    overlap_steps: int = 0
    overlap_merge: str = "keep"
    overlap_alpha: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.inner_steps > 0

    @property
    def feedback(self) -> str:
        """The pseudo-gradients' error feedback: ``auto`` keeps it for sparsified ones only (see ``diloco``)."""
        if self.pseudo_grad.error_feedback != "auto":
            return self.pseudo_grad.error_feedback
        return "ef" if self.pseudo_grad.method in ("topk", "shared_topk", "randomk") else "none"

    def errors(self, where: str) -> list[str]:
        found = self.pseudo_grad.errors(f"{where}.pseudo_grad")
        if self.inner_steps < 0:
            found.append(f"{where}.inner_steps={self.inner_steps} must be 0 (off) or positive")
        if self.fragments < 1 or (self.enabled and self.inner_steps % self.fragments):
            found.append(
                f"{where}.fragments={self.fragments} must be at least 1 and divide inner_steps={self.inner_steps}"
            )
        if self.pseudo_grad.method == "powersgd":
            found.append(f"{where}.pseudo_grad.method=powersgd is not supported; use topk, shared_topk, randomk, int8 or int4")
        if self.pseudo_grad.error_feedback == "ef21":
            found.append(f"{where}.pseudo_grad.error_feedback=ef21 is not supported; use ef or none")
        if not 0 < self.error_decay <= 1:
            found.append(f"{where}.error_decay={self.error_decay} must be in (0, 1]")
        elif self.error_decay < 1 and (self.pseudo_grad.method == "none" or self.feedback != "ef"):
            found.append(f"{where}.error_decay={self.error_decay} decays the error-feedback residual, which "
                         f"{where}.pseudo_grad (method={self.pseudo_grad.method}) does not keep; set "
                         f"{where}.pseudo_grad.error_feedback=ef with a compressing method, or error_decay=1")
        found += self._overlap_errors(where)
        return found

    def _overlap_errors(self, where: str) -> list[str]:
        found = []
        period = self.inner_steps // max(self.fragments, 1)
        if self.overlap_steps < 0 or (self.enabled and self.overlap_steps >= period):
            found.append(f"{where}.overlap_steps={self.overlap_steps} must be in 0..{max(period - 1, 0)} (a round "
                         f"lands before the next starts: inner_steps/fragments={period})")
        if self.overlap_merge not in OVERLAP_MERGES:
            found.append(f"{where}.overlap_merge={self.overlap_merge!r} is not one of {', '.join(OVERLAP_MERGES)}")
        if not 0 <= self.overlap_alpha <= 1:
            found.append(f"{where}.overlap_alpha={self.overlap_alpha} must be in [0, 1]")
        elif self.overlap_alpha and self.overlap_merge != "mix":
            found.append(f"{where}.overlap_alpha={self.overlap_alpha} weighs the local weights of overlap_merge=mix; "
                         f"set {where}.overlap_merge=mix or overlap_alpha=0")
        return found


@dataclass
class CompressionConfig:
    grad: CompressorConfig = field(default_factory=CompressorConfig)  # per-step gradient sync
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)  # replaces the per-step sync when on
    # activations and their gradients between this module's pipeline stages
    pipeline: EdgeCompressionConfig = field(default_factory=EdgeCompressionConfig)

    @property
    def compresses(self) -> bool:
        """Whether the gradient sync or the optimizer step is compressed (pipeline traffic aside)."""
        return self.grad.method != "none" or self.diloco.enabled

    def errors(self, module: str, cp: int = 1, fsdp: bool = False) -> list[str]:
        """Problems with this block for a module of context-parallel degree ``cp`` (and FSDP on or off)."""
        found = self.grad.errors(f"{module}.compression.grad") + self.diloco.errors(f"{module}.compression.diloco")
        if fsdp and self.compresses:
            found.append(
                f"{module}.parallel.fsdp=true reduce-scatters gradients itself; compression needs the DP "
                f"gradient sync: set {module}.parallel.fsdp=false or turn {module}.compression off"
            )
        if self.diloco.enabled and cp > 1:
            found.append(
                f"{module}.compression.diloco needs cp=1 (context-parallel ranks must sum gradients every "
                f"step); got {module}.layout.cp={cp}"
            )
        if self.diloco.enabled and self.grad.method != "none":
            found.append(
                f"{module}.compression: diloco replaces the per-step gradient sync; set grad.method=none "
                f"(got {self.grad.method}) or diloco.inner_steps=0"
            )
        return found
