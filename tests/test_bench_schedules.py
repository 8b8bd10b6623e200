"""``hetero bench schedules``: both 2-rank placements under phased and graph_1f1b in one run, each with a
step time, its ratio to phased and every rank's busy fraction."""

import re
import subprocess
import sys

from hetero.bench.schedules import PLACEMENTS, SCHEDULES


def test_bench_schedules_reports_both_schedules_on_both_placements(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "bench", "schedules", "--steps", "1", "--alternations", "1"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for label in PLACEMENTS:
        at = lines.index(label)
        for offset, schedule in enumerate(SCHEDULES, start=1):
            row = re.fullmatch(rf"  {schedule} +([\d.]+) ms/step  x([\d.]+) vs phased   busy: rank 0 (\d+)%, "
                               rf"rank 1 (\d+)%", lines[at + offset])
            assert row, lines[at + offset]
            step_ms, ratio, *busy = map(float, row.groups())
            assert step_ms > 0 and 0 < min(busy) and max(busy) <= 100
            assert ratio == 1.0 if schedule == "phased" else ratio > 0
