"""Which parameters of a module are frozen: all of them under ``trainable: false``, else those whose
names match one of its ``frozen`` globs (``fnmatch``: ``*`` spans dots, e.g. ``layers.0.*``). Names are
the model's own, as a single process builds it (parallelism's wrappers left out)."""

from __future__ import annotations

import fnmatch

import torch

from hetero.config import ModuleConfig

WRAPPER = "_checkpoint_wrapped_module."  # activation checkpointing's, inside a block's names


def is_frozen(settings: ModuleConfig, name: str) -> bool:
    name = name.replace(WRAPPER, "")
    return not settings.trainable or any(fnmatch.fnmatchcase(name, pattern) for pattern in settings.frozen)


def freeze(model: torch.nn.Module, settings: ModuleConfig) -> None:
    """Turn off the gradients of ``model``'s frozen parameters."""
    for name, param in model.named_parameters():
        if is_frozen(settings, name):
            param.requires_grad_(False)


def frozen_errors(module: str, settings: ModuleConfig, names: list[str]) -> tuple[list[str], bool]:
    """Globs of ``settings.frozen`` that match none of the module's parameter ``names``, and whether
    any parameter is left to train."""
    errors = [f"{module}.frozen: {pattern!r} matches no parameter of {module}; its parameters are named like "
              f"{', '.join(names[:4])} … (globs: * spans dots)"
              for pattern in settings.frozen if not fnmatch.filter(names, pattern)]
    return errors, any(not is_frozen(settings, name) for name in names)
