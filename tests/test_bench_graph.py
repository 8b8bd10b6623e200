"""``hetero bench graph``: the mixed and the colocated placement of the four-module graph in one run, with
each module's time per step and the bytes per step of every edge (both directions), the LLM's stage
links and every gradient sync."""

import json
import subprocess
import sys

MODULES = ("vision", "dna", "llm", "video")


def test_bench_graph_reports_both_placements(tmp_path):
    data = [f"train.data_dir={tmp_path / 'digits'}", f"train.genome_dir={tmp_path / 'genome'}",
            f"train.clip_dir={tmp_path / 'clips'}"]
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "bench", "graph", "--steps", "1", "--warmup", "0", "--json", *data],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout[done.stdout.index("{"):])
    assert list(results) == ["full_graph", "full_graph_colocated"]
    mixed, colocated = results["full_graph"], results["full_graph_colocated"]
    assert mixed["layouts"]["llm"] == "tp2·pp2·dp1 ranks 2-5" and colocated["layouts"]["video"] == "tp1·pp1·dp8 ranks 0-7"
    for result in (mixed, colocated):
        assert result["ranks"] == 8 and result["step_s"] > 0
        assert set(result["module_s"]) == set(MODULES) and all(s > 0 for s in result["module_s"].values())
        for edge in ("vision->llm", "dna->llm", "llm->video"):
            for direction in ("forward", "backward"):
                assert result["bytes"][f"boundary.{edge}.{direction}"] > 0, (edge, direction)
        assert result["bytes"]["pipeline.llm.forward"] > 0 and result["bytes"]["pipeline.llm.backward"] > 0
        for module in ("vision", "dna", "video"):
            assert result["bytes"][f"grad_sync.{module}"] > 0
    assert mixed["bytes"]["grad_sync.llm"] == 0 and colocated["bytes"]["grad_sync.llm"] > 0  # dp1 vs dp2
