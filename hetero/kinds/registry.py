"""Module kinds and the registry a graph's ``kind:`` names are looked up in.

A kind is what the runtime needs to train a module of it, whatever graph it sits in:

- ``config``: the dataclass of its ``model:`` block; its ``errors(module, layout, options)`` lists what a
  layout cannot run;
- ``build(config)``: the pure ``nn.Module``; ``parallelize(model, mesh, options)``: its plan (TP, CP,
  the pipeline stage's part, checkpointing, FSDP2);
- ``modality``: the presence flag (``has_<modality>`` in a batch) of the rows it processes, or None for
  every row; ``data_keys``: the batch columns it reads (``optional_keys``: more, when a batch has them;
  ``evaluation_keys``: more, in evaluation); ``columns(config)``: what they must look like (shapes and the
  fields that fix them, dtypes, id ranges; ``columns.py``), which ``batch_errors`` checks on every rank
  before a step (kinds add checks of their own there);
- ``inputs`` / ``outputs``: the tensors it consumes from and produces for other modules (``Port``);
- ``stage(model, step)``: one microbatch on this rank's pipeline stage (``StageStep`` in,
  ``StageResult`` out): the activation for the next stage, or on the last stage its outputs, its loss
  as sums over the rows it holds, and in evaluation its metrics;
- ``loss_count(batch, rows)``: the global divisor of those sums (rows, or supervised tokens);
- ``expert_parallel(config)``: whether it has experts, so its layout may take ``ep`` > 1 (experts split
  over DP replicas); ``expert_weights(model)``: their parameters; ``routing_shape(config)`` and
  ``take_routing(model)``: the per-layer routing counts the job reports (expert load, drops);
  ``counts_dispatch(config, layout)`` and ``dispatch_bytes(model)``: the bytes its expert dispatch hands
  to other ranks (the ``all_to_all.<module>`` communicator);
- ``forward_flops(config)``: the model FLOPs of one sample's forward by the kind's closed form (MFU's
  figure, ``hetero.kinds.flops``), or None where it has none.

The contract's packages (kinds, graph, parallel, runtime, data, train, interop) never import the kinds
themselves (``hetero.models``): the registry is assembled at the entry points (``hetero.cli``, the rank
entry ``hetero.train.run``, benchmarks, tests) and passed down, and everything a job needs of a kind comes
through its ``Kind``.

User code registers its own kinds the same way (``registry.register(MyKind())``), or ships them as an
entry point in the group ``hetero.kinds`` that ``default_registry()`` loads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterable

import torch
from torch import nn

from hetero.errors import ConfigError
from hetero.kinds.batch_rows import take_rows
from hetero.kinds.columns import Column, column_errors
from hetero.parallel.layout import Layout
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions

ENTRY_POINT_GROUP = "hetero.kinds"


@dataclass(frozen=True)
class Port:
    """A tensor that crosses an edge, per row: ``(tokens, width)``.

    An input with ``placeholders`` takes embeddings into placeholder positions of the module's sequence
    (``tokens`` long): any number of edges may feed it, each at its own offset, and rows without the
    modality keep the placeholders. Without, the input is the module's condition: one edge, on every row
    it processes; ``tokens`` None accepts any count.

    ``sequence``: the module lays the port's tokens out as its sequence, so under context parallelism a
    rank holds its zigzag chunks of them and under sequence parallelism its TP part of those (of the
    sequence the placeholders sit in, for an input with placeholders). A port without it is whole on
    every rank, and the module runs with cp=1 and without sequence parallelism where an edge uses it.
    """

    width: int
    tokens: int | None = None
    placeholders: bool = False
    field: str = ""  # the model field that sets the width (named in errors); an input of width 0 is off
    sequence: bool = False


@dataclass
class Arrival:
    """One edge's tensor on the destination's first stage: ``tensor`` (rows, tokens, width) holds the
    rows ``positions`` of the stage's microbatch (indices into its local rows); into placeholders, its
    tokens go to ``index`` of the rank's local sequence (this rank's share of them under CP or SP). A
    routed edge's ``tensor`` is (tokens, width), token ``t`` going to local row ``positions[t]`` at
    ``index[t]``."""

    port: str
    tensor: torch.Tensor
    positions: torch.Tensor
    index: torch.Tensor


@dataclass
class StageStep:
    """What a kind's ``stage`` gets for one microbatch on this rank."""

    config: Any
    mesh: ModuleMesh
    options: ParallelOptions
    device: torch.device
    data: dict[str, torch.Tensor]  # this replica's rows of the kind's data_keys (and evaluation_keys), on device
    host: dict[str, torch.Tensor]  # the same columns on the host, for what runs there (e.g. seeding by index)
    rows: torch.Tensor  # their indices in the global batch (host)
    inputs: list[Arrival]  # the first stage's arrivals from other modules, in edge order
    activation: torch.Tensor | None  # a later stage's input from the previous stage
    training: bool
    step: int  # the optimizer step (0-based)
    seed: int
    loss_count: int = 1  # the global divisor the runtime applies to ``StageResult.loss`` (``Kind.loss_count``)
    global_rows: int = 1  # the rows (or items) the module processes in the whole global batch


