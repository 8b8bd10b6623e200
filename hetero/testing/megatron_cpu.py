"""megatron-core on CPU, for tests only: the five places where its model code (local layer spec, fusions
off, dropout 0) reaches for CUDA, pointed at the CPU. ``hetero`` never applies them in a run: on CUDA
nothing is substituted, and a user's run of the megatron backend on CPU fails inside megatron-core.

- ``torch.cuda.current_device`` (the rotary frequencies' and the attention scratch buffer's device) gives
  the CPU device;
- the CUDA RNG tracker's ``torch.cuda.get_rng_state``, ``torch.cuda.manual_seed`` and
  ``_set_cuda_rng_state`` / ``_get_cuda_rng_state`` use a CPU generator of their own, so seeding the
  tracker leaves torch's default CPU generator (the weights' initialization) alone. With dropout 0 no
  layer draws from it; the tracker only has to exist for the attention's ``fork()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Inside: megatron-core's model code runs on CPU."""
    import megatron.core.tensor_parallel.random as tracker_module

    generator = torch.Generator()
    substitutes = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),
        (torch.cuda, "get_rng_state", lambda device="cuda": generator.get_state()),
        (torch.cuda, "manual_seed", lambda value: generator.manual_seed(value)),
        (tracker_module, "_get_cuda_rng_state", lambda *args, **kwargs: generator.get_state()),
        (tracker_module, "_set_cuda_rng_state", lambda state, *args, **kwargs: generator.set_state(state)),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in substitutes]
    for owner, name, value in substitutes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)
