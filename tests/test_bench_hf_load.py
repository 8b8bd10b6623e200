"""``hetero bench hf-load`` at a small size: the checkpoint it writes imports (its size as the index
says), and under tp2 each rank holds and reads half of the TP-split weights, and reports a peak rise."""

import json

from hetero.bench.hf_load import main, measure


def test_the_hf_load_benchmark_reports_each_ranks_share(tmp_path, capsys):
    result = measure(tp=2, layers=2, hidden=128, directory=tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result["checkpoint_bytes"]
    for rank in result["ranks"]:
        assert rank["rise"] > 0 and rank["first_build"] > 0
        # TP splits every weight but the norms (2 per layer + 1, of width 128): just over half
        assert 0.5 < rank["read"] / result["checkpoint_bytes"] < 0.51
        assert rank["held"] == rank["read"]
    main(["--tp", "2", "--layers", "1", "--hidden", "128", "--dir", str(tmp_path / "cli")])
    assert "worst rank:" in capsys.readouterr().out
