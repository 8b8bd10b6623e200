"""Train a vision encoder and an LLM, each under its own layout, joined by a boundary communicator.

Non-colocated placements (the encoder's ranks disjoint from all of the LLM's) run one pipeline over
the module graph: the encoder is stage 0, the LLM's stages follow, and the boundary is the link between
stage 0 and the LLM's first stage (``boundary_transport``), under the LLM's schedule (1F1B by default),
so encoder and LLM ranks work at the same time. Colocated and mixed placements share ranks between the
modules, so they run in phases, on every rank in one order (DESIGN §4):

1. vision ranks: encoder forward for every microbatch (graphs kept);
2. every rank: the boundary moves each microbatch's image embeddings into the LLM's layout;
3. LLM ranks: the LLM's schedule (a loop, or GPipe/1F1B over its pipeline stages), image embeddings
   entering at its first stage;
4. every rank: the boundary routes the image-embedding gradients back, microbatch by microbatch;
5. vision ranks: encoder backward;
6. gradient sync per module (deferred until every backward is done), one gradient-norm clip agreed
   across the world, and each module's optimizer step — or a skipped step everywhere if any gradient
   is not finite.

Training steps can send compressed payloads over the boundary (``boundary_compression``, a
``CompressedBoundary``) and between the LLM's stages (``compression.pipeline`` of the LLM's setup);
evaluation always sends fp32 through the plain links, so it measures the weights.

In the phased schedule boundary calls come in the same order on both sides (all forwards, then all
backwards), so they pair without depending on buffered sends; in the graph pipeline the boundary posts
its sends asynchronously, as P2P stages do. Each microbatch loss is a token-loss sum divided by the global
count of supervised tokens, so gradients summed over each module's replicas are exact whatever the
modules' DP degrees. Every rank receives the same global batch and takes its own rows.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hetero.errors import ConfigError
from hetero.kinds.genezip.model import GeneZip, padded_tokens
from hetero.kinds.genezip.config import GeneZipConfig
from hetero.kinds.genezip.objectives import genezip_loss
from hetero.kinds.genezip.plan import parallelize_genezip
from hetero.kinds.gpt.model import GPT, token_loss_sum
from hetero.kinds.gpt.config import GPTConfig
from hetero.kinds.gpt.plan import parallelize_gpt
from hetero.testing.references import merge_image_embeddings
from hetero.kinds.vit.model import VisionEncoder
from hetero.kinds.vit.config import ViTConfig
from hetero.kinds.vit.plan import parallelize_vision
from hetero.parallel.boundary import Boundary, Side, TensorSpec
from hetero.parallel.boundary_plan import Sharding
from hetero.parallel.boundary_transport import BoundaryReceiver, BoundarySender, LinkedTransport
from hetero.parallel.compressed_boundary import CompressedBoundary
from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.pipeline import PipelineStage, run_pipeline
from hetero.parallel.placement import Placement
from hetero.train.module_runtime import ModuleRuntime, TrainerState, ModuleSetup, local_tensor
from hetero.train.stage_links import CallableStage, llm_stage_edges, stage_links
from hetero.train.world_step import nonfinite_modules, sync_clip_and_step


class VLMTrainer(TrainerState):
    def __init__(
        self,
        placement: Placement,
        meshes: dict[str, ModuleMesh],
        vision_config: ViTConfig,
        llm_config: GPTConfig,
        *,
        num_microbatches: int,
        setups: dict[str, ModuleSetup],
        grad_clip: float = 0.0,
        seed: int = 0,
        timeout_s: float = 300.0,
        boundary_compression: EdgeCompressionConfig | None = None,
        sample_reuse: int = 1,
        dna_config: GeneZipConfig | None = None,
    ):
        """``boundary_compression``: the codecs of the vision->llm edge (the LLM's stage edges take
        ``setups["llm"].compression.pipeline``); ``sample_reuse``: the caller serves each batch for this
        many consecutive steps (lazy sampling, which the ``lazy`` compensation relies on); ``dna_config``:
        a GeneZip module named ``dna`` whose compressed tokens follow the image's in the LLM's sequence."""
        self.encoders = ["vision"] + (["dna"] if dna_config is not None else [])
        for name in self.encoders + ["llm"]:
            if name not in placement.layouts:
                raise ConfigError(f"the VLM trainer needs a module named {name!r}; modules are {list(placement.layouts)}")
        llm_layout = placement.layouts["llm"]
        if llm_layout.cp > 1 or setups["llm"].options.sequence_parallel:
            raise ConfigError(
                "llm: the VLM trainer merges image embeddings into whole sequences, so the LLM runs with "
                f"cp=1 and sequence_parallel=false here (got cp={llm_layout.cp}, sequence_parallel="
                f"{setups['llm'].options.sequence_parallel})"
            )
        self.placement = placement
        self.setups = setups
        self.vision_config, self.llm_config, self.dna_config = vision_config, llm_config, dna_config
        self.num_microbatches = num_microbatches
        self.grad_clip = grad_clip
        self.step = 0
        self.nonfinite: dict[str, list[int]] = {}  # the last training step's, when it was skipped
        self.modules: dict[str, ModuleRuntime] = {}
        if "vision" in meshes:
            torch.manual_seed(seed)  # the same seeds as the single-process VisionLanguageModel
            model = parallelize_vision(VisionEncoder(vision_config), meshes["vision"], setups["vision"].options)
            self.modules["vision"] = ModuleRuntime("vision", model, meshes["vision"], setups["vision"], seed)
        if "llm" in meshes:
            torch.manual_seed(seed + 1)
            model = parallelize_gpt(GPT(llm_config), meshes["llm"], setups["llm"].options)
            self.modules["llm"] = ModuleRuntime("llm", model, meshes["llm"], setups["llm"], seed)
        if "dna" in meshes and dna_config is not None:
            torch.manual_seed(seed + 2)
            model = parallelize_genezip(GeneZip(dna_config), meshes["dna"], setups["dna"].options)
            self.modules["dna"] = ModuleRuntime("dna", model, meshes["dna"], setups["dna"], seed)
        # One encoder disjoint from the LLM runs as stage 0 of a pipeline over the graph; two encoders run
        # in phases (a graph schedule for several encoders is the full-graph trainer's job).
        self.graph_pipeline = len(self.encoders) == 1 and not set(placement.layouts["vision"].ranks) & set(
            llm_layout.ranks
        )
        # Built on every rank, in the same order, whether or not this rank takes part.
        self.boundaries = {
            name: Boundary(
                f"{name}->llm",
                Side(placement.layouts[name]),
                Side(llm_layout),
                TensorSpec(ndim=3, source=_image_sharding(), destination=_image_sharding()),
                timeout_s=timeout_s,
                async_sends=self.graph_pipeline,
            )
            for name in self.encoders
        }
        self.boundary = self.boundaries["vision"]
        # Training steps send through the compressed edges; evaluation keeps the plain ones above.
        self.compressed_boundary = None
        if boundary_compression is not None and boundary_compression.enabled:
            self.compressed_boundary = CompressedBoundary(
                "vision->llm",
                Side(placement.layouts["vision"]),
                Side(llm_layout),
                TensorSpec(ndim=3, source=_image_sharding(), destination=_image_sharding()),
                vision_config.out_size,
                boundary_compression,
                timeout_s=timeout_s,
                async_sends=self.graph_pipeline,
            )
        self.sample_reuse = sample_reuse
        self.pipeline_bytes = {"forward": 0, "backward": 0}  # sent between the LLM's stages by this rank
        self.llm_edges: dict[str, EdgeEnd] = {}  # "previous"/"next": ends of compressed LLM stage edges
        self.llm_edges = llm_stage_edges(self.modules.get("llm"), setups["llm"].compression.pipeline)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on the global batch (images, tokens, labels); returns loss and grad norm."""
        return self._step(batch, update=True)

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Loss and next-token accuracy at ``digit_position`` on a batch, without changing any weight.

        It runs the training schedule (so every layout evaluates the same way) and drops the gradients.
        """
        metrics = self._step(batch, update=False)
        for module in self.modules.values():
            module.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _step(self, batch: dict[str, torch.Tensor], update: bool) -> dict[str, float]:
        images, tokens, labels = batch["images"], batch["tokens"], batch["labels"]
        supervised = int((labels != -100).sum())
        size = images.shape[0]
        if size % self.num_microbatches:
            raise ConfigError(
                f"global batch of {size} samples does not split into {self.num_microbatches} microbatches"
            )
        micro = size // self.num_microbatches
        shape = (micro, self.vision_config.num_patches, self.vision_config.out_size)
        for module in self.modules.values():
            module.optimizer.zero_grad(set_to_none=True)

        # Per evaluated position (the digit; with DNA, its GC bin): correct predictions, predictions made.
        keys = ["digit_position"] + (["gc_position"] if self.dna_config is not None else [])
        hits = torch.zeros(len(keys), 2, dtype=torch.float64)
        positions = None if update else torch.stack([batch[k] for k in keys], dim=1)
        self._training = update
        self._batch_size = size
        self._dna_losses: list[torch.Tensor] = []
        edge_states = {key: end.state_dict() for key, end in self.edge_ends().items()} if update else {}
        if update:
            self._begin_edges(micro, batch.get("index"))
        if self.graph_pipeline:
            losses = self._graph_schedule(images, tokens, labels, positions, hits, micro, shape, supervised)
        else:
            losses = self._phased_schedule(batch, positions, hits, micro, supervised)
        extra = {"dna_loss": self._world_dna_loss()} if self.dna_config is not None else {}
        if not update:
            return {"loss": self._world_loss(losses)} | extra | self._world_accuracy(hits)
        self.nonfinite = self._nonfinite_ranks(losses)
        if self.nonfinite:
            self.undo_step(edge_states)
            self.step += 1
            return {"loss": self._world_loss(losses), "grad_norm": math.nan, "stepped": 0.0} | extra
        grad_norm = sync_clip_and_step(list(self.placement.layouts), self.modules, self.grad_clip, self.step)
        stepped = math.isfinite(grad_norm)
        self.step += 1
        return {"loss": self._world_loss(losses), "grad_norm": grad_norm, "stepped": float(stepped)} | extra

    def edge_ends(self) -> dict[str, EdgeEnd]:
        """This rank's ends of compressed edges (the vision->llm boundary, the LLM's stage edges)."""
        ends = {f"llm.{side}": end for side, end in self.llm_edges.items()}
        if self.compressed_boundary is not None:
            ends["vision->llm.upstream"] = self.compressed_boundary.upstream
            ends["vision->llm.downstream"] = self.compressed_boundary.downstream
        return ends

    def _nonfinite_ranks(self, losses: list[torch.Tensor]) -> dict[str, list[int]]:
        bad_loss = any(not bool(torch.isfinite(local_tensor(loss)).all()) for loss in losses)
        return nonfinite_modules(list(self.placement.layouts), self.modules, {"llm": bad_loss})

    def _begin_edges(self, micro: int, sample_ids: torch.Tensor | None) -> None:
        """Tell every compressed edge end this step's rows (global-batch positions) and whether the batch
        is fresh; ``sample_ids`` (the batch's ``index``) key the per-sample compensation."""
        fresh = self.step % self.sample_reuse == 0

        def rows(name: str) -> list[torch.Tensor]:
            module = self.modules.get(name)
            if module is None:
                return []
            local = module.rows(micro)
            return [torch.arange(local.start, local.stop) + m * micro for m in range(self.num_microbatches)]

        if self.compressed_boundary is not None:
            self.compressed_boundary.begin_step(rows("vision"), rows("llm"), fresh, sample_ids)
        for end in self.llm_edges.values():
            end.begin_step(rows("llm"), fresh, sample_ids)

    def _boundary_edge(self) -> CompressedBoundary | None:
        """The compressed boundary when this pass sends through it (training steps), else None."""
        return self.compressed_boundary if self._training else None

    def _graph_schedule(self, images, tokens, labels, positions, hits, micro, shape, supervised):
        """One pipeline over the graph: the encoder as stage 0, then the LLM's stages."""
        vision, llm = self.modules.get("vision"), self.modules.get("llm")
        stages = 1 + self.placement.layouts["llm"].pp
        if vision is not None:
            rows = vision.rows(micro)
            inputs = [images[m * micro : (m + 1) * micro][rows] for m in range(self.num_microbatches)]
            edge = self._boundary_edge()
            link = edge.sender_link(shape) if edge is not None else BoundarySender(self.boundary, shape)
            transport = LinkedTransport(None, link)
            run_pipeline(
                PipelineStage(vision.model, 0, stages, transport),
                self.placement_schedule(),
                self.num_microbatches,
                inputs,
                None,
                _no_loss,
            )
            return []
        assert llm is not None
        return self._llm_schedule(llm, None, tokens, labels, positions, hits, micro, supervised, shape)[0]

    def placement_schedule(self) -> str:
        """The graph pipeline runs the LLM's schedule on every stage, the encoder's included."""
        return self.setups["llm"].options.pipeline_schedule

    def _encoder_shape(self, name: str, micro: int) -> tuple[int, int, int]:
        """A microbatch's embeddings from encoder ``name`` as the LLM takes them."""
        if name == "vision":
            return (micro, self.vision_config.num_patches, self.vision_config.out_size)
        assert self.dna_config is not None
        return (micro, self.dna_config.max_tokens(), self.dna_config.out_size)

    def _encode(self, name: str, module: ModuleRuntime, batch: dict, span: slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder ``name``'s embeddings of this rank's rows of a microbatch, and its own loss (GeneZip's
        next-base and ratio losses, a sum over its rows divided by the global batch size) or None."""
        rows = module.rows(span.stop - span.start)
        if name == "vision":
            return module.model(batch["images"][span][rows]), None
        assert self.dna_config is not None
        bases, regions = batch["dna"][span][rows], batch["dna_regions"][span][rows]
        output = module.model(bases)
        tokens = padded_tokens(output, self.dna_config)
        loss = genezip_loss(self.dna_config, output, bases, regions).total(self.dna_config).sum() / self._batch_size
        self._dna_losses.append(loss.detach())
        return tokens, loss

    def _phased_schedule(self, batch, positions, hits, micro, supervised):
        count = self.num_microbatches
        spans = [slice(m * micro, (m + 1) * micro) for m in range(count)]
        outputs = {
            name: [self._encode(name, self.modules[name], batch, span) for span in spans]
            for name in self.encoders
            if name in self.modules
        }
        edge = self._boundary_edge()  # compresses the vision->llm edge in training steps
        delivered, transfers = {}, {}
        for name in self.encoders:
            shape = self._encoder_shape(name, micro)
            sent = [outputs[name][m][0].detach() if name in outputs else None for m in range(count)]
            if name == "vision" and edge is not None:
                delivered[name] = [edge.forward(m, sent[m], shape) for m in range(count)]
            else:
                transfers[name] = [self.boundaries[name].forward(sent[m], shape) for m in range(count)]
                delivered[name] = [t.output for t in transfers[name]]
        llm = self.modules.get("llm")
        grads: list[list[torch.Tensor | None]] = [[None] * len(self.encoders)] * count
        losses: list[torch.Tensor] = []
        if llm is not None:
            per_microbatch = [[delivered[name][m] for name in self.encoders] for m in range(count)]
            losses, grads = self._llm_schedule(
                llm, per_microbatch, batch["tokens"], batch["labels"], positions, hits, micro, supervised,
                self._encoder_shape("vision", micro),
            )
        for e, name in enumerate(self.encoders):
            for m in range(count):
                if name == "vision" and edge is not None:
                    grad = edge.backward(m, grads[m][e], self._encoder_shape(name, micro))
                else:
                    grad = self.boundaries[name].backward(transfers[name][m], grads[m][e])
                if name in outputs:
                    embeddings, own_loss = outputs[name][m]
                    if own_loss is None:
                        embeddings.backward(grad)
                    else:
                        torch.autograd.backward([embeddings, own_loss], [grad, torch.ones_like(own_loss)])
        return losses

    def _llm_schedule(
        self,
        llm: ModuleRuntime,
        delivered: list | None,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None,
        hits: torch.Tensor,
        micro: int,
        supervised: int,
        shape: tuple[int, ...],
    ) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
        """The LLM's part of a step: its losses, and per microbatch the gradients of every encoder's
        embeddings. ``delivered`` holds, per microbatch, each encoder's embeddings already delivered
        (phased schedule); None means the image embeddings arrive through the graph pipeline's link."""
        rows = llm.rows(micro)
        layout, coord = llm.mesh.layout, llm.mesh.coord
        first, last = llm.mesh.is_first_stage, llm.mesh.is_last_stage
        graph = delivered is None
        spans = [slice(m * micro, (m + 1) * micro) for m in range(self.num_microbatches)]
        received = []
        inputs: list = []
        if first and not graph:
            for m, span in enumerate(spans):
                embeds = [e.detach().requires_grad_() for e in delivered[m]]  # type: ignore[index]
                received.append(embeds)
                inputs.append((tokens[span][rows], embeds))
        targets = [(labels[span][rows], None if positions is None else positions[span][rows]) for span in spans]
        model = llm.model
        # In the graph pipeline the first LLM stage receives only the embeddings; forwards run in
        # microbatch order in every schedule, so the token ids are taken in that order.
        graph_tokens = iter([tokens[span][rows] for span in spans])

        def stage(x):
            if isinstance(x, tuple):  # phased: token ids plus this microbatch's embeddings of every encoder
                ids, embeds = x
                return model(merge_image_embeddings(model.tok_embeddings(ids), torch.cat(embeds, dim=1)))
            if graph and first:
                return model(merge_image_embeddings(model.tok_embeddings(next(graph_tokens)), x))
            return model(x)

        def loss_fn(logits: torch.Tensor, target: tuple) -> torch.Tensor:
            target_labels, evaluated = target
            if evaluated is not None:
                full = logits.full_tensor() if isinstance(logits, DTensor) else logits  # TP-collective
                rows = torch.arange(full.shape[0])
                for k in range(evaluated.shape[1]):
                    predicted = full[rows, evaluated[:, k]].argmax(-1)
                    hits[k, 0] += (predicted == target_labels[rows, evaluated[:, k]]).sum()
                    hits[k, 1] += full.shape[0]
            return token_loss_sum(logits, target_labels) / supervised

        parallel_loss = loss_parallel() if layout.tp > 1 else contextlib.nullcontext()
        with parallel_loss:
            if layout.pp > 1 or graph:
                offset = 1 if graph else 0  # the encoder is stage 0 of the graph pipeline
                activation = (rows.stop - rows.start, tokens.shape[1], self.llm_config.hidden_size)
                edges = self.llm_edges if self._training else {}
                edge = self._boundary_edge()
                prev_link, next_link = stage_links(llm.mesh, activation, edges)
                if graph and coord.pp == 0:
                    prev_link = edge.receiver_link(shape) if edge is not None else BoundaryReceiver(self.boundary, shape)
                losses = run_pipeline(
                    PipelineStage(CallableStage(stage), offset + coord.pp, offset + layout.pp,
                                  LinkedTransport(prev_link, next_link)),
                    llm.setup.options.pipeline_schedule,
                    self.num_microbatches,
                    inputs if first and not graph else None,
                    targets if last else None,
                    loss_fn,
                )
                for link in (prev_link, next_link) if self._training else ():
                    for direction, sent in getattr(link, "sent_bytes", {}).items():
                        self.pipeline_bytes[direction] += sent
            else:
                losses = []
                for x, y in zip(inputs, targets):
                    loss = loss_fn(stage(x), y)
                    loss.backward()
                    losses.append(loss.detach())
        # Under TP every replica of the LLM's first stage already holds the full gradient of the image
        # embeddings (the column-parallel layers all-reduce it); the boundary sums destination replicas,
        # so each hands in its share (BoundaryReceiver does the same in the graph pipeline). The
        # compressed boundary copies instead of summing and takes the full gradient.
        shares = [1 if name == "vision" and self._boundary_edge() is not None else layout.tp for name in self.encoders]
        grads = [
            [e.grad / share if e.grad is not None else torch.zeros_like(e) for e, share in zip(embeds, shares)]
            for embeds in received
        ]
        return losses, grads or [[None] * len(self.encoders)] * self.num_microbatches

    def _world_accuracy(self, hits: torch.Tensor) -> dict[str, float]:
        llm = self.modules.get("llm")
        if llm is None or not llm.mesh.is_last_stage or llm.mesh.coord.tp != 0:
            hits = torch.zeros_like(hits)  # one reporter per LLM data-parallel replica
        dist.all_reduce(hits)
        result = {"accuracy": float(hits[0, 0] / hits[0, 1]), "evaluated": float(hits[0, 1])}
        if len(hits) > 1:
            result["gc_accuracy"] = float(hits[1, 0] / hits[1, 1])
        return result

    def _world_dna_loss(self) -> float:
        """GeneZip's own loss over the global batch (next-base plus ratio), known on every rank."""
        total = torch.zeros((), dtype=torch.float64)
        dna = self.modules.get("dna")
        if dna is not None and dna.mesh.coord.tp == 0:  # one reporter per DNA data-parallel replica
            total += sum(loss.double() for loss in self._dna_losses)
        dist.all_reduce(total)
        return float(total)

    def _world_loss(self, losses: list[torch.Tensor]) -> float:
        """The global mean loss, known on every rank: LLM last-stage ranks of tp coordinate 0 sum theirs."""
        total = torch.zeros((), dtype=torch.float64)
        llm = self.modules.get("llm")
        if llm is not None and llm.mesh.is_last_stage:
            # full_tensor() is a TP collective: every TP rank takes part, one of them reports.
            values = [(loss.full_tensor() if isinstance(loss, DTensor) else loss).double() for loss in losses]
            if llm.mesh.coord.tp == 0:
                total += sum(values, torch.zeros((), dtype=torch.float64))
        dist.all_reduce(total)
        return float(total)


def _no_loss(output: torch.Tensor, target: object) -> torch.Tensor:
    raise AssertionError("the encoder is never the last stage of the graph pipeline")


def _image_sharding() -> Sharding:
    """Image embeddings (batch, patches, hidden): batch split over DP, patches whole on every rank."""
    return Sharding(batch_dim=0, seq_dim=None)
