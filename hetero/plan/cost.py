"""The planner's cost model: step time and memory per rank of one transformer module under one layout.

Compute is priced per kernel from the device description: a GEMM takes ``overhead + FLOPs / rate``, an
elementwise kernel ``overhead + bytes / bandwidth``, attention its FLOPs at the attention rate (causal
attention skips the masked half, as flash kernels do). Backward costs twice the forward, recomputation
one forward more. Communication is priced per collective on the slowest link its group crosses
(``latency`` per step of a ring, ``bytes / bandwidth`` for the data): tensor-parallel all-reduces of the
layer outputs, context-parallel all-gathers of K/V (and their reduce-scatter in backward), pipeline sends
of the stage activations, the data-parallel gradient all-reduce (scaled by the module's gradient
compression). A 1F1B pipeline runs ``m + pp - 1`` slots of its slowest stage. Memory per rank is the
weights, gradients and optimizer state of its shard plus the activations its in-flight microbatches keep
(every layer's saved tensors, or only the layer inputs under recomputation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetero.kinds.flops import (
    TRAINING_MULTIPLIER,
    active_ffn_size,
    gpt_forward_flops_per_token,
    projector_forward_flops_per_image,
    vit_forward_flops_per_image,
)
from hetero.kinds.gpt.config import GPTConfig
from hetero.kinds.vit.config import ViTConfig
from hetero.plan.cluster import ClusterSpec, LinkSpec

GIB = 1024**3


@dataclass(frozen=True)
class Transformer:
    """What the cost model needs of a module: a stack of transformer layers over fixed-length samples."""

    name: str
    kind: str  # "gpt" (causal, SwiGLU, vocabulary head) or "vit" (bidirectional, GELU, projector)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int  # tokens per sample (an image's patches + class token, or the LLM's context)
    vocab: int = 0
    head_in: int = 0  # vit: patch dim; the first stage's input GEMM
    out_width: int = 0  # vit: what crosses the boundary per output token (the projector's width, if any)
    out_tokens: int = 0  # vit: tokens handed on per image
    projector: bool = True  # vit: an MLP projector (in to out_width) after the layers
    positions: bool = True  # vit: learned position embeddings (a projector of its own has none)
    model_flops_per_sample: float = 0.0  # training FLOPs (MFU convention), from hetero.kinds.flops
    idle_ffn: int = 0  # gpt with experts: the units of the experts a token skips (memory, no compute); ffn is the active ones

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        d = self.head_dim
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden
        mlp = (3 if self.kind == "gpt" else 2) * self.hidden * (self.ffn + self.idle_ffn)
        return attention + mlp

    @property
    def outer_params(self) -> int:
        """Parameters outside the layers: embeddings and head (gpt), patch embedding and projector (vit)."""
        if self.kind == "gpt":
            return 2 * self.vocab * self.hidden
        projector = self.hidden * self.out_width + self.out_width**2 if self.projector else 0
        return self.head_in * self.hidden + projector + (self.seq * self.hidden if self.positions else 0)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.outer_params


def describe(name: str, kind: str, config: GPTConfig | ViTConfig, seq_len: int | None = None) -> Transformer:
    """The cost model's view of a module of ``kind`` (gpt at context ``seq_len`` if given, or vit)."""
    if kind == "gpt":
        seq = seq_len or config.seq_len
        active = active_ffn_size(config)
        return Transformer(
            name, "gpt", config.num_layers, config.hidden_size, config.num_heads, config.kv_heads,
            active, seq, vocab=config.vocab_size,
            model_flops_per_sample=TRAINING_MULTIPLIER * seq * gpt_forward_flops_per_token(config, seq),
            idle_ffn=config.expert_size * config.num_experts - config.expert_size * config.top_k if config.moe else 0,
        )
    if kind == "vit":
        return Transformer(
            name, "vit", config.used_layers, config.hidden_size, config.num_heads,
            config.num_heads, config.ffn_size, config.seq_len,
            head_in=config.channels * config.patch_size**2, out_width=config.out_size, out_tokens=config.num_patches,
            projector=config.projector,
            model_flops_per_sample=TRAINING_MULTIPLIER * vit_forward_flops_per_image(config),
        )
    if kind == "projector":  # no layers: the MLP only (one head: the search keeps it at tp=1)
        return Transformer(
            name, "vit", 0, config.in_size, 1, 1, config.out_size, config.tokens, out_width=config.out_size,
            out_tokens=config.tokens, positions=False,
            model_flops_per_sample=TRAINING_MULTIPLIER * projector_forward_flops_per_image(
                config.in_size, config.out_size, config.tokens),
        )
    raise ValueError(f"{name}: the planner models gpt, vit and projector modules, not {kind!r}")


