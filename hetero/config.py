"""Experiment configuration: typed schema, loading through Hydra, validation with actionable errors.

An experiment YAML names its modules at the top level, so Hydra overrides read naturally
(``llm.layout.tp=2``)::

    world_size: 4
    batch: {global_batch_size: 16, micro_batch_size: 2}
    vision: {kind: vit, model: {...}, layout: {tp: 1, dp: 4}}
    llm:    {kind: gpt, model: {...}, layout: {tp: 2, dp: 2}}
    edges:  [{src: vision, dst: llm}]

Every top-level key that is not a field of ``ExperimentConfig`` is a module and must carry a ``kind``
from ``hetero.kinds.MODEL_CONFIGS``. All checks run before any process group exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hetero.data.multimodal import Presence
from hetero.errors import ConfigError
from hetero.kinds import MODEL_CONFIGS
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.options import ParallelOptions
from hetero.parallel.placement import Placement, place
from hetero.train.checkpoint import CheckpointConfig
from hetero.train.optim import OptimizerConfig

CONFIG_DIR = Path(os.environ.get("HETERO_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))


@dataclass
class BatchConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 1  # samples per DP rank per microbatch; a module may override it


@dataclass
class EdgeConfig:
    src: str = ""
    dst: str = ""
    compression: EdgeCompressionConfig = field(default_factory=EdgeCompressionConfig)  # its traffic


@dataclass
class ModuleConfig:
    kind: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int | None = None
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    loss_weight: float = 1.0  # this module's own loss in a graph's combined loss (llm: text; genezip; video)


@dataclass
class TrainConfig:
    steps: int = 300
    sample_reuse: int = 1  # lazy sampling: each batch serves this many consecutive steps (Clapping)
    grad_clip: float = 1.0  # one gradient-norm clip over every module (0: off)
    log_every: int = 10
    eval_every: int = 100  # held-out evaluation (0: only at the end)
    eval_batches: int = 0  # held-out batches per evaluation (0: the whole held-out split)
    data_dir: str = "data/digits"  # webdataset shards; written there on first use
    genome_dir: str = "data/genome"  # a DNA module's genome shards, one set per window length under it
    clip_dir: str = "data/graph_clips"  # the four-module graph's video clips
    presence: Presence = field(default_factory=Presence)  # the graph's samples: P(image), P(dna), P(clip)
    run_dir: str = "outputs"  # each run writes under run_dir/<experiment name>
    wandb: str = "offline"  # offline | disabled: no network is ever needed
    wandb_project: str = "hetero"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nonfinite: str = "skip"  # a NaN/Inf loss or gradient on any rank: skip the step everywhere | stop the job
    bad_shards: str = "error"  # a corrupt data shard: error | skip (leave its samples out, with a warning)


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    world_size: int | None = None
    placement: str = "auto"  # auto | colocated | non_colocated
    backend: str = "auto"  # auto (nccl on GPUs, else gloo) | gloo | nccl
    timeout_s: float = 300.0  # every collective and process-group setup fails after this
    seed: int = 0
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    edges: list[EdgeConfig] = field(default_factory=list)
    modules: dict[str, ModuleConfig] = field(default_factory=dict)

    def model_config(self, module: str) -> Any:
        """The module's typed model config (e.g. ``GPTConfig``)."""
        spec = self.modules[module]
        try:
            return OmegaConf.to_object(
                OmegaConf.merge(OmegaConf.structured(MODEL_CONFIGS[spec.kind]), spec.model)
            )
        except OmegaConfBaseException as err:
            raise _field_error(f"{module}.model", err) from None

    def micro_batch_size(self, module: str) -> int:
        return self.modules[module].micro_batch_size or self.batch.micro_batch_size

    def num_microbatches(self, module: str, dp: int) -> int:
        """Microbatches per step: the global batch over the module's dp × micro-batch size."""
        return self.batch.global_batch_size // (dp * self.micro_batch_size(module))


# Experiment YAMLs type-check each module at compose time with ``defaults: [/hetero/module@NAME]``;
# the base config does the same for ``batch`` and ``train``.
ConfigStore.instance().store(group="hetero", name="module", node=ModuleConfig)
ConfigStore.instance().store(group="hetero", name="batch", node=BatchConfig)
ConfigStore.instance().store(group="hetero", name="train", node=TrainConfig)

_TOP_LEVEL = tuple(f.name for f in fields(ExperimentConfig) if f.name != "modules")


