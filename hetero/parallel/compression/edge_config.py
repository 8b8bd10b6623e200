"""The compression of one edge's traffic: activations forward, their gradients backward.

An edge is a link between two pipeline stages of one module (``<module>.compression.pipeline``) or a
boundary between two modules (``edges: [{src, dst, compression}]``)::

    llm:
      compression:
        pipeline: {forward: {method: int2}, backward: {method: int4}}
    edges:
      - {src: vision, dst: llm, compression: {forward: {method: int8}, backward: {method: bf16}}}
    train: {sample_reuse: 4}    # lazy sampling, which the default compensation needs

Codecs work along the last (hidden) dim, which no layout shards, so a payload crosses a boundary between
different layouts like the activation itself. ``compensation`` picks the error compensation (see
``hetero.parallel.compression.edge``): ``lazy`` (Clapping-style, memory bounded by one step's rows),
``per_sample`` (AQ-SGD-style, one cached activation per training sample) or ``none``; ``refresh``
optionally gives the lazy compensation's first send of each fresh batch a codec of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CODECS = ("none", "identity", "bf16", "fp16", "int8", "int4", "int2", "topk")
COMPENSATIONS = ("lazy", "per_sample", "none")


@dataclass
class ActivationCodecConfig:
    method: str = "none"  # none (no compression) | identity | bf16 | fp16 | int8 | int4 | int2 | topk
    block_size: int = 64  # int8/int4/int2: consecutive hidden entries sharing one scale
    ratio: float = 0.1  # topk: fraction of each row's hidden entries sent

    def errors(self, where: str) -> list[str]:
        found = []
        if self.method not in CODECS:
            found.append(f"{where}.method={self.method!r} is not one of {', '.join(CODECS)}")
        if self.block_size < 1:
            found.append(f"{where}.block_size={self.block_size} must be at least 1")
        if not 0 < self.ratio <= 1:
            found.append(f"{where}.ratio={self.ratio} must be in (0, 1]")
        return found

    def size_errors(self, where: str, hidden: int) -> list[str]:
        """Problems with this codec on rows of ``hidden`` entries."""
        if self.method in ("int8", "int4", "int2"):
            found = []
            if hidden % self.block_size:
                found.append(f"{where}.block_size={self.block_size} does not divide the edge's hidden size {hidden}")
            per_byte = 8 // int(self.method[3:])
            if hidden % per_byte:
                found.append(
                    f"{where}.method={self.method} packs {per_byte} codes a byte, which needs a hidden size that "
                    f"is a multiple of {per_byte}; the edge's is {hidden}"
                )
            return found
        if self.method == "topk" and hidden > 2**15:
            return [f"{where}: topk indexes rows of at most 32768 entries; the edge's hidden size is {hidden}"]
        return []


@dataclass
class EdgeCompressionConfig:
    forward: ActivationCodecConfig = field(default_factory=ActivationCodecConfig)
    backward: ActivationCodecConfig = field(default_factory=ActivationCodecConfig)
    compensation: str = "lazy"  # lazy (Clapping) | per_sample (AQ-SGD) | none
    # lazy only: the forward codec of a fresh batch's first step, whose reference is still empty (a direct
    # send); none: the forward codec. More bits there leave the 2-bit deltas of the reuses less to correct.
    refresh: ActivationCodecConfig = field(default_factory=ActivationCodecConfig)

    @property
    def enabled(self) -> bool:
        return self.forward.method != "none" or self.backward.method != "none"

    def errors(self, where: str, sample_reuse: int | None = None, hidden: int | None = None) -> list[str]:
        """Problems with this block; ``sample_reuse`` and ``hidden`` are checked when given."""
        found = self.forward.errors(f"{where}.forward") + self.backward.errors(f"{where}.backward")
        found += self.refresh.errors(f"{where}.refresh")
        if self.refresh.method != "none" and self.compensation != "lazy":
            found.append(
                f"{where}.refresh={self.refresh.method} applies to compensation=lazy only (got "
                f"{self.compensation}); set {where}.refresh.method=none"
            )
        if self.compensation not in COMPENSATIONS:
            found.append(f"{where}.compensation={self.compensation!r} is not one of {', '.join(COMPENSATIONS)}")
        lossy = {self.forward.method, self.backward.method} - {"none", "identity"}
        if self.compensation == "lazy" and lossy and sample_reuse is not None and sample_reuse < 2:
            found.append(
                f"{where}.compensation=lazy corrects errors over the steps that reuse a batch, but "
                f"train.sample_reuse={sample_reuse}; set train.sample_reuse>=2 (e.g. 4) or "
                f"{where}.compensation=none"
            )
        if hidden is not None:
            found += self.forward.size_errors(f"{where}.forward", hidden)
            found += self.backward.size_errors(f"{where}.backward", hidden)
            found += self.refresh.size_errors(f"{where}.refresh", hidden)
        return found
