"""Train one GPT under one module layout: the LLM training step every later trainer builds on.

Every rank receives the same global batch (tokens and labels, batch × seq) and takes its own part: the
rows of its DP coordinate, the zigzag sequence chunks of its CP coordinate, split into microbatches of
``micro_batch_size``. Each microbatch's loss is its token-loss sum divided by the global token count, so
summing gradients over dp×cp gives exactly the gradient of the global mean loss.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hetero.errors import ConfigError
from hetero.kinds.gpt.model import GPT, token_loss_sum
from hetero.kinds.gpt.config import GPTConfig
from hetero.kinds.gpt.plan import parallelize_gpt
from hetero.parallel.context import split_for_cp, zigzag_indices
from hetero.parallel.compression.collective import Collective
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions
from hetero.parallel.boundary_transport import LinkedTransport
from hetero.parallel.compressed_p2p import CompressedNextLink, CompressedPreviousLink
from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.pipeline import P2PTransport, PipelineStage, run_pipeline
from hetero.parallel.replica_sync import ReplicaSync
from hetero.train.optim import OptimizerConfig, build_adamw


class StageForward(nn.Module):
    """The model's forward at fixed positions and precision: what a pipeline stage runs per microbatch."""

    def __init__(self, model: GPT, positions: torch.Tensor, precision: str):
        super().__init__()
        self.model = model
        self.positions = positions
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = "cuda" if x.is_cuda else "cpu"
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            return self.model(x, self.positions)


