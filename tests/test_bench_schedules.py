"""``hetero bench schedules``: both 2-rank placements under phased and graph_1f1b in one run, each with a
step time, its ratio to phased, every rank's busy fraction and where the rest of its step went (from its
trace), and a Chrome trace per run."""

import json

import re
import subprocess
import sys

from hetero.bench.schedules import PLACEMENTS, SCHEDULES


def test_bench_schedules_reports_both_schedules_on_both_placements(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "bench", "schedules", "--steps", "1", "--alternations", "1",
         "--trace-dir", str(tmp_path / "traces")],
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
        parts = lines[at + len(SCHEDULES) + 1: at + 3 * len(SCHEDULES) + 1]
        for line, (schedule, rank) in zip(parts, [(s, r) for s in SCHEDULES for r in (0, 1)], strict=True):
            row = re.fullmatch(rf"    {schedule} +rank {rank} ms/step: compute +([\d.]+)  stage_links +(-?[\d.]+)  "
                               rf"edges +([\d.]+)  step_end +([\d.]+)  other +(-?[\d.]+)  "
                               rf"\(edges waiting for a peer ([\d.]+)\)", line)
            assert row, line
            compute, _, edges, step_end, _, waiting = map(float, row.groups())
            assert compute > 0 and step_end > 0 and 0 <= waiting <= edges
    for name, _ in PLACEMENTS.values():
        for schedule in SCHEDULES:
            events = json.loads((tmp_path / "traces" / f"{name}-{schedule}-run1.json").read_text())["traceEvents"]
            assert {e["pid"] for e in events} == {0, 1}
