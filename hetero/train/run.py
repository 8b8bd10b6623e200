"""The job ``torchrun`` launches: compose an experiment with Hydra, then train it on this rank (or, after
``--eval``, evaluate its checkpoint: ``hetero eval``).

    torchrun --nproc_per_node 4 -m hetero.train.run experiment=colocated_vlm [overrides]
    torchrun --nproc_per_node 2 -m hetero.train.run experiment=path/to/mine.yaml [overrides]
    torchrun --nproc_per_node 4 -m hetero.train.run --eval experiment=colocated_vlm [overrides]
"""

from __future__ import annotations

import sys

from hetero.config import load_experiment
from hetero.models import default_registry
from hetero.train.job import evaluate_checkpoint, train


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    job = train
    if args[:1] == ["--eval"]:
        job, args = evaluate_checkpoint, args[1:]
    chosen = args[0].partition("=")[2] if args and args[0].startswith("experiment=") else ""
    if chosen.endswith((".yaml", ".yml")):  # a file of its own, not a name in configs/experiment/
        job(load_experiment(chosen, args[1:]), default_registry())
    else:
        job(load_experiment("", args), default_registry())


if __name__ == "__main__":
    main()
