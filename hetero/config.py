"""Experiment configuration: typed schema, loading through Hydra, validation with actionable errors.

An experiment YAML names its modules at the top level, so Hydra overrides read naturally
(``llm.layout.tp=2``)::

    world_size: 4
    batch: {global_batch_size: 16, micro_batch_size: 2}
    vision: {kind: vit, model: {...}, layout: {tp: 1, dp: 4}}
    llm:    {kind: gpt, model: {...}, layout: {tp: 2, dp: 2}}
    edges:  [{src: vision, dst: llm}]

Every top-level key that is not a field of ``ExperimentConfig`` is a module and must carry a ``kind``
registered in ``hetero.kinds``. ``hetero.graph.build_graph`` checks everything before any process group
exists.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hetero.data.config import DataConfig
from hetero.data.multimodal import Presence
from hetero.errors import ConfigError
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.options import ParallelOptions

if TYPE_CHECKING:
    from hetero.kinds.registry import KindRegistry

CONFIG_DIR = Path(os.environ.get("HETERO_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))


@dataclass
class OptimizerConfig:
    """A module's ``optim:`` block: AdamW and its learning-rate schedule."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps
    decay_steps: int = 0  # cosine decay to 10% of lr over this many steps after warmup (0: constant)

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps <= 0:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    def decay_at(self, step: int) -> float:
        """Step ``step``'s learning rate as a fraction of ``lr`` once warm-up is over, 1 during it: how far the
        schedule has annealed (state that a kind steers after each step anneals its own gain by it)."""
        return 1.0 if step < self.warmup_steps else self.lr_at(step) / self.lr


@dataclass
class CheckpointConfig:
    every: int = 0  # save every this many steps, and at the last step (0: never save)
    keep: int = 2  # complete checkpoints kept; older ones are deleted after each save (0: keep all)
    async_save: bool = False  # write in a background thread while training goes on
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | never | a step_* directory
    dir: str = ""  # "" : <train.run_dir>/<name>/checkpoints


@dataclass
class BatchConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 1  # samples per DP rank per microbatch; a module may override it


@dataclass
class EdgeConfig:
    src: str = ""
    dst: str = ""
    output: str = ""  # which of src's outputs ("": its only one)
    input: str = ""  # which of dst's inputs ("": its only one)
    compression: EdgeCompressionConfig = field(default_factory=EdgeCompressionConfig)  # its traffic


@dataclass
class InitConfig:
    """Where a module's weights start: seeded random (default), a Hugging Face checkpoint directory
    (``hf``: its ``config.json`` gives the model's sizes, its safetensors the weights), or the same module
    of an earlier hetero run (``checkpoint``: a ``step_*`` directory, saved under any layouts; its weights
    only, as a next training stage starts: the optimizer, the step and the data start afresh). Both: the
    sizes (and what an export keeps) from ``hf``, the weights from ``checkpoint``, as a next stage of a
    run that imported ``hf`` starts."""

    hf: str | None = None
    checkpoint: str | None = None


@dataclass
class ModuleConfig:
    kind: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    init: InitConfig = field(default_factory=InitConfig)
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int | None = None
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    loss_weight: float = 1.0  # this module's own loss in the combined loss (kinds that have one)
    trainable: bool = True  # false: frozen (no weight gradients, optimizer state or gradient sync)
    frozen: list[str] = field(default_factory=list)  # parameters kept frozen, by glob (e.g. "layers.0.*")


@dataclass
class TrainConfig:
    steps: int = 300
    sample_reuse: int = 1  # lazy sampling: each batch serves this many consecutive steps (Clapping)
    grad_clip: float = 1.0  # one gradient-norm clip over every module (0: off)
    log_every: int = 10
    eval_every: int = 100  # held-out evaluation (0: only at the end)
    eval_batches: int = 0  # held-out batches per evaluation (0: the whole held-out split)
    data: DataConfig = field(default_factory=DataConfig)  # the samples: a data format and its files (hetero.data.config)
    data_dir: str = "data/digits"  # the digits' webdataset shards; written there on first use
    genome_dir: str = "data/genome"  # a DNA module's genome shards, one set per window length under it
    clip_dir: str = "data/video_clips"  # video clips, one set per shape, counts and seed under it
    presence: Presence = field(default_factory=Presence)  # multimodal samples: P(image), P(dna), P(clip)
    run_dir: str = "outputs"  # each run writes under run_dir/<experiment name>
    wandb: str = "offline"  # offline | disabled: no network is ever needed
    wandb_project: str = "hetero"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    nonfinite: str = "skip"  # a NaN/Inf loss or gradient on any rank: skip the step everywhere | stop the job
    bad_shards: str = "error"  # a corrupt data shard: error | skip (leave its samples out, with a warning)
    stream_buffer: int = 0  # > 0: stream the training shards through a shuffle buffer of this many samples
    sample_log: bool = False  # write each step's sample ids (the batch's index) to <run dir>/samples.jsonl


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    world_size: int | None = None
    placement: str = "auto"  # auto | colocated | non_colocated
    # auto (phased where every module spans the same ranks, else graph_1f1b) | phased | graph_1f1b
    schedule: str = "auto"
    backend: str = "auto"  # auto (nccl on GPUs, else gloo) | gloo | nccl
    timeout_s: float = 300.0  # every collective and process-group setup fails after this
    seed: int = 0
    batch: BatchConfig = field(default_factory=BatchConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    edges: list[EdgeConfig] = field(default_factory=list)
    modules: dict[str, ModuleConfig] = field(default_factory=dict)
    # per module, the model: fields the command line set (Hydra overrides, recorded by load_experiment); None:
    # not known (an experiment built from a dict), every field counts as the user's own. Where init.hf or
    # init.checkpoint gives the sizes, these must agree with it; the YAML's others give way to it.
    command_line: dict[str, list[str]] | None = None

    def model_config(self, module: str, registry: KindRegistry) -> Any:
        """The module's typed model config (e.g. ``GPTConfig``), of its kind in ``registry`` (assembled at the
        entry point, e.g. ``hetero.models.default_registry()``)."""
        spec = self.modules[module]
        if spec.kind not in registry:
            raise ConfigError(
                f"{module}.kind={spec.kind!r} is not a known module kind; use one of {', '.join(registry.names())} "
                f"(or register yours: hetero.kinds.KindRegistry.register, entry point group hetero.kinds)"
            )
        from hetero.kinds.registry import ModelFields

        given = ModelFields(spec.model, None if self.command_line is None else self.command_line.get(module, ()))
        if spec.init.hf is not None:
            return registry[spec.kind].pretrained_config(module, spec.init.hf, given)
        saved: dict[str, Any] = {}
        if spec.init.checkpoint is not None:  # the model its run recorded, every field of it
            saved = _saved_model(module, spec)
            _refuse_disagreeing(module, spec.init.checkpoint, saved, given)
        own = {name: value for name, value in spec.model.items() if name not in saved}
        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(registry[spec.kind].config), saved, own))
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