class LMTrainer:
    def __init__(
        self,
        config: GPTConfig,
        mesh: ModuleMesh | None,
        *,
        micro_batch_size: int,
        options: ParallelOptions | None = None,
        optimizer: OptimizerConfig | None = None,
        compression: CompressionConfig | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
        outer_comm: Collective | None = None,
        sample_reuse: int = 1,
    ):
        """``sample_reuse``: the caller serves each batch for this many consecutive steps (lazy sampling),
        which the ``lazy`` compensation of compressed pipeline edges relies on."""
        self.config = config
        self.mesh = mesh
        self.options = options or ParallelOptions()
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        name = mesh.name if mesh is not None else "llm"
        errors = self.options.errors(name)
        if mesh is not None:
            errors += config.errors(name, mesh.layout, self.options)
        if compression is not None:
            errors += compression.errors(name, self._degree("cp"), self.options.fsdp)
            errors += compression.pipeline.errors(f"{name}.compression.pipeline", sample_reuse, config.hidden_size)
        if errors:
            raise ConfigError("\n".join(errors))
        torch.manual_seed(seed)  # every rank builds the same full model, then keeps its shard
        model = GPT(config).to(self.device)
        self.model = parallelize_gpt(model, mesh, self.options) if mesh is not None else model
        opt = self.optimizer_config = optimizer or OptimizerConfig()
        self.step = 0
        self.optimizer = build_adamw(self.model, opt)
        self.replicas = 1 if mesh is None else mesh.layout.dp * mesh.layout.cp
        self.replica_sync = ReplicaSync(self.model, mesh, self.options, compression, seed, outer_comm)
        self.sample_reuse = sample_reuse
        self.pipeline_bytes = {"forward": 0, "backward": 0}  # sent by this rank to its stage neighbours
        self.edges: dict[str, EdgeEnd] = {}  # "previous"/"next": this rank's ends of compressed stage edges
        edge = compression.pipeline if compression is not None else None
        if edge is not None and edge.enabled and self._degree("pp") > 1:
            assert mesh is not None
            if not mesh.is_first_stage:
                self.edges["previous"] = EdgeEnd(edge, "downstream", f"{name} stage edge")
            if not mesh.is_last_stage:
                self.edges["next"] = EdgeEnd(edge, "upstream", f"{name} stage edge")

    def _degree(self, axis: str) -> int:
        return 1 if self.mesh is None else getattr(self.mesh.layout, axis)

    def _coord(self, axis: str) -> int:
        return 0 if self.mesh is None else getattr(self.mesh.coord, axis)

    def local_batch(self, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows (DP) and sequence chunks (CP) of the global batch."""
        dp, cp = self._degree("dp"), self._degree("cp")
        rows = tokens.shape[0] // dp
        start = self._coord("dp") * rows
        tokens, labels = tokens[start : start + rows], labels[start : start + rows]
        if cp > 1:
            tokens = split_for_cp(tokens, 1, cp, self._coord("cp"))
            labels = split_for_cp(labels, 1, cp, self._coord("cp"))
        return tokens.to(self.device), labels.to(self.device)

    def positions(self, seq_len: int) -> torch.Tensor:
        cp = self._degree("cp")
        if cp > 1:
            return zigzag_indices(seq_len, cp, self._coord("cp"), device=self.device)
        return torch.arange(seq_len, device=self.device)

    def train_step(
        self, tokens: torch.Tensor, labels: torch.Tensor, sample_ids: torch.Tensor | None = None
    ) -> float:
        """One optimizer step on the global batch; returns the global mean token loss (nats).

        ``sample_ids`` (one per row) key the ``per_sample`` compensation of compressed stage edges."""
        global_tokens = tokens.numel()
        local_tokens, local_labels = self.local_batch(tokens, labels)
        inputs = list(local_tokens.split(self.micro_batch_size))
        targets = list(local_labels.split(self.micro_batch_size))
        if self.edges:
            rows = tokens.shape[0] // self._degree("dp")
            local_rows = torch.arange(rows) + self._coord("dp") * rows
            for end in self.edges.values():
                end.begin_step(list(local_rows.split(self.micro_batch_size)),
                               self.step % self.sample_reuse == 0, sample_ids)
        stage_forward = StageForward(self.model, self.positions(tokens.shape[1]), self.options.precision)

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return token_loss_sum(logits, target) / global_tokens

        self.optimizer.zero_grad(set_to_none=True)
        parallel_loss = loss_parallel() if self._degree("tp") > 1 else contextlib.nullcontext()
        with parallel_loss:
            if self._degree("pp") > 1:
                stage = self._pipeline_stage(stage_forward, local_tokens.shape[1])
                losses = run_pipeline(
                    stage,
                    self.options.pipeline_schedule,
                    len(inputs),
                    inputs if self.mesh.is_first_stage else None,  # type: ignore[union-attr]
                    targets if self.mesh.is_last_stage else None,  # type: ignore[union-attr]
                    loss_fn,
                )
                for link in (stage.transport.prev, stage.transport.next):  # type: ignore[attr-defined]
                    for direction, sent in (link.sent_bytes.items() if link is not None else ()):
                        self.pipeline_bytes[direction] += sent
            else:
                losses = []
                for i, (x, y) in enumerate(zip(inputs, targets)):
                    if self.options.fsdp:  # reduce-scatter gradients once, after the last microbatch
                        self.model.set_requires_gradient_sync(i == len(inputs) - 1)  # type: ignore[operator]
                    loss = loss_fn(stage_forward(x), y)
                    loss.backward()
                    losses.append(loss.detach())
        self.replica_sync.before_step()
        for group in self.optimizer.param_groups:
            group["lr"] = self.optimizer_config.lr_at(self.step)
        self.optimizer.step()
        self.replica_sync.after_step()
        self.step += 1
        return self._global_loss(losses)

    def state_dict(self) -> dict:
        """Everything a resumed run needs on this rank: weights, optimizer, step, replica-sync buffers and
        the compensation state of compressed stage edges."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "replica_sync": self.replica_sync.state_dict(),
            "edges": {side: end.state_dict() for side, end in self.edges.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.replica_sync.load_state_dict(state["replica_sync"])
        for side, end in self.edges.items():
            end.load_state_dict(state["edges"][side])

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """Mean token loss on a batch without updating anything. Stages exchange uncompressed fp32: this
        measures the weights, not the edges' codecs."""
        local_tokens, local_labels = self.local_batch(tokens, labels)
        forward = StageForward(self.model, self.positions(tokens.shape[1]), self.options.precision)
        parallel_loss = loss_parallel() if self._degree("tp") > 1 else contextlib.nullcontext()
        losses = []
        with parallel_loss:
            if self._degree("pp") == 1:
                losses.append(token_loss_sum(forward(local_tokens), local_labels) / tokens.numel())
            else:
                transport = self._pipeline_stage(forward, local_tokens.shape[1], compressed=False).transport
                for x, y in zip(local_tokens.split(self.micro_batch_size), local_labels.split(self.micro_batch_size)):
                    out = forward(x if self.mesh.is_first_stage else transport.recv_forward(0))  # type: ignore[union-attr]
                    if self.mesh.is_last_stage:  # type: ignore[union-attr]
                        losses.append(token_loss_sum(out, y) / tokens.numel())
                    else:
                        transport.send_forward(0, out)
                transport.finish()
        return self._global_loss(losses)

    def _pipeline_stage(self, stage_forward: StageForward, local_seq: int, compressed: bool = True) -> PipelineStage:
        assert self.mesh is not None
        layout, coord = self.mesh.layout, self.mesh.coord
        seq = local_seq // layout.tp if self.options.sequence_parallel and layout.tp > 1 else local_seq
        prev_rank = layout.rank_at(coord._replace(pp=coord.pp - 1)) if coord.pp > 0 else None
        next_rank = layout.rank_at(coord._replace(pp=coord.pp + 1)) if coord.pp < layout.pp - 1 else None
        # The residual stream stays fp32 under bf16 autocast, so stages exchange fp32 activations.
        shape = (self.micro_batch_size, seq, self.config.hidden_size)
        links = []
        for peer, side in ((prev_rank, "previous"), (next_rank, "next")):
            end = self.edges.get(side) if compressed else None
            if peer is None:
                links.append(None)
            elif end is None:
                ranks = (peer, None) if side == "previous" else (None, peer)
                links.append(P2PTransport(*ranks, shape, torch.float32, device=self.device))
            elif side == "previous":
                links.append(CompressedPreviousLink(peer, shape, end, device=self.device))
            else:
                links.append(CompressedNextLink(peer, shape, end, device=self.device))
        return PipelineStage(stage_forward, coord.pp, layout.pp, LinkedTransport(*links))

    def _global_loss(self, losses: list[torch.Tensor]) -> float:
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.full_tensor() if isinstance(loss, DTensor) else loss
        if self.mesh is None:
            return total.item()
        if self.replicas > 1:
            dist.all_reduce(total, group=self.mesh.group("dp_cp"))
        if self.mesh.layout.pp > 1:
            last = self.mesh.group_ranks["pp"][-1]
            dist.broadcast(total, src=last, group=self.mesh.group("pp"))
        return total.item()
