"""Datasets are checked before any process starts, and every shard set has a directory of its own: a set
already there with the same options is reused (whichever command wrote it), a directory that holds
anything else is refused, saying what it holds. Real files and real ``hetero`` processes."""

import subprocess
import sys
from itertools import combinations
from pathlib import Path

from hetero.bench import genezip
from hetero.config import load_experiment
from hetero.data.shards import write_shard_set
from hetero.testing.kinds import build_graph
from hetero.data import splits
from hetero.data.sources.builtin import BuiltIn
from hetero.data.sources.registry import data_format

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs" / "experiment").glob("*.yaml"))


def hetero(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hetero.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_an_unknown_dataset_stops_layout_and_train_before_any_process(tmp_path):
    for command in ("layout", "train"):
        done = hetero(command, "colocated_vlm", "train.data.format=foo", cwd=tmp_path)
        assert done.returncode == 2
        assert done.stderr == ("hetero: error: train.data.format=foo is not a data format; choose one of digits, "
                               "digits_dna, multimodal, video_clips, genome, stdlib_text, photo_documents, llava, "
                               "webdataset, text (or register yours under the entry point group hetero.datasets)\n")
        assert done.stdout == ""  # hetero train prints the torchrun command before it launches: none was
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_holds_something_else_is_refused_before_any_rank(tmp_path):
    root = tmp_path / "genome"
    foreign = root / "window512"
    write_shard_set(foreign / "old", {"train": [{"__key__": "0", "txt": "ACGT"}]}, 1, {"dataset": "my reads"})
    (foreign / "notes.txt").write_text("mine")
    done = hetero("train", "genezip", f"train.genome_dir={root}", f"train.run_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"hetero: error: train.genome_dir={root}: {foreign} already exists and is not empty: it "
                           f"holds notes.txt, old/ (a shard set of my reads); choose another path or overwrite it\n")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt", "old"]


def test_train_and_the_genezip_bench_share_a_window_set_and_keep_others_apart(tmp_path):
    root = tmp_path / "genome"
    experiment = load_experiment("genezip", [f"train.genome_dir={root}", "dna.model.seq_len=1024"])
    splits.prepare(experiment, build_graph(experiment))
    written = {p.name: p.stat().st_mtime_ns for p in (root / "window1024").iterdir()}
    tiny = ["--steps", "1", "--batch", "2", "--hidden", "16", "--encoder-layers", "1", "--main-layers", "1",
            "--seeds", "0", "--variants", "fixed", "--sweep", "--eval-batches", "1"]
    assert genezip.main([*tiny, "--data", str(root), "--window", "1024"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (root / "window1024").iterdir()} == written  # reused as it was
    assert [p.name for p in root.iterdir()] == ["window1024"]  # the bench wrote nothing beside it


def test_the_shipped_experiments_keep_their_shard_sets_apart():
    """Each experiment's sets by default: never one inside another, one path only for the same options
    (the path names them: the window length; the clips' shape, counts and seed)."""
    sets: dict[Path, set[str]] = {}
    for name in EXPERIMENTS:
        experiment = load_experiment(name)
        if any(module.init.hf for module in experiment.modules.values()):
            continue  # sized by a checkpoint it imports (llava_stage*), on users' files: no built-in shard set
        fmt = data_format(experiment.train.data.format)
        if not isinstance(fmt, BuiltIn):
            continue
        for shard_set in fmt.shard_sets(experiment, build_graph(experiment)):
            sets.setdefault(shard_set.path, set()).add(name)
    for a, b in combinations(sets, 2):
        assert a not in b.parents and b not in a.parents, (a, b)
    assert sets[Path("data/genome/window256")] == {"dna_vlm", "full_graph", "full_graph_colocated"}
    assert sets[Path("data/genome/window512")] == {"genezip"}
    clips = {path: names for path, names in sets.items() if path.parent == Path("data/video_clips")}
    assert sorted(clips.values(), key=len) == [{"video"}, {"full_graph", "full_graph_colocated"}]
