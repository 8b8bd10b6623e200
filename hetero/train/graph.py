"""Train the four-module graph, each module under its own layout: vision and DNA encoders feed an LLM
whose final hidden states condition a video generator (``hetero.testing.full_graph`` defines the losses
and is the single-process reference).

Every rank runs the same phases in the same order, so edge calls pair up whatever the placement
(colocated, disjoint or mixed; DESIGN §4):

1. encoder ranks: each encoder's forward, per microbatch, on the rows that carry its modality, split
   evenly over the encoder's DP replicas (graphs kept; GeneZip's own loss too);
2. every rank: the ``vision->llm`` and ``dna->llm`` edges move each microbatch's embeddings to every
   rank of the LLM's first stage (all rows of the microbatch that carry the modality, so the LLM's DP
   replicas need not own equal shares); each replica merges its own rows' into its token embeddings;
3. LLM ranks: the forward half of a GPipe step over the LLM's stages (``pipeline_forward``); the last
   stage keeps its text loss and its final hidden states;
4. per microbatch: the last stage gathers the hidden states of the rows that carry a clip over its DP
   replicas, the ``llm->video`` edge moves them to the generator's layout (split over its DP), the
   generator computes each clip's flow-matching loss and its backward, and the edge returns the
   gradients of the hidden states;
5. LLM ranks: the backward half of the GPipe step, the last stage adding for each microbatch the inner
   product of its hidden states with their returned gradients to its text loss;
6. every rank: the encoder edges return the embeddings' gradients; encoder ranks run their backward;
7. each module's gradient sync, one world-wide gradient-norm clip, every optimizer step (or, when a
   gradient or loss is not finite anywhere, a skipped step everywhere).

A microbatch's count of rows per modality varies; a modality absent from a whole microbatch skips its
edge calls on every rank (every rank holds the global batch, so all agree). Losses are sums divided by
global counts (supervised tokens, DNA windows, clips), so gradients summed over replicas are exact.
Edges may compress their traffic (``edge_compression``); the LLM's stage edges and each module's
gradient sync take their module's ``compression`` block. Evaluation sends fp32 through plain edges.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hetero.data.digits import IGNORE_INDEX, dp_rows
from hetero.errors import ConfigError
from hetero.testing.full_graph import (
    LOSSES,
    SEED_OFFSETS,
    GraphConfigs,
    clip_loss_sum,
    dna_loss_sum,
    merge_rows,
)
from hetero.kinds.genezip.model import GeneZip, padded_tokens
from hetero.kinds.genezip.plan import parallelize_genezip
from hetero.kinds.gpt.model import GPT, token_loss_sum
from hetero.kinds.gpt.plan import parallelize_gpt
from hetero.kinds.video.model import VideoGenerator
from hetero.kinds.video.plan import parallelize_video
from hetero.kinds.vit.model import VisionEncoder
from hetero.kinds.vit.plan import parallelize_vision
from hetero.parallel.boundary import Boundary, Side, TensorSpec
from hetero.parallel.boundary_plan import Sharding
from hetero.parallel.boundary_transport import LinkedTransport
from hetero.parallel.compressed_boundary import CompressedBoundary
from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.layout import Layout
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.pipeline import PipelineStage, pipeline_backward, pipeline_forward
from hetero.parallel.placement import Placement
from hetero.train.module_runtime import ModuleRuntime, TrainerState, ModuleSetup, local_tensor
from hetero.train.stage_links import CallableStage, llm_stage_edges, stage_links
from hetero.train.world_step import nonfinite_modules, sync_clip_and_step

ENCODERS = ("vision", "dna")
MODULES = ("vision", "dna", "llm", "video")
EDGES = (("vision", "llm"), ("dna", "llm"), ("llm", "video"))
LOSS_MODULE = {"text": "llm", "dna": "dna", "video": "video"}  # the module each loss belongs to
_PARALLELIZE = {
    "vision": lambda c, mesh, o: parallelize_vision(VisionEncoder(c.vision), mesh, o),
    "dna": lambda c, mesh, o: parallelize_genezip(GeneZip(c.dna), mesh, o),
    "llm": lambda c, mesh, o: parallelize_gpt(GPT(c.llm), mesh, o),
    "video": lambda c, mesh, o: parallelize_video(VideoGenerator(c.video), mesh, o),
}


class GraphEdge:
    """One edge of the graph, plain (``Boundary``) or compressed (``CompressedBoundary``), called per
    microbatch: ``forward`` then ``backward`` on every rank. Build it on every rank, in the same order."""

    def __init__(self, name: str, source: Layout, destination: Layout, spec: TensorSpec, hidden: int,
                 compression: EdgeCompressionConfig | None, timeout_s: float):
        self.name = name
        self.compressed = compression is not None and compression.enabled
        self.plain = Boundary(name, Side(source), Side(destination), spec, timeout_s=timeout_s)
        self.codec = (CompressedBoundary(name, Side(source), Side(destination), spec, hidden, compression,
                                         timeout_s=timeout_s) if self.compressed else None)
        self._transfers: dict[int, object] = {}
        self._use_codec = False

    def begin(self, training: bool) -> None:
        """Training passes go through the codec when there is one; evaluation sends fp32."""
        self._use_codec = training and self.codec is not None

    @property
    def copies_gradients(self) -> bool:
        """Whether destination replicas hand in full gradients (codec) rather than shares of a sum."""
        return self._use_codec

    def forward(self, microbatch: int, x: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        if self._use_codec:
            return self.codec.forward(microbatch, x, shape)
        transfer = self.plain.forward(x, shape)
        self._transfers[microbatch] = transfer
        return transfer.output

    def backward(self, microbatch: int, grad: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
        if self._use_codec:
            return self.codec.backward(microbatch, grad, shape)
        return self.plain.backward(self._transfers.pop(microbatch), grad)

    def counters(self) -> dict[str, int]:
        """Wire bytes sent by this rank so far (cross-module and within replica groups), per direction."""
        totals = dict.fromkeys(("forward", "backward"), 0)
        for link in (self.plain, self.codec):
            for key, value in (link.counters() if link is not None else {}).items():
                direction, kind = key.split(".", 1)
                if kind in ("cross_sent_bytes", "intra_sent_bytes"):
                    totals[direction] += value
        return totals


class GraphTrainer(TrainerState):
    def __init__(
        self,
        placement: Placement,
        meshes: Mapping[str, ModuleMesh],
        configs: GraphConfigs,
        *,
        num_microbatches: int,
        setups: Mapping[str, ModuleSetup],
        loss_weights: Mapping[str, float],
        edge_compression: Mapping[tuple[str, str], EdgeCompressionConfig] | None = None,
        grad_clip: float = 0.0,
        seed: int = 0,
        timeout_s: float = 300.0,
        sample_reuse: int = 1,
    ):
        """``loss_weights``: the weight of each of ``LOSSES`` in the combined loss; ``edge_compression``:
        codecs per edge ``(src, dst)``; ``sample_reuse``: each batch serves this many consecutive steps."""
        missing = [name for name in MODULES if name not in placement.layouts]
        if missing:
            raise ConfigError(f"the graph trainer needs modules {', '.join(MODULES)}; {', '.join(missing)} missing")
        for name in MODULES:
            layout, options = placement.layouts[name], setups[name].options
            if layout.cp > 1 or options.sequence_parallel:
                raise ConfigError(
                    f"{name}: the graph's edges move whole sequences, so every module runs with cp=1 and "
                    f"sequence_parallel=false (got cp={layout.cp}, sequence_parallel={options.sequence_parallel})"
                )
        self.placement, self.configs, self.setups = placement, configs, setups
        self.num_microbatches, self.grad_clip, self.seed = num_microbatches, grad_clip, seed
        self.weights = dict(loss_weights)
        self.sample_reuse = sample_reuse
        self.step = 0
        self.nonfinite: dict[str, list[int]] = {}
        self.modules: dict[str, ModuleRuntime] = {}
        for name in MODULES:
            if name in meshes:
                torch.manual_seed(seed + SEED_OFFSETS[name])  # as FullGraphModel draws them
                model = _PARALLELIZE[name](configs, meshes[name], setups[name].options)
                self.modules[name] = ModuleRuntime(name, model, meshes[name], setups[name], seed)
        layouts = placement.layouts
        spread, gathered = Sharding(batch_dim=0, seq_dim=None), Sharding(batch_dim=None, seq_dim=None)
        compression = edge_compression or {}
        # Built on every rank, in the same order, whether or not this rank takes part.
        self.edges = {
            f"{src}->{dst}": GraphEdge(
                f"{src}->{dst}", layouts[src], layouts[dst],
                # Encoders spread their rows over DP; every LLM replica takes all rows (it keeps its own).
                # The LLM's hidden states leave gathered and spread over the generator's DP.
                TensorSpec(3, source=spread if src in ENCODERS else gathered,
                           destination=gathered if dst == "llm" else spread),
                configs.llm.hidden_size if src == "llm" else configs.embedding_shape(src)[1],
                compression.get((src, dst)), timeout_s,
            )
            for src, dst in EDGES
        }
        llm = self.modules.get("llm")
        self.llm_edges = llm_stage_edges(llm, setups["llm"].compression.pipeline)
        self.pipeline_bytes = {"forward": 0, "backward": 0}
        self.module_seconds = dict.fromkeys(MODULES, 0.0)  # this rank's compute time per module, summed

    # ------------------------------------------------------------------------------------ public API

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on the global batch; returns the combined loss, each module's loss, the
        gradient norm and whether the step was taken."""
        return self._step(batch, update=True)

    def evaluate(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Losses and next-token accuracy at the digit (rows with an image) and at the GC bin (rows with
        DNA), without changing any weight."""
        metrics = self._step(batch, update=False)
        for module in self.modules.values():
            module.optimizer.zero_grad(set_to_none=True)
        return metrics

    def edge_ends(self) -> dict[str, EdgeEnd]:
        """This rank's ends of compressed edges: the graph's edges and the LLM's stage edges."""
        ends = {f"llm.{side}": end for side, end in self.llm_edges.items()}
        for name, edge in self.edges.items():
            if edge.codec is not None:
                ends[f"{name}.upstream"], ends[f"{name}.downstream"] = edge.codec.upstream, edge.codec.downstream
        return ends

    # ---------------------------------------------------------------------------------------- a step

    def _step(self, batch: Mapping[str, torch.Tensor], update: bool) -> dict[str, float]:
        size = batch["tokens"].shape[0]
        if size % self.num_microbatches:
            raise ConfigError(f"global batch of {size} samples does not split into {self.num_microbatches} microbatches")
        micro = size // self.num_microbatches
        spans = [slice(m * micro, (m + 1) * micro) for m in range(self.num_microbatches)]
        flags = {"vision": batch["has_image"], "dna": batch["has_dna"], "video": batch["has_clip"]}
        # Per modality and microbatch: the global-batch rows that carry it.
        self._rows = {name: [span.start + torch.nonzero(flag[span]).flatten() for span in spans]
                      for name, flag in flags.items()}
        self._counts = {"text": int((batch["labels"] != IGNORE_INDEX).sum()),
                        "dna": max(int(flags["dna"].sum()), 1), "video": max(int(flags["video"].sum()), 1)}
        self._sums: dict[str, list[torch.Tensor]] = {name: [] for name in LOSSES}
        self._hits = torch.zeros(2, 2, dtype=torch.float64)  # digit, GC bin: correct, evaluated
        self._training = update
        for module in self.modules.values():
            module.optimizer.zero_grad(set_to_none=True)
        for edge in self.edges.values():
            edge.begin(update)
        edge_states = {key: end.state_dict() for key, end in self.edge_ends().items()} if update else {}
        if update:
            self._begin_compressed_edges(batch, spans)

        outputs = {name: [self._encode(name, batch, m) for m in range(len(spans))]
                   for name in ENCODERS if name in self.modules}
        delivered = {name: self._send_embeddings(name, outputs.get(name)) for name in ENCODERS}
        llm = self.modules.get("llm")
        parallel_loss = loss_parallel() if self.placement.layouts["llm"].tp > 1 else contextlib.nullcontext()
        with parallel_loss:
            forward = self._llm_forward(llm, batch, spans, delivered) if llm is not None else None
            extras = [self._video_microbatch(batch, m, spans[m], forward) for m in range(len(spans))]
            if forward is not None:
                with self._timed("llm"):
                    pipeline_backward(forward, extras if llm.mesh.is_last_stage else None)
                for link in self._stage_links:
                    for direction, sent in getattr(link, "sent_bytes", {}).items():
                        self.pipeline_bytes[direction] += sent
        for name in ENCODERS:
            self._return_embedding_grads(name, outputs.get(name))
        for module in self.modules.values():  # a rank that saw no rows of its modality still syncs
            for param in module.model.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)

        metrics = self._world_losses()
        if not update:
            return metrics | self._world_accuracy()
        bad = {LOSS_MODULE[name]: any(not bool(torch.isfinite(local_tensor(v)).all()) for v in values)
               for name, values in self._sums.items()}
        self.nonfinite = nonfinite_modules(list(self.placement.layouts), self.modules, bad)
        if self.nonfinite:
            self.undo_step(edge_states)
            self.step += 1
            return metrics | {"grad_norm": math.nan, "stepped": 0.0}
        grad_norm = sync_clip_and_step(list(self.placement.layouts), self.modules, self.grad_clip, self.step)
        self.step += 1
        return metrics | {"grad_norm": grad_norm, "stepped": float(math.isfinite(grad_norm))}

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        tick = time.perf_counter()
        yield
        self.module_seconds[name] += time.perf_counter() - tick

    def _local_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The rows of ``rows`` (one microbatch's rows of a modality) module ``name``'s DP replica takes."""
        mesh = self.modules[name].mesh
        return rows[dp_rows(len(rows), mesh.coord.dp, mesh.layout.dp)]

    def _own_positions(self, rows: torch.Tensor, span: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Of ``rows`` (global rows of microbatch ``span``), the positions the LLM's DP replica owns, and
        those rows' indices within the replica's local microbatch."""
        own = self.modules["llm"].rows(span.stop - span.start)
        local = rows - span.start - own.start
        keep = torch.nonzero((local >= 0) & (local < own.stop - own.start)).flatten()
        return keep, local[keep]

    def _begin_compressed_edges(self, batch: Mapping[str, torch.Tensor], spans: list[slice]) -> None:
        """Tell each compressed edge end its rows (global-batch positions) per microbatch."""
        fresh = self.step % self.sample_reuse == 0
        for (src, dst), edge in zip(EDGES, self.edges.values()):
            if edge.codec is None:
                continue
            modality = "video" if src == "llm" else src
            everyone = self._rows[modality]
            split = src if src != "llm" else dst
            spread = [self._local_rows(split, r) if split in self.modules else r[:0] for r in everyone]
            source_rows, destination_rows = (spread, everyone) if dst == "llm" else (everyone, spread)
            edge.codec.begin_step(source_rows, destination_rows, fresh, batch.get("index"))
        llm = self.modules.get("llm")
        for end in self.llm_edges.values():
            local = llm.rows(spans[0].stop - spans[0].start)
            end.begin_step([torch.arange(local.start, local.stop) + s.start for s in spans], fresh, batch.get("index"))

    # ------------------------------------------------------------------------------- the phases

    def _encode(self, name: str, batch: Mapping[str, torch.Tensor], m: int):
        """Encoder ``name``'s embeddings of its rows of microbatch ``m`` (a graph) and its own weighted
        loss (GeneZip; None for vision)."""
        module = self.modules[name]
        rows = self._local_rows(name, self._rows[name][m])
        tokens, width = self.configs.embedding_shape(name)
        if len(rows) == 0:
            return torch.zeros(0, tokens, width), None
        with self._timed(name):
            if name == "vision":
                return module.model(batch["images"][rows]), None
            output, total = dna_loss_sum(module.model, self.configs.dna, batch["dna"][rows], batch["dna_regions"][rows])
            if module.mesh.coord.tp == 0:
                self._sums["dna"].append(total.detach())
            return padded_tokens(output, self.configs.dna), total * (self.weights["dna"] / self._counts["dna"])

    def _send_embeddings(self, name: str, outputs: list | None) -> list[torch.Tensor | None]:
        edge = self.edges[f"{name}->llm"]
        tokens, width = self.configs.embedding_shape(name)
        delivered = []
        for m, rows in enumerate(self._rows[name]):
            if len(rows) == 0:
                delivered.append(None)
                continue
            sent = outputs[m][0].detach() if outputs is not None else None
            delivered.append(edge.forward(m, sent, (len(rows), tokens, width)))
        return delivered

    def _llm_forward(self, llm: ModuleRuntime, batch, spans, delivered):
        """The forward half of the LLM's GPipe step; the last stage keeps its hidden states per microbatch."""
        mesh, configs = llm.mesh, self.configs
        first, last = mesh.is_first_stage, mesh.is_last_stage
        own = llm.rows(spans[0].stop - spans[0].start)
        self._received: dict[str, list[torch.Tensor | None]] = {name: [] for name in ENCODERS}
        inputs = []
        for m, span in enumerate(spans):
            merges = []
            for name in ENCODERS:
                leaf = None
                if first and delivered[name][m] is not None:
                    leaf = delivered[name][m].detach().requires_grad_()
                    keep, local = self._own_positions(self._rows[name][m], span)
                    merges.append((configs.placeholder_start(name), leaf[keep], local))
                self._received[name].append(leaf)
            inputs.append((batch["tokens"][span][own], merges))
        evaluated = None if self._training else torch.stack([batch["digit_position"], batch["gc_position"]], 1)
        targets = [(batch["labels"][span][own], None if evaluated is None else evaluated[span][own]) for span in spans]
        self._hidden: list[torch.Tensor] = []
        model = llm.model

        def stage(x):
            if first:
                ids, merges = x
                x = model.tok_embeddings(ids)
                for start, values, rows in merges:
                    x = merge_rows(x, start, values, rows)
            return model(x, return_hidden=True) if last else model(x)

        def loss_fn(output, target):
            logits, hidden = output
            labels, positions = target
            if positions is not None:
                self._count_hits(logits, labels, positions)
            text = token_loss_sum(logits, labels) / self._counts["text"]
            self._sums["text"].append(text.detach())
            self._hidden.append(hidden)
            return text * self.weights["text"]

        activation = (own.stop - own.start, configs.llm.seq_len, configs.llm.hidden_size)
        prev_link, next_link = stage_links(mesh, activation, self.llm_edges if self._training else {})
        with self._timed("llm"):
            forward = pipeline_forward(
                PipelineStage(CallableStage(stage), mesh.coord.pp, mesh.layout.pp, LinkedTransport(prev_link, next_link)),
                len(spans), inputs if first else None, targets if last else None, loss_fn,
            )
        self._stage_links = (prev_link, next_link) if self._training else ()
        return forward

    def _video_microbatch(self, batch, m: int, span: slice, forward) -> torch.Tensor | None:
        """Microbatch ``m``'s trip through the generator: its clip rows' hidden states forward, the
        generator's loss and backward, the gradients back. On the LLM's last stage, returns the scalar
        whose gradient is those gradients (added to the text loss before the backward)."""
        rows = self._rows["video"][m]
        llm, video = self.modules.get("llm"), self.modules.get("video")
        holds_hidden = llm is not None and llm.mesh.is_last_stage
        if len(rows) == 0:
            return self._as_loss(torch.zeros(()), forward) if holds_hidden else None
        keep = local = sent = None
        if holds_hidden:
            keep, local = self._own_positions(rows, span)
            sent = self._gather_hidden(self._hidden[m][local].detach(), rows, span)
        shape = (len(rows), self.configs.llm.seq_len, self.configs.llm.hidden_size)
        edge = self.edges["llm->video"]
        received = edge.forward(m, sent, shape)
        grad = None
        if video is not None:
            clip_rows = self._local_rows("video", rows)
            condition = received.detach().requires_grad_()
            with self._timed("video"):
                total = clip_loss_sum(video.model, self.configs.video, batch["clips"][clip_rows], condition,
                                      batch["index"][clip_rows].tolist(), self.seed, self.step)
                if video.mesh.coord.tp == 0:
                    self._sums["video"].append(total.detach())
                if len(clip_rows):
                    (total * (self.weights["video"] / self._counts["video"])).backward()
            grad = condition.grad if condition.grad is not None else torch.zeros_like(condition)
            if not edge.copies_gradients:
                grad = grad / video.mesh.layout.tp  # TP replicas each hold the full gradient; the edge sums them
        returned = edge.backward(m, grad, shape)
        if not holds_hidden:
            return None
        return self._as_loss((self._hidden[m][local] * returned[keep]).sum(), forward)

    def _gather_hidden(self, own: torch.Tensor, rows: torch.Tensor, span: slice) -> torch.Tensor:
        """The hidden states of every row of ``rows`` (the microbatch's clip rows), in order, from each
        LLM DP replica's own rows."""
        llm = self.modules["llm"]
        dp = llm.mesh.layout.dp
        if dp == 1:
            return own
        micro = span.stop - span.start
        counts = [int(((rows >= span.start + s.start) & (rows < span.start + s.stop)).sum())
                  for s in (dp_rows(micro, d, dp) for d in range(dp))]
        padded = torch.zeros((max(counts), *own.shape[1:]), dtype=own.dtype)
        padded[: len(own)] = own
        parts = [torch.empty_like(padded) for _ in range(dp)]
        dist.all_gather(parts, padded, group=llm.mesh.group("dp"))
        return torch.cat([part[:count] for part, count in zip(parts, counts)])

    def _as_loss(self, value: torch.Tensor, forward) -> torch.Tensor:
        """``value`` in the form of the last stage's losses (a DTensor under loss parallelism)."""
        reference = forward.losses[0]
        if isinstance(reference, DTensor):
            return DTensor.from_local(value, reference.device_mesh, reference.placements)
        return value

    def _return_embedding_grads(self, name: str, outputs: list | None) -> None:
        """Route encoder ``name``'s embedding gradients back from the LLM's first stage and run the
        encoder's backward (with its own loss)."""
        edge = self.edges[f"{name}->llm"]
        tokens, width = self.configs.embedding_shape(name)
        llm = self.modules.get("llm")
        for m, rows in enumerate(self._rows[name]):
            if len(rows) == 0:
                continue
            grad = None
            leaf = self._received[name][m] if llm is not None else None
            if leaf is not None:
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)  # zeros off its own rows
                if edge.copies_gradients:  # the full gradient on every replica
                    if llm.mesh.layout.dp > 1:
                        dist.all_reduce(grad, group=llm.mesh.group("dp"))
                else:
                    grad = grad / llm.mesh.layout.tp  # TP replicas hold the same rows' gradients
            returned = edge.backward(m, grad, (len(rows), tokens, width))
            if outputs is None or outputs[m][0].shape[0] == 0:
                continue
            embeddings, own_loss = outputs[m]
            with self._timed(name):
                if own_loss is None:
                    embeddings.backward(returned)
                else:
                    torch.autograd.backward([embeddings, own_loss], [returned, torch.ones_like(own_loss)])

    # ----------------------------------------------------------------------------- world metrics

    def _count_hits(self, logits: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor) -> None:
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits  # TP-collective
        for k in range(positions.shape[1]):
            rows = torch.nonzero(positions[:, k] >= 0).flatten()
            rows = rows[labels[rows, positions[rows, k]] != IGNORE_INDEX]
            predicted = full[rows, positions[rows, k]].argmax(-1)
            self._hits[k, 0] += (predicted == labels[rows, positions[rows, k]]).sum()
            self._hits[k, 1] += len(rows)

    def _world_losses(self) -> dict[str, float]:
        """Each loss over the global batch and their weighted sum, known on every rank."""
        totals = torch.zeros(len(LOSSES), dtype=torch.float64)
        llm = self.modules.get("llm")
        if llm is not None and llm.mesh.is_last_stage:
            # full_tensor() is a TP collective: every TP rank takes part, one of them reports.
            text = sum((v.full_tensor() if isinstance(v, DTensor) else v).double() for v in self._sums["text"])
            if llm.mesh.coord.tp == 0:
                totals[0] = text
        for i, name in enumerate(LOSSES[1:], start=1):
            totals[i] = sum(float(v) for v in self._sums[name]) / self._counts[name]
        dist.all_reduce(totals)
        losses = dict(zip(LOSSES, totals.tolist()))
        combined = sum(self.weights[name] * losses[name] for name in LOSSES)
        return {"loss": combined} | {f"{name}_loss": value for name, value in losses.items()}

    def _world_accuracy(self) -> dict[str, float]:
        hits = self._hits
        llm = self.modules.get("llm")
        if llm is None or not llm.mesh.is_last_stage or llm.mesh.coord.tp != 0:
            hits = torch.zeros_like(hits)  # one reporter per LLM data-parallel replica
        dist.all_reduce(hits)
        return {"accuracy": float(hits[0, 0] / hits[0, 1].clamp(min=1)), "evaluated": float(hits[0, 1]),
                "gc_accuracy": float(hits[1, 0] / hits[1, 1].clamp(min=1)), "gc_evaluated": float(hits[1, 1])}