@dataclass(frozen=True)
class Choice:
    """A module's layout as the planner varies it: degrees, samples per microbatch, recomputation."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    micro: int = 1
    recompute: bool = False

    @property
    def ranks(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def label(self) -> str:
        text = f"tp{self.tp}·cp{self.cp}·pp{self.pp}·dp{self.dp} mb{self.micro}"
        return text + (" +recompute" if self.recompute else "")


@dataclass
class ModuleCost:
    step_s: float  # the module's share of a step on its ranks
    compute_s: float
    tp_s: float
    cp_s: float
    pp_s: float
    dp_s: float
    memory_bytes: float  # the fullest rank's
    microbatches: int
    microbatch_s: float  # one microbatch through the slowest stage, forward and backward
    slots: int = 1  # the pipeline's slots of ``microbatch_s``: microbatches + pp - 1
    optimizer_s: float = 0.0

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def bubble_s(self) -> float:
        """A stage's idle slots in the pipeline's warm-up and cool-down."""
        return self.compute_s * (self.slots - self.microbatches) / self.slots

    @property
    def work_s(self) -> float:
        """Forwards, backwards (their TP and CP traffic apart) and the optimizer step."""
        return (self.compute_s - self.tp_s - self.cp_s) * self.microbatches / self.slots + self.optimizer_s

    @property
    def comm_s(self) -> float:
        """TP and CP traffic of the real microbatches, stage hops and the gradient sync."""
        return (self.tp_s + self.cp_s) * self.microbatches / self.slots + self.pp_s + self.dp_s


def allreduce_s(nbytes: float, n: int, link: LinkSpec) -> float:
    """Ring all-reduce of ``nbytes`` per rank over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency_us * 1e-6 + 2 * (n - 1) / n * nbytes / (link.bandwidth_gb_s * 1e9)