@dataclass
class Metric:
    """An evaluation figure as a world-wide reduction of per-rank parts: ``value / count`` summed over
    ranks (``mean``), or the smallest ``value`` (``min``)."""

    value: torch.Tensor
    count: torch.Tensor | None = None
    reduce: str = "mean"


@dataclass
class StageResult:
    activation: torch.Tensor | None = None  # to the next stage (every stage but the last)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # the last stage's, per port
    loss: torch.Tensor | None = None  # the last stage's loss: a sum over its rows
    # named terms of the loss, sums (over the global divisor) to report; any stage may hold some (each TP
    # group reports its own once), e.g. every stage's experts' auxiliary losses
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, Metric] = field(default_factory=dict)  # evaluation only


class ModelFields(dict):
    """A module's ``model:`` fields (name -> value) and which of them the command line set (``command_line``:
    the Hydra overrides ``load_experiment`` was given; None where that is unknown, as for an experiment built
    from a dict in code). Where a checkpoint gives the model's sizes (``init.hf``, ``init.checkpoint``), a field
    of the experiment YAML that disagrees gives way to the checkpoint's value; one the command line set (or,
    without ``command_line``, any one) is refused."""

    def __init__(self, fields: dict[str, Any], command_line: Iterable[str] | None = None):
        super().__init__(fields)
        self.command_line = None if command_line is None else frozenset(command_line)

    def stated(self, name: str) -> bool:
        """Whether field ``name`` must agree with the checkpoint (else it gives way to the checkpoint's value)."""
        return self.command_line is None or name in self.command_line


def disagreement(module: str, source: str, against: str, short: str, rows: list[tuple[str, Any, Any]],
                 command_line: bool) -> ConfigError:
    """One error naming every ``model:`` field that disagrees with the checkpoint of ``{module}.{source}``
    (``rows``: the field, its value, the checkpoint's; ``against``: what of the checkpoint gives the sizes,
    ``short``: its name in each row), with the fix."""
    one = len(rows) == 1
    who = "the command line" if command_line else f"{module}.model"
    fields = ", ".join(f"{module}.model.{name}={value!r} ({short}: {found!r})" for name, value, found in rows)
    if command_line:
        fix = "drop this override or set it to" if one else "drop these overrides or set each to"
    else:
        fix = "remove it or set it to" if one else "remove them or set each to"
    return ConfigError(f"{module}.{source} gives {module}'s sizes, and {who} disagrees with {against} on "
                       f"{len(rows)} field{'' if one else 's'}: {fields}; {fix} {short}'s value")


