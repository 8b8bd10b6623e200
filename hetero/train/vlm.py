"""Train a vision encoder and an LLM, each under its own layout, joined by a boundary communicator.

One step, on every rank, in one order (DESIGN §4), for colocated, non-colocated and mixed placements:

1. vision ranks: encoder forward for every microbatch (graphs kept);
2. every rank: the boundary moves each microbatch's image embeddings into the LLM's layout;
3. LLM ranks: the LLM's schedule (a loop, or GPipe/1F1B over its pipeline stages), image embeddings
   entering at its first stage;
4. every rank: the boundary routes the image-embedding gradients back, microbatch by microbatch;
5. vision ranks: encoder backward;
6. gradient sync per module (deferred until every backward is done), one gradient-norm clip agreed
   across the world, and each module's optimizer step — or a skipped step everywhere if any gradient
   is not finite.

Boundary calls come in the same order on both sides (all forwards, then all backwards), so they pair
without depending on buffered sends. Each microbatch loss is a token-loss sum divided by the global
count of supervised tokens, so gradients summed over each module's replicas are exact whatever the
modules' DP degrees. Every rank receives the same global batch and takes its own rows.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from hetero.data.digits import dp_rows
from hetero.errors import ConfigError
from hetero.models.gpt import GPT, GPTConfig, token_loss_sum
from hetero.models.gpt_parallelize import parallelize_gpt
from hetero.models.multimodal import merge_image_embeddings
from hetero.models.vision import VisionEncoder, ViTConfig
from hetero.models.vision_parallelize import parallelize_vision
from hetero.parallel.boundary import Boundary, Side, TensorSpec
from hetero.parallel.boundary_plan import Sharding
from hetero.parallel.data import AllReduceGradSync, local_grad
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions
from hetero.parallel.pipeline import P2PTransport, PipelineStage, run_pipeline
from hetero.parallel.placement import Placement
from hetero.train.optim import OptimizerConfig, build_adamw


@dataclass
class ModuleSetup:
    """What the trainer needs to know about one module besides its mesh."""

    options: ParallelOptions
    optimizer: OptimizerConfig


class ModuleRuntime:
    """One module on this rank: its parallelized model, optimizer and gradient sync."""

    def __init__(self, name: str, model: nn.Module, mesh: ModuleMesh, setup: ModuleSetup):
        self.name, self.model, self.mesh, self.setup = name, model, mesh, setup
        self.optimizer = build_adamw(model, setup.optimizer)
        replicas = mesh.layout.dp * mesh.layout.cp
        self.grad_sync = (
            AllReduceGradSync(mesh.group("dp_cp"), int(setup.options.grad_bucket_mb * 2**20))
            if replicas > 1 and not setup.options.fsdp
            else None
        )

    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous rows of a microbatch (by the module's own DP coordinate)."""
        return dp_rows(batch_size, self.mesh.coord.dp, self.mesh.layout.dp)

    def squared_grad_norm(self) -> torch.Tensor:
        """Sum of squared gradients of the whole module, each element counted once, on every rank of it."""
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for param in self.model.parameters():
            grad = local_grad(param)
            if grad is None:
                continue
            value = grad.double().pow(2).sum()
            placements = param.grad.placements if isinstance(param.grad, DTensor) else ()
            if any(isinstance(p, Shard) for p in placements):
                sharded += value
            else:
                replicated += value
        if self.mesh.layout.tp > 1:
            dist.all_reduce(sharded, group=self.mesh.group("tp"))
        total = sharded + replicated
        if self.setup.options.fsdp and self.mesh.layout.dp * self.mesh.layout.cp > 1:
            dist.all_reduce(total, group=self.mesh.group("dp_cp"))  # FSDP shards over dp×cp
        if self.mesh.layout.pp > 1:
            dist.all_reduce(total, group=self.mesh.group("pp"))
        return total

    def scale_grads(self, factor: float) -> None:
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)


