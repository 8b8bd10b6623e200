"""torchrun entry point: train an experiment (composed with Hydra from configs/, overrides as arguments).

    torchrun --nproc_per_node 4 launch/train.py experiment=colocated_vlm [overrides]

The configuration is composed with Hydra's compose API, not ``@hydra.main``, so that no rank creates
its own output directory: the run directory is ``train.run_dir/<experiment name>``, written by rank 0.
"""

from hetero.train.run import main

if __name__ == "__main__":
    main()
