"""The step a planner prices: one LLM, the encoders that feed it and the consumers its hidden states
condition, read off an experiment (``workload_of``), with the wire bytes its compression settings send."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hetero.config import ExperimentConfig
from hetero.errors import ConfigError
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig
from hetero.parallel.compression.edge_config import ActivationCodecConfig, EdgeCompressionConfig
from hetero.kinds.flops import TRAINING_MULTIPLIER
from hetero.models import default_registry
from hetero.plan.cost import Transformer, describe, training_passes


@dataclass
class Workload:
    """One step's work: the LLM's sequences and, per other module, samples per LLM sequence. Encoders feed
    the LLM; consumers (a video generator) take its hidden states."""

    llm: Transformer
    encoders: dict[str, Transformer]
    sequences: int
    per_sequence: dict[str, float]  # samples (images, DNA windows, clips) per LLM sequence
    grad_ratio: dict[str, float] = field(default_factory=dict)
    # Wire bytes per activation element, forward + backward together, of compressed edges: each encoder's
    # or consumer's boundary with the LLM, and the LLM's stage edges (None: uncompressed).
    boundary_element_bytes: dict[str, float] = field(default_factory=dict)
    stage_element_bytes: float | None = None
    llm_micro: tuple[int, ...] = (1, 2, 4, 8)
    consumers: dict[str, Transformer] = field(default_factory=dict)

    @property
    def others(self) -> dict[str, Transformer]:
        return self.encoders | self.consumers

    def samples(self, name: str) -> int:
        return self.sequences if name == self.llm.name else max(1, round(self.sequences * self.per_sequence[name]))

    @property
    def model_flops(self) -> float:
        flops = self.sequences * self.llm.model_flops_per_sample
        return flops + sum(self.samples(n) * e.model_flops_per_sample for n, e in self.others.items())

    def boundary_bytes(self, activation_bytes: int, names: list[str] | None = None) -> float:
        """What crosses between the LLM and the modules ``names`` (default: every encoder) per step, forward
        and (as gradients) backward: an encoder's output tokens, the LLM's hidden states to a consumer."""
        total = 0.0
        for name in self.encoders if names is None else names:
            module = self.others[name]
            elements = (module.out_tokens * module.out_width if name in self.encoders
                        else self.llm.seq * self.llm.hidden)
            total += self.samples(name) * elements * self.boundary_element_bytes.get(name, 2 * activation_bytes)
        return total


def gradient_wire_ratio(compression: CompressionConfig) -> float:
    """Bytes on the wire per fp32 gradient byte under a module's ``compression`` block."""

    def ratio(c: CompressorConfig) -> float:
        if c.method in ("int8", "int4"):
            return ((1.0 if c.method == "int8" else 0.5) + 4 / c.block_size) / 4
        if c.method in ("topk", "shared_topk"):  # a value (and its share of the scales) + a packed index
            scales = 0 if c.value_bits == 32 else 16 * (2 if c.value_bits == 2 else 1) / c.block_size
            return c.ratio * (c.value_bits + scales + max(1, (c.segment - 1).bit_length())) / 32
        if c.method == "randomk":
            return c.ratio  # indices come from a shared seed
        return 1.0  # none, and powersgd (its size depends on every matrix's shape; counted as dense)

    if compression.diloco.inner_steps:
        return ratio(compression.diloco.pseudo_grad) / compression.diloco.inner_steps
    return ratio(compression.grad)


def activation_wire_bytes(codec: ActivationCodecConfig, activation_bytes: int) -> float:
    """Wire bytes per activation element under an edge codec (scales are bf16, top-k indices uint16)."""
    if codec.method in ("int8", "int4", "int2"):
        return int(codec.method[3:]) / 8 + 2 / codec.block_size
    if codec.method in ("bf16", "fp16"):
        return 2.0
    if codec.method == "topk":
        return codec.ratio * (activation_bytes + 2)
    return float(activation_bytes)  # none, identity


def edge_wire_bytes(edge: EdgeCompressionConfig, activation_bytes: int) -> float | None:
    """Forward + backward wire bytes per element of a compressed edge (None when it is not compressed)."""
    if not edge.enabled:
        return None
    return activation_wire_bytes(edge.forward, activation_bytes) + activation_wire_bytes(edge.backward, activation_bytes)


EXTRA_CONTEXT = ("images", "mixed")
ENCODER_KINDS = ("vit", "projector", "genezip")  # what feeds the LLM
CONSUMER_KINDS = ("video",)  # what its hidden states condition