class VLMTrainer:
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
    ):
        for name in ("vision", "llm"):
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
        self.vision_config, self.llm_config = vision_config, llm_config
        self.num_microbatches = num_microbatches
        self.grad_clip = grad_clip
        self.step = 0
        self.modules: dict[str, ModuleRuntime] = {}
        if "vision" in meshes:
            torch.manual_seed(seed)  # the same seeds as the single-process VisionLanguageModel
            model = parallelize_vision(VisionEncoder(vision_config), meshes["vision"], setups["vision"].options)
            self.modules["vision"] = ModuleRuntime("vision", model, meshes["vision"], setups["vision"])
        if "llm" in meshes:
            torch.manual_seed(seed + 1)
            model = parallelize_gpt(GPT(llm_config), meshes["llm"], setups["llm"].options)
            self.modules["llm"] = ModuleRuntime("llm", model, meshes["llm"], setups["llm"])
        # Built on every rank, in the same order, whether or not this rank takes part.
        self.boundary = Boundary(
            "vision->llm",
            Side(placement.layouts["vision"]),
            Side(llm_layout),
            TensorSpec(ndim=3, source=_image_sharding(), destination=_image_sharding()),
            timeout_s=timeout_s,
        )

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

        vision = self.modules.get("vision")
        image_out = []
        if vision is not None:
            for m in range(self.num_microbatches):
                rows = vision.rows(micro)
                image_out.append(vision.model(images[m * micro : (m + 1) * micro][rows]))
        transfers = [
            self.boundary.forward(image_out[m].detach() if image_out else None, shape)
            for m in range(self.num_microbatches)
        ]
        llm = self.modules.get("llm")
        image_grads: list[torch.Tensor | None] = [None] * self.num_microbatches
        losses: list[torch.Tensor] = []
        hits = torch.zeros(2, dtype=torch.float64)  # correct digit predictions, predictions made
        positions = None if update else batch["digit_position"]
        if llm is not None:
            losses, image_grads = self._llm_schedule(
                llm, transfers, tokens, labels, positions, hits, micro, supervised
            )
        for m in range(self.num_microbatches):
            grad = self.boundary.backward(transfers[m], image_grads[m])
            if vision is not None:
                image_out[m].backward(grad)

        if not update:
            return {"loss": self._world_loss(losses)} | self._world_accuracy(hits)
        for module in self.modules.values():
            if module.grad_sync is not None:
                module.grad_sync.sync(module.model.parameters())
        grad_norm = self._clip_world_wide()
        stepped = math.isfinite(grad_norm)
        if stepped:
            for module in self.modules.values():
                for group in module.optimizer.param_groups:
                    group["lr"] = module.setup.optimizer.lr_at(self.step)
                module.optimizer.step()
        self.step += 1
        return {"loss": self._world_loss(losses), "grad_norm": grad_norm, "stepped": float(stepped)}

    def _llm_schedule(
        self,
        llm: ModuleRuntime,
        transfers: list,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor | None,
        hits: torch.Tensor,
        micro: int,
        supervised: int,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        rows = llm.rows(micro)
        first, last = llm.mesh.is_first_stage, llm.mesh.is_last_stage
        received = []
        inputs, targets = [], []
        for m in range(self.num_microbatches):
            span = slice(m * micro, (m + 1) * micro)
            embeds = None
            if first:
                embeds = transfers[m].output.detach().requires_grad_()
                received.append(embeds)
            inputs.append((tokens[span][rows], embeds))
            targets.append((labels[span][rows], None if positions is None else positions[span][rows]))
        model = llm.model

        def stage(x):
            if isinstance(x, tuple):  # the first stage: token ids plus this microbatch's image embeddings
                ids, embeds = x
                return model(merge_image_embeddings(model.tok_embeddings(ids), embeds))
            return model(x)

        def loss_fn(logits: torch.Tensor, target: tuple) -> torch.Tensor:
            target_labels, digit_positions = target
            if digit_positions is not None:
                full = logits.full_tensor() if isinstance(logits, DTensor) else logits  # TP-collective
                rows = torch.arange(full.shape[0])
                predicted = full[rows, digit_positions].argmax(-1)
                hits[0] += (predicted == target_labels[rows, digit_positions]).sum()
                hits[1] += full.shape[0]
            return token_loss_sum(logits, target_labels) / supervised

        parallel_loss = loss_parallel() if llm.mesh.layout.tp > 1 else contextlib.nullcontext()
        with parallel_loss:
            if llm.mesh.layout.pp > 1:
                layout, coord = llm.mesh.layout, llm.mesh.coord
                prev_rank = layout.rank_at(coord._replace(pp=coord.pp - 1)) if coord.pp > 0 else None
                next_rank = layout.rank_at(coord._replace(pp=coord.pp + 1)) if not last else None
                local_rows = rows.stop - rows.start
                transport = P2PTransport(
                    prev_rank, next_rank, (local_rows, tokens.shape[1], self.llm_config.hidden_size), torch.float32
                )
                losses = run_pipeline(
                    PipelineStage(_Callable(stage), coord.pp, layout.pp, transport),
                    llm.setup.options.pipeline_schedule,
                    self.num_microbatches,
                    inputs if first else None,
                    targets if last else None,
                    loss_fn,
                )
            else:
                losses = []
                for x, y in zip(inputs, targets):
                    loss = loss_fn(stage(x), y)
                    loss.backward()
                    losses.append(loss.detach())
        # Under TP every replica of the LLM's first stage already holds the full gradient of the image
        # embeddings (the column-parallel layers all-reduce it); the boundary sums destination replicas,
        # so each hands in its share.
        tp = llm.mesh.layout.tp
        grads = [e.grad / tp if e.grad is not None else torch.zeros_like(e) for e in received] if first else []
        return losses, grads or [None] * self.num_microbatches

    def _clip_world_wide(self) -> float:
        """Global gradient norm over every module, agreed by every rank; clip when it exceeds the limit."""
        names = list(self.placement.layouts)
        squares = torch.zeros(len(names), dtype=torch.float64)
        for i, name in enumerate(names):
            if name in self.modules:
                squares[i] = self.modules[name].squared_grad_norm()
        # Every rank of a module holds the same value and the others hold 0: MAX agrees world-wide.
        nonfinite = (~torch.isfinite(squares)).to(torch.float64)
        squares = torch.nan_to_num(squares, nan=0.0, posinf=0.0)
        dist.all_reduce(squares, op=dist.ReduceOp.MAX)
        dist.all_reduce(nonfinite, op=dist.ReduceOp.MAX)
        if nonfinite.any():
            return math.inf
        norm = math.sqrt(float(squares.sum()))
        if self.grad_clip > 0 and norm > self.grad_clip:
            factor = self.grad_clip / (norm + 1e-6)
            for module in self.modules.values():
                module.scale_grads(factor)
        return norm

    def _world_accuracy(self, hits: torch.Tensor) -> dict[str, float]:
        llm = self.modules.get("llm")
        if llm is None or not llm.mesh.is_last_stage or llm.mesh.coord.tp != 0:
            hits = torch.zeros_like(hits)  # one reporter per LLM data-parallel replica
        dist.all_reduce(hits)
        return {"accuracy": float(hits[0] / hits[1]), "evaluated": float(hits[1])}

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


class _Callable(nn.Module):
    """A function as the module of a pipeline stage."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _image_sharding() -> Sharding:
    """Image embeddings (batch, patches, hidden): batch split over DP, patches whole on every rank."""
    return Sharding(batch_dim=0, seq_dim=None)