def allgather_s(nbytes_total: float, n: int, link: LinkSpec) -> float:
    """Ring all-gather (or reduce-scatter) of a ``nbytes_total`` tensor over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency_us * 1e-6 + (n - 1) / n * nbytes_total / (link.bandwidth_gb_s * 1e9)


def send_s(nbytes: float, link: LinkSpec) -> float:
    return link.latency_us * 1e-6 + nbytes / (link.bandwidth_gb_s * 1e9)


class CostModel:
    def __init__(self, cluster: ClusterSpec):
        self.cluster = cluster
        self.device = cluster.device

    def gemm_s(self, m: float, k: float, n: float) -> float:
        return self.device.matmul_overhead_us * 1e-6 + 2 * m * k * n / (self.device.matmul_tflops * 1e12)

    def elementwise_s(self, kernels: int, nbytes: float) -> float:
        return kernels * self.device.elementwise_overhead_us * 1e-6 + nbytes / (self.device.memory_gb_s * 1e9)

    def attention_s(self, flops: float) -> float:
        rate = self.device.attention_tflops or self.device.matmul_tflops
        return self.device.matmul_overhead_us * 1e-6 + flops / (rate * 1e12)

    def layer_forward_s(self, module: Transformer, choice: Choice) -> float:
        """One layer, one microbatch, forward, on one rank."""
        tokens = choice.micro * math.ceil(module.seq / choice.cp)
        d, tp = module.head_dim, choice.tp
        q_width, kv_width, ffn = module.heads * d / tp, module.kv_heads * d / tp, module.ffn / tp
        if module.kind == "gpt":
            shapes = [(module.hidden, q_width), (module.hidden, kv_width), (module.hidden, kv_width),
                      (q_width, module.hidden), (module.hidden, ffn), (module.hidden, ffn), (ffn, module.hidden)]
        else:
            shapes = [(module.hidden, q_width)] * 3 + [(q_width, module.hidden), (module.hidden, ffn), (ffn, module.hidden)]
        gemms = sum(self.gemm_s(tokens, k, n) for k, n in shapes)
        causal = 0.5 if module.kind == "gpt" else 1.0
        attention = self.attention_s(causal * 4 * tokens * module.seq * q_width)  # queries here x every key
        # Two norms and two residual adds over the hidden width, rotary or bias work on q/k, the MLP's
        # activation (and gate product): each kernel reads its inputs and writes its output once.
        elements = tokens * (10 * module.hidden + 4 * (q_width + kv_width) + 3 * ffn)
        kernels = 10 if module.kind == "gpt" else 8
        return gemms + attention + self.elementwise_s(kernels, elements * self.device.activation_bytes)

    def outer_forward_s(self, module: Transformer, choice: Choice) -> tuple[float, float]:
        """Forward time of what sits before the first layer and after the last: (first stage, last stage)."""
        tokens = choice.micro * math.ceil(module.seq / choice.cp)
        act = self.device.activation_bytes
        if module.kind == "gpt":
            vocab = module.vocab / choice.tp
            first = self.elementwise_s(1, tokens * module.hidden * act)  # embedding lookup
            # Output GEMM, then the loss over fp32 logits (softmax, log, gather: a few passes).
            last = self.gemm_s(tokens, module.hidden, vocab) + self.elementwise_s(4, 4 * tokens * vocab * 4)
            return first, last
        first = self.gemm_s(tokens, module.head_in, module.hidden) + self.elementwise_s(2, 2 * tokens * module.hidden * act)
        if not module.projector:
            return first, 0.0
        last = (self.gemm_s(tokens, module.hidden, module.out_width) + self.gemm_s(tokens, module.out_width, module.out_width)
                + self.elementwise_s(2, 2 * tokens * module.out_width * act))
        return first, last

    def module_cost(
        self, module: Transformer, choice: Choice, samples: int, grad_ratio: float = 1.0,
        extra_first_stage_s: float = 0.0, held_microbatches: int | None = None, first_stage_layers: int | None = None,
        hop_element_bytes: float | None = None,
    ) -> ModuleCost:
        """Cost of ``samples`` per step through ``module`` under ``choice``.

        ``grad_ratio``: bytes on the wire per fp32 gradient byte (gradient compression);
        ``extra_first_stage_s``: work folded into the first stage per microbatch (an encoder sharing the
        LLM's pipeline in a homogeneous layout); ``held_microbatches``: microbatches whose activations
        are alive at once (default: a 1F1B pipeline's, min(pp, microbatches)); an encoder whose outputs
        wait for the LLM's backward holds more; ``first_stage_layers``: layers of the first stage when it
        takes fewer than its share (the rest split evenly over the other stages); ``hop_element_bytes``:
        wire bytes per element, forward + backward, of compressed stage edges."""
        tp, cp, pp, dp = choice.tp, choice.cp, choice.pp, choice.dp
        act = self.device.activation_bytes
        microbatches = max(1, math.ceil(math.ceil(samples / dp) / choice.micro))
        tokens = choice.micro * math.ceil(module.seq / cp)
        first_layers = math.ceil(module.layers / pp) if first_stage_layers is None or pp == 1 else first_stage_layers
        later_layers = math.ceil((module.layers - first_layers) / (pp - 1)) if pp > 1 else 0
        layers_per_stage = max(first_layers, later_layers)
        passes = TRAINING_MULTIPLIER + (1 if choice.recompute else 0)

        layer = passes * self.layer_forward_s(module, choice)
        first, last = (passes * t for t in self.outer_forward_s(module, choice))
        tp_link, cp_link = self.cluster.link(tp), self.cluster.link(tp * cp)
        # TP: the attention and MLP outputs are all-reduced in forward, their input gradients in backward.
        tp_layer = (4 + (2 if choice.recompute else 0)) * allreduce_s(tokens * module.hidden * act, tp, tp_link)
        if tp > 1:
            tp_layer += passes / TRAINING_MULTIPLIER * self.device.tp_layer_overhead_us * 1e-6
        kv_bytes = 2 * choice.micro * module.seq * module.kv_heads * module.head_dim / tp * act
        cp_layer = (2 + (1 if choice.recompute else 0)) * allgather_s(kv_bytes, cp, cp_link)
        per_layer = layer + tp_layer + cp_layer
        if pp > 1:
            stage_s = max(first_layers * per_layer + first + extra_first_stage_s, later_layers * per_layer + last)
        else:
            stage_s = module.layers * per_layer + first + last + extra_first_stage_s
        pp_link = self.cluster.link(tp * cp * dp * 2)
        hop_bytes = tokens * module.hidden / tp * (hop_element_bytes or 2 * act)
        pp_hop = 2 * pp_link.latency_us * 1e-6 + hop_bytes / (pp_link.bandwidth_gb_s * 1e9) if pp > 1 else 0.0
        slots = microbatches + pp - 1
        compute = slots * stage_s

        stage_params = (layers_per_stage * module.layer_params + module.outer_params / min(pp, 2)) / tp
        dp_link = self.cluster.link(tp * cp * dp)
        dp_s = allreduce_s(4 * stage_params * grad_ratio, dp * cp, dp_link)  # CP ranks hold the same weights
        state = stage_params * (16 if self.device.precision == "fp32" else 6 + 12 / (dp * cp))
        optimizer_s = self.elementwise_s(4, stage_params * 28 / (1 if self.device.precision == "fp32" else dp * cp))

        if module.kind == "gpt":
            per_token = 7 * module.hidden + 2 * module.kv_heads * module.head_dim + 4 * module.ffn
        else:
            per_token = 7 * module.hidden + 2 * module.ffn
        saved_per_layer = tokens * (module.hidden if choice.recompute else per_token) * act / tp
        in_flight = min(held_microbatches or pp, microbatches)
        activations = layers_per_stage * in_flight * saved_per_layer
        if choice.recompute:  # one layer's full activations while it is recomputed
            activations += tokens * per_token * act / tp
        logits = 2 * tokens * module.vocab / tp * 4 if module.kind == "gpt" else 0.0
        return ModuleCost(
            step_s=compute + slots * pp_hop + dp_s + optimizer_s,
            compute_s=compute,
            tp_s=slots * layers_per_stage * tp_layer,
            cp_s=slots * layers_per_stage * cp_layer,
            pp_s=slots * pp_hop,
            dp_s=dp_s,
            memory_bytes=state + activations + logits,
            microbatches=microbatches,
            microbatch_s=stage_s,
            slots=slots,
            optimizer_s=optimizer_s,
        )

    def fits(self, memory_bytes: float) -> bool:
        return memory_bytes <= self.device.usable_memory * self.device.memory_gib * GIB
