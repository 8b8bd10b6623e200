"""The job ``torchrun`` launches: compose an experiment with Hydra, then train it on this rank.

    torchrun --nproc_per_node 4 -m hetero.train.run experiment=colocated_vlm [overrides]
    torchrun --nproc_per_node 2 -m hetero.train.run experiment=path/to/mine.yaml [overrides]
"""

from __future__ import annotations

import sys

from hetero.config import load_experiment
from hetero.models import default_registry
from hetero.train.job import train


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    chosen = args[0].partition("=")[2] if args and args[0].startswith("experiment=") else ""
    if chosen.endswith((".yaml", ".yml")):  # a file of its own, not a name in configs/experiment/
        train(load_experiment(chosen, args[1:]), default_registry())
    else:
        train(load_experiment("", args), default_registry())


if __name__ == "__main__":
    main()