def _one_line(err: Exception) -> str:
    text = str(err) if err.__cause__ is None else f"{err}\n{err.__cause__}"
    lines = [line.strip() for line in text.splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith("object_type"))


def _field_error(prefix: str, err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    message = str(err).splitlines()[0]
    where = f"{prefix}.{key}" if key else prefix
    return ConfigError(f"{where}: {message}")


def _refuse_targets(node: Any, where: str) -> None:
    """hetero never instantiates a class a config names: modules come from its registry by ``kind``."""
    if isinstance(node, dict):
        for key, value in node.items():
            path = f"{where}.{key}" if where else str(key)
            if key == "_target_":
                raise ConfigError(
                    f"{path}={value!r}: configs cannot name classes to instantiate; a module picks its model "
                    f"from hetero's registry with kind: one of {', '.join(MODEL_CONFIGS)}"
                )
            _refuse_targets(value, path)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _refuse_targets(value, f"{where}[{i}]")


def experiment_from_dict(raw: DictConfig | dict) -> ExperimentConfig:
    """Type-check a composed config against the schema; modules are the non-reserved top-level keys."""
    container = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else raw
    assert isinstance(container, dict)
    container = {k: v for k, v in container.items() if k not in ("experiment", "hydra")}
    _refuse_targets(container, "")
    top = {k: v for k, v in container.items() if k in _TOP_LEVEL}
    modules: dict[str, ModuleConfig] = {}
    for name, node in container.items():
        if name in _TOP_LEVEL:
            continue
        if not isinstance(node, dict) or "kind" not in node:
            raise ConfigError(
                f"top-level key {name!r} is neither an experiment field ({', '.join(_TOP_LEVEL)}) nor "
                f"a module (a mapping with a kind: {', '.join(MODEL_CONFIGS)}); fix the name or add a kind"
            )
        try:
            module = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModuleConfig), node))
        except OmegaConfBaseException as err:
            raise _field_error(name, err) from None
        assert isinstance(module, ModuleConfig)
        modules[name] = module
    try:
        experiment = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ExperimentConfig), top))
    except OmegaConfBaseException as err:
        raise _field_error("experiment", err) from None
    except ValueError as err:  # a field's own check (the only nested one with checks: train.presence)
        raise ConfigError(f"train.{err}") from None
    assert isinstance(experiment, ExperimentConfig)
    experiment.modules = modules
    return experiment