def workload_of(
    experiment: ExperimentConfig, context: int | None = None, tokens_per_step: int | None = None,
    extra_context: str = "images", activation_bytes: int = 2, clip_frames: int = 32,
) -> Workload:
    """The step ``experiment`` trains, optionally at another LLM context length.

    At the configured context every sequence carries one sample (an image, a DNA window) per encoder and
    one clip per consumer of ``clip_frames`` frames. A longer context holds more encoder samples: with
    ``extra_context="images"`` the text keeps its configured length and encoder tokens fill the rest (long
    videos, many-image documents); with ``"mixed"`` text and encoder tokens keep their configured shares.
    The batch keeps ``tokens_per_step`` tokens (default: the configured global batch's). Compressed edges
    are priced per element against ``activation_bytes`` (the cluster device's)."""
    if extra_context not in EXTRA_CONTEXT:
        raise ConfigError(f"extra_context={extra_context!r} is not one of {', '.join(EXTRA_CONTEXT)}")
    kinds = {name: module.kind for name, module in experiment.modules.items()}
    llms = [n for n, k in kinds.items() if k == "gpt"]
    unsupported = {n: k for n, k in kinds.items() if k not in ("gpt", *ENCODER_KINDS, *CONSUMER_KINDS)}
    if len(llms) != 1 or unsupported:
        raise ConfigError(
            "hetero plan models one gpt module, the vit, projector and genezip modules that feed it and the video "
            "modules it conditions; this experiment has " + ", ".join(f"{n}: {k}" for n, k in kinds.items())
        )
    llm = llms[0]
    upstream, downstream = _reaching(experiment, llm, backward=True), _reaching(experiment, llm, backward=False)
    misplaced = [n for n, k in kinds.items()
                 if n != llm and not (k in ENCODER_KINDS and n in upstream or k in CONSUMER_KINDS and n in downstream)]
    if misplaced:
        raise ConfigError(
            f"hetero plan models encoders whose edges lead into {llm} and video modules fed by it; "
            + ", ".join(f"{n} ({kinds[n]})" for n in misplaced) + " is not placed so in the edges"
        )
    registry = default_registry()  # the planner models the built-in kinds
    llm_config = experiment.model_config(llm, registry)
    context = context or llm_config.seq_len
    tokens = tokens_per_step or experiment.batch.global_batch_size * llm_config.seq_len
    sequences = max(1, tokens // context)
    feeders = sum(e.dst == llm for e in experiment.edges)  # encoder sources sharing the extra context
    encoders, consumers, per_sequence = {}, {}, {}
    for name, kind in kinds.items():
        if kind in ENCODER_KINDS:  # a tower and its projector see the same samples
            encoders[name] = describe(name, kind, experiment.model_config(name, registry))
            if extra_context == "mixed":
                per_sequence[name] = context / llm_config.seq_len
            else:
                extra = (context - llm_config.seq_len) / (feeders * encoders[name].out_tokens)
                per_sequence[name] = 1 + extra
        elif kind in CONSUMER_KINDS:
            consumers[name] = describe(name, kind, experiment.model_config(name, registry), clip_frames=clip_frames)
            per_sequence[name] = 1.0
    ratios = {n: gradient_wire_ratio(m.compression) for n, m in experiment.modules.items()}
    act = activation_bytes
    boundaries = {e.src: b for e in experiment.edges if e.dst == llm and (b := edge_wire_bytes(e.compression, act))}
    boundaries |= {e.dst: b for e in experiment.edges if e.src == llm and (b := edge_wire_bytes(e.compression, act))}
    stages = edge_wire_bytes(experiment.modules[llm].compression.pipeline, act)
    modes, shares = training_modes(experiment), trained_shares(experiment)
    encoders = {name: priced(module, modes[name], shares[name]) for name, module in encoders.items()}
    consumers = {name: priced(module, modes[name], shares[name]) for name, module in consumers.items()}
    return Workload(priced(describe(llm, "gpt", llm_config, context), modes[llm], shares[llm]), encoders,
                    sequences, per_sequence, ratios, boundaries, stages, consumers=consumers)


def training_modes(experiment: ExperimentConfig) -> dict[str, str]:
    """Per module what training runs of it (``Transformer.training``): ``full`` unless ``trainable:
    false``; a frozen module ``inputs`` when a module it reads from (at any distance) trains, else
    ``forward``. (A trained module's ``frozen`` globs are its ``trained_shares``.)"""
    modes: dict[str, str] = {}

    def backward(name: str) -> bool:
        return experiment.modules[name].trainable or any(backward(e.src) for e in experiment.edges if e.dst == name)

    for name, module in experiment.modules.items():
        modes[name] = "full" if module.trainable else "inputs" if backward(name) else "forward"
    return modes


def trained_shares(experiment: ExperimentConfig) -> dict[str, float]:
    """Per module the share of its parameters (by count) that train: 1 without ``frozen`` globs, 0 under
    ``trainable: false``; with globs, read from a build on the meta device (nothing allocated)."""
    import torch

    from hetero.graph.frozen import is_frozen

    registry, shares = default_registry(), {}
    for name, module in experiment.modules.items():
        if not module.trainable or not module.frozen:
            shares[name] = float(module.trainable)
            continue
        with torch.device("meta"):
            params = list(registry[module.kind].build(experiment.model_config(name, registry)).named_parameters())
        total = sum(p.numel() for _, p in params)
        shares[name] = sum(p.numel() for n, p in params if not is_frozen(module, n)) / total
    return shares


def priced(module: Transformer, training: str, share: float = 1.0) -> Transformer:
    """``module`` under ``training`` (``share`` of its parameters training, when it trains), its model
    FLOPs the passes it runs (forward 1, inputs 2, full 2 + the share)."""
    module = dataclasses.replace(module, training=training, trained_share=share)
    flops = module.model_flops_per_sample * training_passes(module) / TRAINING_MULTIPLIER
    return dataclasses.replace(module, model_flops_per_sample=flops)


def _reaching(experiment: ExperimentConfig, target: str, backward: bool) -> set[str]:
    """The modules with a path of edges into ``target`` (``backward``) or reached from it."""
    found, frontier = set(), [target]
    while frontier:
        node = frontier.pop()
        for edge in experiment.edges:
            near, far = (edge.dst, edge.src) if backward else (edge.src, edge.dst)
            if near == node and far not in found:
                found.add(far)
                frontier.append(far)
    return found
