"""What a user sees for each kind of bad sample: the message under ``train.data.on_error=error``, and
under ``skip`` how many samples were skipped in one pass over the training split.

    python scripts/bad_samples.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hetero.config import load_experiment
from hetero.data.sample_batches import DataError
from hetero.testing.kinds import build_graph  # the built-in kinds
from hetero.testing.bad_samples import write_cases
from hetero.data.splits import load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bad_samples.")))
    args = parser.parse_args()
    print("| case | format | on_error=error | on_error=skip: skipped / samples |\n|---|---|---|---|")
    for case in write_cases(args.out):
        overrides = [f"train.data.format={case.format}", f"train.data.path={case.path}"]
        results = []
        for on_error in ("error", "skip"):
            experiment = load_experiment("own_data_vlm", overrides + [f"train.data.on_error={on_error}",
                                                                     "train.data.max_skip_fraction=0.05"])
            batches = load(experiment, build_graph(experiment), "train")
            try:
                for step in range(-(-len(batches) // batches.global_batch_size)):
                    batches.batch(step)
                results.append(f"{batches.skipped} / {len(batches)}")
            except DataError as err:
                results.append(str(err).replace(str(args.out) + "/", ""))
        print(f"| {case.name} | {case.format} | {results[0]} | {results[1]} |")


if __name__ == "__main__":
    main()
