"""`hetero layout` prints, for each shipped experiment, the rank map a newcomer reads: checked cell by cell."""

import contextlib
import io
import json
import subprocess

import pytest
import yaml

from hetero.cli import main
from hetero.config import CONFIG_DIR
from hetero.data.example import write_llava, write_webdataset
from hetero.interop.tiny_llava import write_tiny_llava
from hetero.interop.tiny_vlm import write_tiny_vlm
from layout_oracle import grid_coords, modules_of_yaml

SHIPPED = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))


def expected_rows(config):
    modules, world_size = modules_of_yaml(CONFIG_DIR / "experiment" / f"{config}.yaml")
    coords = {name: grid_coords(m["layout"], world_size) for name, m in modules.items()}
    rows = []
    for rank in range(world_size):
        here = [name for name in modules if rank in coords[name]]
        for name in here:
            c = coords[name][rank]
            others = [o for o in here if o != name]
            ep = c["dp"] % modules[name]["layout"].get("ep", 1)  # experts split over neighbouring replicas
            rows.append([str(rank), name, str(c["tp"]), str(c["cp"]), str(c["dp"]), str(ep), str(c["pp"]),
                         ",".join(others) or "-"])
    return rows, modules, world_size


def hetero(*args):
    """``hetero <args>`` in this process (the console script's own exit path is checked below)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(list(args)) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Overrides that point an experiment on users' files (``hetero layout`` opens them) at an example."""
    conversations = write_llava(tmp_path_factory.mktemp("example"), 40, seed=0)
    captions = write_webdataset(tmp_path_factory.mktemp("captions"), 40, seed=0)[0].parent
    llava = write_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))
    qwen_vl = write_tiny_vlm(tmp_path_factory.mktemp("tiny_qwen_vl"))

    def overrides(config: str) -> list[str]:
        raw = yaml.safe_load((CONFIG_DIR / "experiment" / f"{config}.yaml").read_text())
        data = raw.get("train", {}).get("data", {})
        paths = {"llava": [f"train.data.path={conversations}"], "webdataset": [f"train.data.path={captions}"]}
        if config.startswith("qwen_vl"):  # a whole Qwen-VL's recipe and its variants, on conversations
            return paths["llava"] + [f"vision.init.hf={qwen_vl}"]
        imported = "llava" in config  # the recipe's stages start from a whole LLaVA
        return paths.get(data.get("format"), []) + ([f"vision.init.hf={llava}"] if imported else [])

    return overrides


def test_every_shipped_experiment_is_checked():
    assert {"homogeneous_vlm", "colocated_vlm", "non_colocated_vlm", "mixed_vlm"} <= set(SHIPPED)


@pytest.mark.parametrize("config", SHIPPED)
def test_table_cells(config, data):
    rows, modules, world_size = expected_rows(config)
    lines = hetero("layout", config, *data(config)).splitlines()
    header = lines.index(next(line for line in lines if line.startswith("rank ")))
    assert lines[header].split() == ["rank", "module", "tp", "cp", "dp", "ep", "pp", "colocated_with"]
    table = [line.split() for line in lines[header + 1 :]]
    assert table == rows
    assert lines[0].startswith(f"experiment {config}: {world_size} ranks, placement ")


@pytest.mark.parametrize("config", SHIPPED)
def test_json_cells(config, data):
    rows, modules, world_size = expected_rows(config)
    description = json.loads(hetero("layout", config, *data(config), "--json"))
    assert description["world_size"] == world_size
    got = [
        [str(r["rank"]), r["module"], str(r["tp"]), str(r["cp"]), str(r["dp"]), str(r["ep"]), str(r["pp"]),
         ",".join(r["colocated_with"]) or "-"]
        for r in description["ranks"]
    ]
    assert got == rows
    for name, module in modules.items():
        assert description["modules"][name]["kind"] == module["kind"]


def test_expert_parallel_coordinates():
    """moe_vlm's LLM at dp4·ep2: replicas 0,1 and 2,3 are its EP groups, holding experts (0,1) and (2,3)."""
    description = json.loads(hetero("layout", "moe_vlm", "--json"))
    assert description["modules"]["llm"]["ep"] == 2
    assert [(r["dp"], r["ep"]) for r in description["ranks"] if r["module"] == "llm"] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert "llm" in hetero("layout", "moe_vlm") and " ep2 " in hetero("layout", "moe_vlm")


def test_placement_modes():
    modes = {c: json.loads(hetero("layout", c, "--json"))["placement"] for c in
             ["homogeneous_vlm", "colocated_vlm", "non_colocated_vlm", "mixed_vlm"]}
    assert modes == {"homogeneous_vlm": "colocated", "colocated_vlm": "colocated",
                     "non_colocated_vlm": "non_colocated", "mixed_vlm": "mixed"}


def test_override_changes_the_map():
    description = json.loads(hetero("layout", "colocated_vlm", "llm.layout.tp=4", "llm.layout.dp=1", "llm.micro_batch_size=44", "--json"))
    assert [r["tp"] for r in description["ranks"] if r["module"] == "llm"] == [0, 1, 2, 3]


def test_bad_config_exits_with_the_error():
    done = subprocess.run(["hetero", "layout", "colocated_vlm", "llm.layout.pp=4", "llm.layout.tp=1", "llm.layout.dp=1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "llm.layout.pp=4 is larger than llm.model.num_layers=2" in done.stderr
