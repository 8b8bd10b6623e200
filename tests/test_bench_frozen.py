"""``hetero bench frozen``: a frozen tower runs no backward, holds no gradients or optimizer state, syncs
nothing and gets no gradient back across its edge, also computing ahead; a frozen LLM still passes the
projector its gradients."""

from hetero.bench import frozen
from hetero.data.example import write_llava


def test_the_frozen_benchmark_shows_what_freezing_saves(tmp_path, capsys):
    frozen.main(["--steps", "1", "--warmup", "1", "--data", str(write_llava(tmp_path / "llava", 120, seed=0))])
    lines = capsys.readouterr().out.splitlines()
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if "|" in line and "module" not in line]
    waits = [float(row[1].split()[-2]) for row in rows if row[1].startswith("the projector's wait")]
    rows = [row for row in rows if not row[1].startswith("the projector's wait")]
    modules = [(row[1].split()[0], [float(x) for x in row[1].split()[1:]]) for row in rows
               if not row[1].startswith("gradients")]
    edges = [row[1] for row in rows if row[1].startswith("gradients")]
    assert len(waits) == 5 and all(wait >= 0 for wait in waits)
    assert [name for name, _ in modules] == ["vision", "projector", "llm"] * 5
    trained, stage2, stage2_ahead, stage1, stage1_ahead = (modules[i:i + 3] for i in range(0, 15, 3))
    assert all(figures[0] > 0 and figures[3] > 0 and figures[4] > 0 for _, figures in trained)
    for tower in (stage2[0], stage2_ahead[0], stage1_ahead[0]):  # nothing backward, ahead or not
        assert tower[1][0] == tower[1][3] == tower[1][4] == tower[1][5] == 0 and 0 <= tower[1][2] <= 100
    assert stage1[2][1][0] > 0 and stage1[2][1][3] == stage1[2][1][4] == 0  # LLM: backward, no weight gradients
    assert "vision->projector 0.0 KB" in edges[1] and "vision->projector 0.0 KB" not in edges[0]
    assert all("projector->llm 0.0 KB" not in edge for edge in edges)