_TOP_LEVEL = tuple(f.name for f in fields(ExperimentConfig) if f.name not in ("modules", "command_line"))


def _saved_model(module: str, spec: ModuleConfig) -> dict[str, Any]:
    """The model config (``asdict``) that ``spec.init.checkpoint``'s run recorded for ``module`` in the
    checkpoint's manifest. Only the manifest is read here: the job verifies every file before it loads the
    weights (``hetero.train.checkpoint.check_module_sources``)."""
    from hetero.train.checkpoint_files import MANIFEST

    path = Path(str(spec.init.checkpoint))
    where = f"{module}.init.checkpoint={path}"
    if not (path / MANIFEST).is_file():
        why = "does not exist" if not path.is_dir() else f"has no {MANIFEST}: it is not a complete hetero checkpoint"
        raise ConfigError(f"{where}: checkpoint {path} {why}; pass a step_* directory of an earlier run")
    try:
        models = json.loads((path / MANIFEST).read_text())["identity"]["models"]
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{where}: {path / MANIFEST} is corrupt ({err}); pass another step_* directory") from None
    if module not in models:
        raise ConfigError(f"{where}: the checkpoint holds modules {sorted(models)}, not {module}")
    if models[module]["kind"] != spec.kind:
        raise ConfigError(f"{where}: saved for another {module} (kind: saved {models[module]['kind']!r}, "
                          f"now {spec.kind!r})")
    return models[module]["model"]


def _agrees(saved: Any, given: Any) -> bool:
    """Whether ``given`` restates ``saved`` (of a nested config such as ``rope_scaling``, the keys it gives)."""
    if isinstance(saved, dict) and isinstance(given, dict):
        return all(key in saved and _agrees(saved[key], value) for key, value in given.items())
    return saved == given


def _refuse_disagreeing(module: str, path: str, saved: dict[str, Any], given: Any) -> None:
    """All the fields ``given`` states (``ModelFields.stated``) that disagree with the checkpoint's, in one error."""
    from hetero.kinds.registry import disagreement

    rows = [(name, value, saved[name]) for name, value in given.items()
            if name in saved and not _agrees(saved[name], value) and given.stated(name)]
    if rows:
        raise disagreement(module, "init.checkpoint", f"the model saved in {path}", "the checkpoint", rows,
                           given.command_line is not None)


def _command_line_fields(overrides: list[str] | tuple[str, ...],
                         modules: dict[str, ModuleConfig]) -> dict[str, list[str]]:
    """Per module, the ``model:`` fields Hydra ``overrides`` set: ``llm.model.hidden_size=128`` (or a
    nested key under it), ``llm.model={...}``, ``llm={model: {...}}``. A deletion (``~``) sets nothing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found: dict[str, set[str]] = {name: set() for name in modules}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        parts = override.key_or_group.split(".")
        if override.is_delete() or parts[0] not in found or (len(parts) > 1 and parts[1] != "model"):
            continue
        value = override.value()
        if len(parts) > 2:
            found[parts[0]].add(parts[2])
        elif len(parts) == 2 and isinstance(value, dict):
            found[parts[0]].update(value)
        elif len(parts) == 1 and isinstance(value, dict) and isinstance(value.get("model"), dict):
            found[parts[0]].update(value["model"])
    return {name: sorted(names) for name, names in found.items()}


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
                    f"from the registry of module kinds with kind: (a built-in kind such as gpt or vit, or one "
                    f"registered with hetero.kinds.KindRegistry.register or the entry point group hetero.kinds)"
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
                f"a module (a mapping with a kind:, e.g. gpt); fix the name or add a kind"
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
    problems = experiment.train.data.errors()
    if problems:
        raise ConfigError("; ".join(problems))
    return experiment


def split_config_and_overrides(items: list[str]) -> tuple[str, list[str]]:
    """A command line's ``[CONFIG] [key=value ...]``: the config defaults to the base config's experiment."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return "", items


def load_experiment(name_or_path: str = "", overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Compose an experiment with Hydra: a name from ``configs/experiment/``, a path to a YAML file, or
    "" for the default experiment of ``configs/config.yaml``. The ``model:`` fields ``overrides`` set are
    recorded (``ExperimentConfig.command_line``): where ``init.hf`` or ``init.checkpoint`` gives a module's
    sizes, those must agree with it, while the YAML's give way to it."""
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
    experiment = experiment_from_dict(raw)
    experiment.command_line = _command_line_fields(overrides, experiment.modules)
    return experiment
