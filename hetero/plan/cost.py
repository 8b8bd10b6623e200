"""The planner's cost model: step time and memory per rank of one transformer module under one layout.

Compute is priced per kernel from the device description: a GEMM takes ``overhead + FLOPs / rate``, an
elementwise kernel ``overhead + bytes / bandwidth``, attention its FLOPs at the attention rate (causal
attention skips the masked half, as flash kernels do). Backward costs twice the forward, recomputation
one forward more. Communication is priced per collective on the slowest link its group crosses
(``latency`` per step of a ring, ``bytes / bandwidth`` for the data): tensor-parallel all-reduces of the
layer outputs, context-parallel all-gathers of K/V (and their reduce-scatter in backward), pipeline sends
of the stage activations, the data-parallel gradient all-reduce (scaled by the module's gradient
compression). A 1F1B pipeline runs ``m`` microbatches through its slowest stage and one through each of
the others (``m + pp - 1`` slots when the stages balance). Memory per rank is the
weights, gradients and optimizer state of its shard plus the activations its in-flight microbatches keep
(every layer's saved tensors, or only the layer inputs under recomputation).

A frozen module (``Transformer.training``) is priced as what it runs: ``"inputs"`` (frozen, below a
trained module) a forward and the inputs' half of the backward, no gradient sync, no optimizer, its
weights alone in memory; ``"forward"`` (nothing trained at or above it) the forward only, keeping no
activations beyond one layer's working set.

A module is one or more stacks of identical layers, each at its own tokens per sample: GeneZip's encoder
and decoder at the bases, its main network at the chunks; the video generator over its training sequence
of clean and noisy frames. What lies outside the layers of those two kinds is a list of GEMMs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hetero.data.genome import BASES
from hetero.errors import ConfigError
from hetero.kinds.flops import TRAINING_MULTIPLIER, projector_forward_flops_per_image
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.regions import CLASSIFIER_DILATIONS, FEATURES
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.flops import active_ffn_size, gpt_forward_flops_per_token
from hetero.models.video.config import VideoConfig
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.flops import vit_forward_flops_per_image
from hetero.plan.cluster import ClusterSpec, LinkSpec

GIB = 1024**3
# Passes of the forward's cost per training mode: forward, the inputs' gradients, the weights' gradients.
TRAINING_PASSES = {"full": TRAINING_MULTIPLIER, "inputs": TRAINING_MULTIPLIER - 1, "forward": 1}


def training_passes(module: Transformer) -> float:
    """Passes of the forward's cost ``module`` runs per training step: the weights' gradients only for the
    share of its parameters that train (matmuls in proportion to their weights)."""
    if module.training != "full":
        return TRAINING_PASSES[module.training]
    return TRAINING_PASSES["full"] - 1 + module.trained_share


@dataclass(frozen=True)
class Stack:
    """Layers of a module that run at one token count per sample."""

    layers: int
    seq: int
    causal: bool  # the attention kernel skips the masked half (a flash kernel's is_causal); False: dense


@dataclass(frozen=True)
class Gemm:
    """A matmul outside the layers: ``rows`` per sample times a ``(k, n)`` weight."""

    rows: int
    k: int
    n: int


@dataclass(frozen=True)
class Transformer:
    """What the cost model needs of a module: stacks of transformer layers over fixed-length samples."""

    name: str
    kind: str  # "gpt" (causal, SwiGLU, vocabulary head), "vit" (bidirectional, GELU, projector), "genezip", "video"
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
    merge: int = 1  # vit: a merger of merge × merge patches into one token (out_tokens) in place of the projector
    positions: bool = True  # vit: learned position embeddings (a projector of its own has none)
    model_flops_per_sample: float = 0.0  # training FLOPs (MFU convention), as hetero.kinds.flops counts them
    idle_ffn: int = 0  # gpt with experts: the units of the experts a token skips (memory, no compute); ffn is the active ones
    stacks: tuple[Stack, ...] = ()  # genezip, video: the layers at each token count (``layers`` is their sum)
    outer: tuple[Gemm, ...] = ()  # genezip, video: the matmuls outside the layers
    training: str = "full"  # full | inputs (frozen: input gradients only) | forward (frozen, nothing trained above)
    trained_share: float = 1.0  # full: the share of its parameters that train (the rest frozen by glob)
    head_size: int = 0  # a head's width where the model sets it (0: hidden / heads)
    pixels: int = 0  # vit: pixels a rank's data workers decode and preprocess per sample
    peak_seq: int = 0  # vit at native resolution: the largest image's patches (activation memory; 0: seq)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def gated(self) -> bool:
        """A SwiGLU MLP (three matrices) rather than GELU (two)."""
        return self.kind in ("gpt", "genezip")

    @property
    def stack_list(self) -> tuple[Stack, ...]:
        return self.stacks or (Stack(self.layers, self.seq, self.kind == "gpt"),)

    @property
    def layer_params(self) -> int:
        d = self.head_dim
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden
        mlp = (3 if self.gated else 2) * self.hidden * (self.ffn + self.idle_ffn)
        return attention + mlp

    @property
    def outer_params(self) -> int:
        """Parameters outside the layers: embeddings and head (gpt), patch embedding and projector (vit)."""
        if self.kind == "gpt":
            return 2 * self.vocab * self.hidden
        if self.outer:
            return sum(g.k * g.n for g in self.outer)
        projector = self.hidden * self.out_width + self.out_width**2 if self.projector else 0
        if self.merge > 1:
            width = self.hidden * self.merge**2
            projector = width * width + width * self.out_width
        return self.head_in * self.hidden + projector + (self.seq * self.hidden if self.positions else 0)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.outer_params


def describe(name: str, kind: str, config: GPTConfig | ViTConfig | GeneZipConfig | VideoConfig,
             seq_len: int | None = None, clip_frames: int = 32) -> Transformer:
    """The cost model's view of a module of ``kind`` (gpt at context ``seq_len`` if given; video over clips
    of ``clip_frames``)."""
    if kind == "gpt":
        if config.kv_lora_rank:
            raise ConfigError(f"{name}: the planner prices grouped-query attention, not multi-head latent attention "
                             f"({name}.model.kv_lora_rank={config.kv_lora_rank}) yet; `hetero layout` counts its "
                             "parameters and bytes per rank")
        seq = seq_len or config.seq_len
        active = active_ffn_size(config)
        return Transformer(
            name, "gpt", config.num_layers, config.hidden_size, config.num_heads, config.kv_heads,
            active, seq, vocab=config.vocab_size, head_size=config.head_size,
            model_flops_per_sample=TRAINING_MULTIPLIER * seq * gpt_forward_flops_per_token(config, seq),
            idle_ffn=config.expert_size * config.num_experts - config.expert_size * config.top_k if config.moe else 0,
        )
    if kind == "vit":
        return Transformer(
            name, "vit", config.used_layers, config.hidden_size, config.num_heads,
            config.num_heads, config.ffn_size, config.seq_len,
            head_in=config.channels * config.patch_size**2, out_width=config.out_size, out_tokens=config.feature_tokens,
            projector=config.projector, merge=config.merge,
            model_flops_per_sample=TRAINING_MULTIPLIER * vit_forward_flops_per_image(config),
            pixels=config.image_size**2, peak_seq=config.max_patches,
        )
    if kind == "projector":  # no layers: the MLP only (one head: the search keeps it at tp=1)
        return Transformer(
            name, "vit", 0, config.in_size, 1, 1, config.out_size, config.tokens, out_width=config.out_size,
            out_tokens=config.tokens, positions=False,
            model_flops_per_sample=TRAINING_MULTIPLIER * projector_forward_flops_per_image(
                config.in_size, config.out_size, config.tokens),
        )
    if kind == "genezip":
        return _genezip(name, config)
    if kind == "video":
        return _video(name, config, clip_frames)
    raise ValueError(f"{name}: the planner models gpt, vit, projector, genezip and video modules, not {kind!r}")


def _genezip(name: str, config: GeneZipConfig) -> Transformer:
    """GeneZip at its target rates: each stage's encoder and decoder over its positions (the local window
    is a mask over all of them, so the kernel computes every key), the main network over the last
    stage's chunks (causal); the router, residual, output head, projector and region classifier outside
    the layers."""
    h, stacks, outer, chunks = config.hidden_size, [], [], []
    positions = config.seq_len
    for rate in [config.target_bpt] + [config.inner_bpt] * (config.stages - 1):
        stacks.append(Stack(config.encoder_layers + config.decoder_layers, positions, causal=False))
        outer += [Gemm(positions, h, h)] * (3 if config.routing == "dynamic" else 1)  # router's two maps, residual
        positions = math.ceil(positions / rate) if chunks else min(math.ceil(positions / rate), config.max_tokens())
        chunks.append(positions)
    stacks.append(Stack(config.main_layers, positions, causal=True))
    outer.append(Gemm(config.seq_len, h, len(BASES)))  # the next-base head
    if config.out_size:
        outer.append(Gemm(chunks[0], h, config.out_size))
    if config.region_budget():  # the region classifier: input map, each convolution (3 taps), logit
        width = config.region_channels
        outer += [Gemm(config.seq_len, FEATURES, width)]
        outer += [Gemm(config.seq_len, 3 * width, width)] * len(CLASSIFIER_DILATIONS) + [Gemm(config.seq_len, width, 1)]
    return _stacked(name, "genezip", config.num_heads, h, config.ffn_size, tuple(stacks), tuple(outer),
                    out_tokens=config.max_tokens(), out_width=config.out_size or h)


def _video(name: str, config: VideoConfig, frames: int) -> Transformer:
    """The video generator's training pass over one clip of ``frames``: every block over the clean frames
    and the noisy frames 1..T-1 under a dense visibility mask; the patch embeddings, flow-time MLP,
    conditioning and head outside the layers (a learned memory's distillation pass is not priced)."""
    h, patches, patch_dim = config.hidden_size, config.patches_per_frame, config.patch_dim
    length = (2 * frames - 1) * patches
    outer = [Gemm(frames * patches, patch_dim, h), Gemm((frames - 1) * patches, patch_dim, h),
             Gemm(frames - 1, h, h), Gemm(frames - 1, h, h), Gemm(length, h, patch_dim)]
    if config.condition_size:
        outer.append(Gemm(1, config.condition_size, h))
    return _stacked(name, "video", config.num_heads, h, config.ffn_size,
                    (Stack(config.num_layers, length, causal=False),), tuple(outer), out_tokens=0, out_width=0)


def _stacked(name: str, kind: str, heads: int, hidden: int, ffn: int, stacks: tuple[Stack, ...],
             outer: tuple[Gemm, ...], out_tokens: int, out_width: int) -> Transformer:
    module = Transformer(name, kind, sum(s.layers for s in stacks), hidden, heads, heads, ffn,
                         max(s.seq for s in stacks), out_width=out_width, out_tokens=out_tokens, stacks=stacks,
                         outer=outer)
    return dataclasses.replace(module, model_flops_per_sample=TRAINING_MULTIPLIER * stacked_forward_flops(module))


def stacked_forward_flops(module: Transformer) -> float:
    """Forward FLOPs per sample of a module of stacks, counted as ``hetero.kinds.flops`` counts (every
    attention score, masked or not)."""
    q_width = kv_width = module.heads * module.head_dim
    projections = 2 * module.hidden * (q_width + 2 * kv_width) + 2 * q_width * module.hidden
    mlp = 2 * (3 if module.gated else 2) * module.hidden * module.ffn
    layers = sum(s.layers * s.seq * (projections + 2 * 2 * s.seq * q_width + mlp) for s in module.stack_list)
    return layers + sum(2 * g.rows * g.k * g.n for g in module.outer)


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
    slots: float = 1  # the pipeline's slots of ``microbatch_s``: microbatches + the other stages' share of one
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
        return self.device.matmul_overhead_us * 1e-6 + 2 * m * k * n / (self.device.matmul_tflops * 1e12 * self.gemm_efficiency(m, n))

    def gemm_efficiency(self, m: float, n: float) -> float:
        """The share of the sustained GEMM rate an ``m x n`` output gets: its useful share of the padded
        tiles, times the share of the SMs its tiles occupy (1 without a tile model)."""
        sms, tile = self.device.sms, self.device.gemm_tile
        if not sms:
            return 1.0
        rows, cols = math.ceil(m / tile), math.ceil(n / tile)
        return m * n / (rows * cols * tile * tile) * min(1.0, rows * cols / sms)

    def elementwise_s(self, kernels: int, nbytes: float) -> float:
        return kernels * self.device.elementwise_overhead_us * 1e-6 + nbytes / (self.device.memory_gb_s * 1e9)

    def attention_s(self, flops: float, head_dim: int = 0) -> float:
        """Attention of ``flops`` whose kernel computes heads of ``head_dim`` rounded up to the device's
        ``attention_head_tile``."""
        rate = self.device.attention_tflops or self.device.matmul_tflops
        tile = self.device.attention_head_tile
        padding = math.ceil(head_dim / tile) * tile / head_dim if tile and head_dim else 1.0
        return self.device.matmul_overhead_us * 1e-6 + flops * padding / (rate * 1e12)

    def layer_forward_s(self, module: Transformer, choice: Choice, stack: Stack | None = None) -> float:
        """One layer (of ``stack``, default the module's only one), one microbatch, forward, on one rank."""
        stack = stack or module.stack_list[0]
        tokens = choice.micro * math.ceil(stack.seq / choice.cp)
        d, tp = module.head_dim, choice.tp
        q_width, kv_width, ffn = module.heads * d / tp, module.kv_heads * d / tp, module.ffn / tp
        if module.gated:
            shapes = [(module.hidden, q_width), (module.hidden, kv_width), (module.hidden, kv_width),
                      (q_width, module.hidden), (module.hidden, ffn), (module.hidden, ffn), (ffn, module.hidden)]
        else:
            shapes = [(module.hidden, q_width)] * 3 + [(q_width, module.hidden), (module.hidden, ffn), (ffn, module.hidden)]
        gemms = sum(self.gemm_s(tokens, k, n) for k, n in shapes)
        causal = 0.5 if stack.causal else 1.0
        attention = self.attention_s(causal * 4 * tokens * stack.seq * q_width, d)  # queries here x every key
        # Two norms and two residual adds over the hidden width, rotary or bias work on q/k, the MLP's
        # activation (and gate product): each kernel reads its inputs and writes its output once.
        elements = tokens * (10 * module.hidden + 4 * (q_width + kv_width) + 3 * ffn)
        kernels = 10 if module.gated else 8
        return gemms + attention + self.elementwise_s(kernels, elements * self.device.activation_bytes)

    def outer_forward_s(self, module: Transformer, choice: Choice) -> tuple[float, float]:
        """Forward time of what sits before the first layer and after the last: (first stage, last stage)."""
        tokens = choice.micro * math.ceil(module.seq / choice.cp)
        act = self.device.activation_bytes
        if module.outer:
            return sum(self.gemm_s(choice.micro * g.rows, g.k, g.n) for g in module.outer), 0.0
        if module.kind == "gpt":
            vocab = module.vocab / choice.tp
            first = self.elementwise_s(1, tokens * module.hidden * act)  # embedding lookup
            # Output GEMM, then the loss over fp32 logits (softmax, log, gather: a few passes).
            last = self.gemm_s(tokens, module.hidden, vocab) + self.elementwise_s(4, 4 * tokens * vocab * 4)
            return first, last
        first = self.gemm_s(tokens, module.head_in, module.hidden) + self.elementwise_s(2, 2 * tokens * module.hidden * act)
        if module.merge > 1:  # the merger: a norm per patch, then two matmuls over the merged tokens
            merged, width = math.ceil(tokens / module.merge**2), module.hidden * module.merge**2
            last = (self.elementwise_s(2, 2 * tokens * module.hidden * act) + self.gemm_s(merged, width, width)
                    + self.gemm_s(merged, width, module.out_width))
            return first, last
        if not module.projector:
            return first, 0.0
        last = (self.gemm_s(tokens, module.hidden, module.out_width) + self.gemm_s(tokens, module.out_width, module.out_width)
                + self.elementwise_s(2, 2 * tokens * module.out_width * act))
        return first, last

    def module_cost(
        self, module: Transformer, choice: Choice, samples: int, grad_ratio: float = 1.0,
        extra_first_stage_s: float = 0.0, held_microbatches: int | None = None, first_stage_layers: int | None = None,
        hop_element_bytes: float | None = None, extra_last_stage_s: float = 0.0,
    ) -> ModuleCost:
        """Cost of ``samples`` per step through ``module`` under ``choice``.

        ``grad_ratio``: bytes on the wire per fp32 gradient byte (gradient compression);
        ``extra_first_stage_s``: work folded into the first stage per microbatch (an encoder sharing the
        LLM's pipeline in a homogeneous layout), ``extra_last_stage_s`` into the last (a consumer of its
        hidden states there); ``held_microbatches``: microbatches whose activations
        are alive at once (default: a 1F1B pipeline's, min(pp, microbatches)); an encoder whose outputs
        wait for the LLM's backward holds more; ``first_stage_layers``: layers of the first stage when it
        takes fewer than its share (the rest split evenly over the other stages); ``hop_element_bytes``:
        wire bytes per element, forward + backward, of compressed stage edges."""
        tp, cp, pp, dp = choice.tp, choice.cp, choice.pp, choice.dp
        act = self.device.activation_bytes
        microbatches = max(1, math.ceil(math.ceil(samples / dp) / choice.micro))
        tokens = choice.micro * math.ceil(module.seq / cp)
        if pp > 1 and len(module.stack_list) > 1:
            raise ValueError(f"{module.name}: the cost model splits only modules of one stack into pipeline stages")
        first_layers = math.ceil(module.layers / pp) if first_stage_layers is None or pp == 1 else first_stage_layers
        later_layers = math.ceil((module.layers - first_layers) / (pp - 1)) if pp > 1 else 0
        layers_per_stage = max(first_layers, later_layers)
        backward = module.training != "forward"
        recompute = choice.recompute and backward
        passes = training_passes(module) + (1 if recompute else 0)

        first, last = (passes * t for t in self.outer_forward_s(module, choice))
        tp_link, cp_link = self.cluster.link(tp), self.cluster.link(tp * cp)
        # Per stack, one layer's time (``per_layer``), its TP and CP traffic, and what it saves for backward.
        per_layer, tp_layer, cp_layer, saved, whole = [], [], [], [], []
        if module.gated:
            per_token = 7 * module.hidden + 2 * module.kv_heads * module.head_dim + 4 * module.ffn
        else:
            per_token = 7 * module.hidden + 2 * module.ffn
        for stack in module.stack_list:
            stack_tokens = choice.micro * math.ceil(stack.seq / cp)
            # Native resolution: memory must hold a microbatch of the largest images, time is the typical one's.
            peak_tokens = choice.micro * math.ceil(max(stack.seq, module.peak_seq) / cp)
            # TP: the attention and MLP outputs are all-reduced in forward, their input gradients in backward.
            tp_s = ((4 if backward else 2) + (2 if recompute else 0)) * allreduce_s(stack_tokens * module.hidden * act, tp,
                                                                                    tp_link)
            if tp > 1:
                tp_s += passes / TRAINING_MULTIPLIER * self.device.tp_layer_overhead_us * 1e-6
            kv_bytes = 2 * choice.micro * stack.seq * module.kv_heads * module.head_dim / tp * act
            cp_s = ((2 if backward else 1) + (1 if recompute else 0)) * allgather_s(kv_bytes, cp, cp_link)
            tp_layer.append(tp_s)
            cp_layer.append(cp_s)
            per_layer.append(passes * self.layer_forward_s(module, choice, stack) + tp_s + cp_s)
            saved.append(0.0 if not backward else peak_tokens * (module.hidden if recompute else per_token) * act / tp)
            whole.append(peak_tokens * per_token * act / tp)
        if pp > 1:
            middle = later_layers * per_layer[0]
            stages = [first_layers * per_layer[0] + first + extra_first_stage_s, *[middle] * (pp - 2),
                      middle + last + extra_last_stage_s]
            stage_layers = [layers_per_stage]
        else:
            stages = [sum(s.layers * t for s, t in zip(module.stack_list, per_layer)) + first + last
                      + extra_first_stage_s + extra_last_stage_s]
            stage_layers = [s.layers for s in module.stack_list]
        pp_link = self.cluster.link(tp * cp * dp * 2)
        hop_bytes = tokens * module.hidden / tp * (hop_element_bytes or 2 * act)
        pp_hop = 2 * pp_link.latency_us * 1e-6 + hop_bytes / (pp_link.bandwidth_gb_s * 1e9) if pp > 1 else 0.0
        # 1F1B: every microbatch through the slowest stage, plus one microbatch through each of the others
        # (their share of the warm-up and cool-down); pp - 1 slots of the slowest when the stages balance.
        stage_s = max(stages)
        slots = microbatches + (sum(stages) - stage_s) / stage_s
        compute = slots * stage_s

        stage_params = (layers_per_stage * module.layer_params + module.outer_params / min(pp, 2)) / tp
        dp_link = self.cluster.link(tp * cp * dp)
        dp_s = allreduce_s(4 * stage_params * grad_ratio, dp * cp, dp_link)  # CP ranks hold the same weights
        state = stage_params * (16 if self.device.precision == "fp32" else 6 + 12 / (dp * cp))
        optimizer_s = self.elementwise_s(4, stage_params * 28 / (1 if self.device.precision == "fp32" else dp * cp))
        # frozen parameters: fp32 weights only, nothing to sync or update
        share = module.trained_share if module.training == "full" else 0.0
        dp_s, optimizer_s, state = share * dp_s, share * optimizer_s, 4 * stage_params + share * (state - 4 * stage_params)

        in_flight = min(held_microbatches or pp, microbatches)
        activations = sum(n * in_flight * per for n, per in zip(stage_layers, saved))
        if recompute or not backward:  # one layer's full activations while it is (re)computed
            activations += max(whole)
        logits = 2 * tokens * module.vocab / tp * 4 if module.kind == "gpt" else 0.0
        return ModuleCost(
            step_s=compute + slots * pp_hop + dp_s + optimizer_s,
            compute_s=compute,
            tp_s=sum(slots * n * t for n, t in zip(stage_layers, tp_layer)),
            cp_s=sum(slots * n * t for n, t in zip(stage_layers, cp_layer)),
            pp_s=slots * pp_hop,
            dp_s=dp_s,
            memory_bytes=state + activations + logits,
            microbatches=microbatches,
            microbatch_s=stage_s,
            slots=slots,
            optimizer_s=optimizer_s,
        )

    def host_s(self, module: Transformer, samples: float) -> float:
        """What a rank's data workers take to decode and preprocess ``samples`` of ``module`` (images), in
        parallel with the step: a side whose step is shorter waits for them."""
        host = self.cluster.host
        return samples * module.pixels / 1e6 * host.decode_ms_per_megapixel / 1e3 / host.loader_workers

    def fits(self, memory_bytes: float) -> bool:
        return memory_bytes <= self.device.usable_memory * self.device.memory_gib * GIB