def load_experiment(name_or_path: str = "", overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Compose an experiment with Hydra: a name from ``configs/experiment/``, a path to a YAML file, or
    "" for the default experiment of ``configs/config.yaml``."""
    path = Path(name_or_path)
    if not name_or_path:
        config_dir, config_name, base = CONFIG_DIR, "config", []
    elif path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        config_dir, config_name, base = path.resolve().parent, path.stem, []
    else:
        available = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
        if name_or_path not in available:
            raise ConfigError(
                f"experiment {name_or_path!r} is not in {CONFIG_DIR / 'experiment'}; "
                f"choose one of {', '.join(available)} or pass a path to a .yaml file"
            )
        config_dir, config_name, base = CONFIG_DIR, "config", [f"experiment={name_or_path}"]
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            raw = compose(config_name=config_name, overrides=[*base, *overrides])
    except Exception as err:  # OmegaConf type errors; Hydra's override grammar and missing keys
        if isinstance(err, OmegaConfBaseException) or type(err).__module__.startswith("hydra"):
            raise ConfigError(f"{name_or_path}: {_one_line(err)}") from None
        raise
    return experiment_from_dict(raw)


def _taken_width(model_config: Any) -> tuple[str, int]:
    """The field and width of what a module takes from an edge: a generator's conditioning hidden
    states (``condition_size``), else its hidden size."""
    if hasattr(model_config, "condition_size"):
        return "condition_size", int(model_config.condition_size)
    return "hidden_size", int(model_config.hidden_size)


def _hidden_size(model_config: Any, output: bool = False) -> int:
    """The last dim of what a module passes between its stages (or, ``output``, on to the next module)."""
    if output and getattr(model_config, "out_size", 0):
        return int(model_config.out_size)
    return int(model_config.hidden_size)


def validate(experiment: ExperimentConfig) -> Placement:
    """Check everything that can be checked before processes start; return the placement."""
    for name, module in experiment.modules.items():
        if module.kind not in MODEL_CONFIGS:
            raise ConfigError(
                f"{name}.kind={module.kind!r} is not a known module kind; use one of "
                f"{', '.join(MODEL_CONFIGS)}"
            )
    for i, edge in enumerate(experiment.edges):
        for end in ("src", "dst"):
            if getattr(edge, end) not in experiment.modules:
                raise ConfigError(
                    f"edges[{i}].{end}={getattr(edge, end)!r} names no module; modules are "
                    f"{', '.join(experiment.modules) or 'none'}"
                )
        if edge.src == edge.dst:
            raise ConfigError(f"edges[{i}] connects {edge.src} to itself; an edge joins two modules")
    if experiment.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend={experiment.backend!r} is not one of auto, gloo, nccl")
    if experiment.timeout_s <= 0:
        raise ConfigError(f"timeout_s={experiment.timeout_s} must be > 0")

    placement = place(
        {name: module.layout for name, module in experiment.modules.items()},
        experiment.world_size,
        experiment.placement,
    )

    errors: list[str] = []
    for name, module in experiment.modules.items():
        errors += experiment.model_config(name).errors(name, placement.layouts[name], module.parallel)
        errors += module.parallel.errors(name)
        errors += module.compression.errors(name, placement.layouts[name].cp, module.parallel.fsdp)
    batch = experiment.batch
    if batch.global_batch_size < 1 or batch.micro_batch_size < 1:
        errors.append(
            f"batch.global_batch_size={batch.global_batch_size} and batch.micro_batch_size="
            f"{batch.micro_batch_size} must be >= 1"
        )
    else:
        for name, layout in placement.layouts.items():
            mbs = experiment.micro_batch_size(name)
            if mbs < 1:
                errors.append(f"{name}.micro_batch_size={mbs} must be >= 1")
            elif batch.global_batch_size % (layout.dp * mbs):
                errors.append(
                    f"batch.global_batch_size={batch.global_batch_size} is not divisible by {name}'s "
                    f"dp*micro_batch_size = {layout.dp}*{mbs} = {layout.dp * mbs}; use a global batch "
                    f"that is a multiple of {layout.dp * mbs}"
                )
        if not errors:
            counts = {n: experiment.num_microbatches(n, l.dp) for n, l in placement.layouts.items()}
            if len(set(counts.values())) > 1:
                listed = ", ".join(
                    f"{n}: {batch.global_batch_size}/({placement.layouts[n].dp}*{experiment.micro_batch_size(n)})"
                    f" = {c}" for n, c in counts.items()
                )
                errors.append(
                    f"modules split the global batch into different numbers of microbatches ({listed}); "
                    f"set each module's micro_batch_size so that global_batch_size/(dp*micro_batch_size) agree"
                )
    reuse = experiment.train.sample_reuse
    if reuse < 1:
        errors.append(f"train.sample_reuse={reuse} must be >= 1 (1: a fresh batch every step)")
    for name, module in experiment.modules.items():
        errors += module.compression.pipeline.errors(
            f"{name}.compression.pipeline", reuse, _hidden_size(experiment.model_config(name))
        )
    for i, edge in enumerate(experiment.edges):
        sent = _hidden_size(experiment.model_config(edge.src), output=True)
        taken_field, taken = _taken_width(experiment.model_config(edge.dst))
        if sent != taken:
            fix = (f"set {edge.dst}.model.{taken_field}={sent}" if taken_field == "condition_size"
                   else f"set {edge.src}.model.out_size={taken}")
            errors.append(
                f"edges[{i}] ({edge.src} -> {edge.dst}): {edge.src} hands on width {sent} but "
                f"{edge.dst}.model.{taken_field}={taken}; {fix}"
            )
        errors += edge.compression.errors(
            f"edges[{i}].compression", reuse, _hidden_size(experiment.model_config(edge.src), output=True)
        )
    if experiment.train.wandb not in ("offline", "disabled"):
        errors.append(f"train.wandb={experiment.train.wandb!r} is not one of offline, disabled")
    if experiment.train.steps < 1:
        errors.append(f"train.steps={experiment.train.steps} must be >= 1")
    for key, allowed in (("nonfinite", ("skip", "stop")), ("bad_shards", ("error", "skip"))):
        if getattr(experiment.train, key) not in allowed:
            errors.append(f"train.{key}={getattr(experiment.train, key)!r} is not one of {', '.join(allowed)}")
    checkpoint = experiment.train.checkpoint
    if checkpoint.every < 0 or checkpoint.keep < 0:
        errors.append(
            f"train.checkpoint.every={checkpoint.every} and train.checkpoint.keep={checkpoint.keep} must be >= 0"
        )
    if errors:
        raise ConfigError("\n".join(errors))
    return placement