class Kind:
    """The base of every module kind (see the module docstring); subclass it and register an instance."""

    name: str = ""
    config: type = object
    modality: str | None = None

    def build(self, config: Any) -> nn.Module:
        raise NotImplementedError

    def parallelize(self, model: nn.Module, mesh: ModuleMesh, options: ParallelOptions) -> nn.Module:
        return model

    def pretrained_config(self, module: str, path: str, fields: dict[str, Any]) -> Any:
        """The model config of the Hugging Face checkpoint at ``path`` (``init.hf``), with the module's
        ``model:`` ``fields`` (those a checkpoint leaves open, such as the training length; a ``ModelFields``
        from ``ExperimentConfig.model_config``, which knows which of them the command line set)."""
        raise ConfigError(f"{module}.init.hf: {self.name} modules import no Hugging Face checkpoints; remove it")

    @staticmethod
    def check_given(module: str, config: Any, given: dict[str, Any], open_fields: set[str]) -> None:
        """Refuse the ``model:`` fields that disagree with the config read from ``init.hf``, all in one
        message (fields in ``open_fields`` are the module's to set; the checkpoint gives the others). Of a
        ``ModelFields``, only those the command line set are refused: the experiment YAML's give way to the
        checkpoint's values. Every field of a plain dict is the caller's own, so each that disagrees is refused."""
        rows = []
        for name, value in given.items():
            if name in open_fields:
                continue
            if not hasattr(config, name):
                raise ConfigError(f"{module}.model.{name} is not a field of {type(config).__name__}")
            if getattr(config, name) != value and (not isinstance(given, ModelFields) or given.stated(name)):
                rows.append((name, value, getattr(config, name)))
        if rows:
            raise disagreement(module, "init.hf", "its config.json", "config.json", rows,
                               isinstance(given, ModelFields) and given.command_line is not None)

    def hf_export(self, config: Any, source: Any) -> Any:
        """How to write a model of ``config`` as a Hugging Face checkpoint (a ``hetero.interop.hf_checkpoint.HFExport``);
        ``source``: the ``HFCheckpoint`` it was imported from, or None."""
        raise ConfigError(f"{self.name} modules export no Hugging Face checkpoints")

    def load_pretrained(self, model: nn.Module, path: str) -> int:
        """Fill ``model`` (parallelized, its weights allocated but not set) from the checkpoint, each rank
        reading only what it holds; the bytes read."""
        raise NotImplementedError

    def data_keys(self, config: Any) -> tuple[str, ...]:
        return ()

    def per_item(self, config: Any) -> bool:
        """Whether the module processes items (images, any number per row: the batch's ``image_*`` columns,
        ``image_row`` naming each one's row) rather than rows; its DP replicas then split them by
        ``item_costs``."""
        return False

    def item_costs(self, config: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(items,) host tensor: each item's work, for balancing the module's DP replicas."""
        raise NotImplementedError

    def item_tokens(self, config: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(items,) host tensor: each item's tokens in the output of a per-item module, which a routed edge
        takes to the item's placeholders (``image_start`` on in row ``image_row``)."""
        raise NotImplementedError(f"kind {self.name!r} gives no per-item token counts")

    def host_columns(self, config: Any, batch: dict[str, torch.Tensor], keys: Iterable[str],
                     local: torch.Tensor) -> dict[str, torch.Tensor]:
        """The columns ``keys`` of the rows (or items) ``local`` (global numbers) of ``batch``, on the host
        (``hetero.kinds.batch_rows``: a compact batch holds the rank's rows alone)."""
        return {key: take_rows(batch, key, local) for key in keys}

    def optional_keys(self, available: Iterable[str]) -> tuple[str, ...]:
        """Columns of ``available`` it also reads, when a batch has them (e.g. packed rows' documents)."""
        return ()

    def evaluation_keys(self, available: Iterable[str]) -> tuple[str, ...]:
        """Columns of ``available`` it also reads in evaluation, when a batch has them."""
        return ()

    def inputs(self, config: Any) -> dict[str, Port]:
        return {}

    def outputs(self, config: Any) -> dict[str, Port]:
        return {}

    def errors(self, module: str, config: Any, layout: Layout, options: ParallelOptions) -> list[str]:
        return config.errors(module, layout, options) if hasattr(config, "errors") else []

    def columns(self, config: Any) -> tuple[Column, ...]:
        """The batch columns it reads and what they must look like (``hetero.kinds.columns``); none
        declared: ``batch_errors`` checks nothing."""
        return ()

    def batch_errors(self, module: str, config: Any, batch: dict[str, torch.Tensor]) -> list[str]:
        """What in a global batch the model cannot take (e.g. a sequence length other than its own); every
        rank checks the same batch before its step, so all of them raise alike and none waits on another.
        The base checks the declared ``columns``; a kind with checks of its own calls it first (they may
        then rely on the shapes and dtypes)."""
        return column_errors(module, self.columns(config), batch)

    def has_loss(self, config: Any) -> bool:
        return True

    def expert_parallel(self, config: Any) -> bool:
        """Whether the module has experts, which ``layout.ep`` can split over replicas (its plan does it)."""
        return False

    def expert_weights(self, model: nn.Module) -> set[str]:
        """Names of the parameters whose gradients sum over the expert-data-parallel group (``mesh.py``)
        instead of dp×cp."""
        return set()

    def routing_shape(self, config: Any) -> tuple[int, int] | None:
        """(layers, experts) of the routing counts the module keeps (``take_routing``), or None where it
        routes no tokens to experts."""
        return None

    def take_routing(self, model: nn.Module) -> dict[int, torch.Tensor]:
        """Per layer of ``model`` (this rank's part) that routes tokens to experts, by its index in the
        whole model: its training forwards' routing since the last call as one tensor of
        ``experts + 2`` counts (the tokens each expert took, the top-k assignments routed, those dropped
        for capacity); the counts then restart."""
        return {}

    def counts_dispatch(self, config: Any, layout: Layout) -> bool:
        """Whether the module hands tokens to the experts on other ranks under ``layout`` and counts the
        bytes (``dispatch_bytes``): the job reports them as the ``all_to_all.<module>`` communicator."""
        return False

    def dispatch_bytes(self, model: nn.Module) -> int:
        """The bytes ``model`` (this rank's part) has handed to other ranks' experts so far, forward and
        backward."""
        return 0

    def forward_flops(self, config: Any) -> float | None:
        """Model FLOPs of one forward over one sample (a row, or an item for a kind of items) by the
        kind's closed form, as ``hetero.kinds.flops`` counts them (a training step costs
        ``TRAINING_MULTIPLIER`` times it); None where it has none (count a forward with
        ``counted_forward_flops`` instead)."""
        return None

    def loss_parts(self, config: Any) -> tuple[str, ...]:
        """Names of the terms ``stage`` reports besides the loss (``StageResult.parts``)."""
        return ()

    def step_statistics(self, config: Any) -> tuple[str, ...]:
        """Names of sums over rows that ``stage`` reports in ``StageResult.parts`` for ``after_step``: the
        runtime reduces them with the loss parts over the global batch, and does not log them."""
        return ()

    def after_step(self, model: nn.Module, config: Any, statistics: dict[str, float], decay: float) -> None:
        """Called after the module's optimizer step on every rank that holds it, with the step's
        ``step_statistics`` per row of the global batch (the same on every rank) and how far its learning
        rate has annealed (``OptimizerConfig.decay_at``): the place for state that a step's totals set."""

    def metric_names(self, config: Any, available: Iterable[str]) -> list[tuple[str, str]]:
        """(name, reduce) of each evaluation metric ``stage`` reports for a batch with columns ``available``."""
        return []

    def loss_count(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> int:
        """The divisor of the loss sums over the global ``batch``, of which the module processes ``rows``:
        every rank computes it, so it reads the batch's one-value-per-row columns alone, which a compact
        batch holds for every row (``hetero.kinds.batch_rows``)."""
        return len(rows)

    def stage(self, model: nn.Module, step: StageStep) -> StageResult:
        raise NotImplementedError

    def stage_shape(self, config: Any, rows: int, layout: Layout, options: ParallelOptions) -> tuple[int, ...]:
        """The activation a later pipeline stage receives for ``rows`` local rows (kinds that take pp > 1)."""
        raise NotImplementedError(f"kind {self.name!r} has no pipeline stages; run it with pp=1")

    def compute(self, mesh: ModuleMesh) -> ContextManager:
        """The context every forward and backward of the module runs in (e.g. loss parallelism)."""
        return contextlib.nullcontext()


class KindRegistry:
    """Kinds by name; a graph's modules name theirs with ``kind:``. Duplicates are refused."""

    def __init__(self, kinds: Iterable[Kind] = ()) -> None:
        self._kinds: dict[str, Kind] = {}
        for kind in kinds:
            self.register(kind)

    def register(self, kind: Kind) -> Kind:
        """Add ``kind`` (an instance; also usable as a class decorator, which registers ``cls()``)."""
        if isinstance(kind, type):
            self.register(kind())
            return kind
        if not kind.name or kind.name in self._kinds:
            reason = "has no name" if not kind.name else f"{kind.name!r} is already registered"
            raise ConfigError(f"cannot register kind {type(kind).__name__}: {reason}")
        self._kinds[kind.name] = kind
        return kind

    def __contains__(self, name: str) -> bool:
        return name in self._kinds

    def __getitem__(self, name: str) -> Kind:
        if name not in self._kinds:
            raise ConfigError(f"kind {name!r} is not registered; known kinds: {', '.join(self._kinds)}")
        return self._kinds[name]

    def names(self) -> list[str]:
        return list(self._kinds)

    def copy(self) -> KindRegistry:
        return KindRegistry(self._kinds.values())
