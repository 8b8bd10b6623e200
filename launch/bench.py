"""torchrun entry point: the throughput benchmark (hetero.bench.throughput) on every rank of a job.

    torchrun --nproc_per_node 8 launch/bench.py [CONFIG] [overrides] [--steps N] [--json PATH]

Started per node by slurm/bench.sbatch (and so by slurm/bench_sweep.sh); single-machine runs may use
``hetero bench throughput``. Under torchrun every rank calls ``main``, which joins the ranks torchrun
started; ``--scaling weak|strong`` scales the experiment to the launched world size.
"""

import sys

from hetero.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))
