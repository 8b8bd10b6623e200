"""The job ``torchrun`` launches: compose an experiment with Hydra, then train it on this rank.

    torchrun --nproc_per_node 4 -m hetero.train.run experiment=colocated_vlm [overrides]
"""

from __future__ import annotations

import sys

from hetero.config import load_experiment
from hetero.kinds import default_registry
from hetero.train.job import train


def main(argv: list[str] | None = None) -> None:
    train(load_experiment("", sys.argv[1:] if argv is None else argv), default_registry())


if __name__ == "__main__":
    main()
