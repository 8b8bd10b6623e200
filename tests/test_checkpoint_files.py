"""Checkpoints on disk: committed atomically, pruned to the newest K, verified before use, and never a way
to run code: a pickle payload in DCP's metadata or in a rank-local file is refused and does not run."""

import json
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hetero.config import load_experiment
from hetero.testing.kinds import build_graph
from hetero.errors import ConfigError
from hetero.train.checkpoint import (
    CheckpointConfig,
    _module_state,
    check_resumable,
    resolve_resume,
)
from hetero.train.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    _sha256,
    commit,
    complete_checkpoints,
    load_local,
    partial_dir,
    save_local,
    step_dir,
)
from hetero.train.job import run_identity


def identity(*overrides):
    experiment = load_experiment("colocated_vlm", list(overrides))
    return run_identity(experiment, build_graph(experiment))


def write_checkpoint(root, step, keep=2, ident=None):
    """A real checkpoint as one process writes it: DCP files, a rank-local file, the committed manifest."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    partial = partial_dir(root, step)
    partial.mkdir(parents=True)
    dcp.save(_module_state({"llm": (model, optimizer)}), checkpoint_id=str(partial), no_dist=True)
    save_local({"rng": torch.get_rng_state(), "modules": {}}, partial / "local" / "rank0.pt")
    manifest = {"step": step, "world_size": 1, "identity": (ident or identity()).as_json()}
    commit(partial, step_dir(root, step), manifest, keep)
    return step_dir(root, step)


class RunsCode:
    """Unpickling this creates ``path``: a stand-in for any code a hostile file would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def rewrite_manifest_hash(checkpoint, name):
    """What an attacker who controls the directory would do: make the manifest match the new file."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    file = checkpoint / name
    manifest["files"][name] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def test_commit_keeps_the_newest_and_ignores_partials(tmp_path):
    for step in (2, 4, 6):
        write_checkpoint(tmp_path, step)
    (partial_dir(tmp_path, 8) / "local").mkdir(parents=True)  # an interrupted save
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000004", "step_000006"]
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path) == tmp_path / "step_000006"
    assert resolve_resume(CheckpointConfig(resume="never"), tmp_path) is None
    assert resolve_resume(CheckpointConfig(resume="auto"), tmp_path / "none") is None
    manifest, same_local = check_resumable(tmp_path / "step_000006", identity())
    assert manifest["step"] == 6 and same_local
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "local/rank0.pt"}


def test_a_missing_checkpoint_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.checkpoint\.resume=.*/gone: no checkpoint directory there"):
        resolve_resume(CheckpointConfig(resume=str(tmp_path / "gone")), tmp_path)


def test_corrupt_or_incomplete_checkpoints_are_refused(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 2)
    data = checkpoint / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is truncated or corrupt"):
        check_resumable(checkpoint, identity())
    (checkpoint / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"has no hetero\.json: it is not a complete hetero checkpoint"):
        check_resumable(checkpoint, identity())


def test_a_checkpoint_of_another_model_or_data_order_is_refused(tmp_path):
    checkpoint = write_checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"another model \(vision\.model\.out_size: saved 64, now 32; llm\.model\.hidden_size: saved 64, now 32\)"):
        check_resumable(checkpoint, identity("llm.model.hidden_size=32", "vision.model.out_size=32"))
    with pytest.raises(CheckpointError, match=r"batch\.global_batch_size=44, this run has 88"):
        check_resumable(checkpoint, identity("batch.global_batch_size=88"))
    _, same_local = check_resumable(checkpoint, identity("llm.layout.tp=1", "llm.layout.dp=4", "batch.micro_batch_size=11"))
    assert not same_local  # a new layout: weights reshard, rank-local state starts afresh


def test_code_in_dcp_metadata_is_refused_and_does_not_run(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", 2)
    sentinel = tmp_path / "ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(RunsCode(sentinel)))
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated or corrupt"):
        check_resumable(checkpoint, identity())
    rewrite_manifest_hash(checkpoint, ".metadata")
    with pytest.raises(CheckpointError, match=r"asks to load posix\.mkdir, which is not checkpoint metadata"):
        check_resumable(checkpoint, identity())
    assert not sentinel.exists()


def test_code_in_a_rank_local_file_is_refused_and_does_not_run(tmp_path):
    checkpoint = write_checkpoint(tmp_path / "ckpt", 2)
    sentinel = tmp_path / "ran"
    local = checkpoint / "local" / "rank0.pt"
    torch.save({"rng": RunsCode(sentinel)}, local)
    with pytest.raises(CheckpointError, match=r"rank0\.pt holds more than tensors .* \(it may carry code\)"):
        load_local(local)
    assert not sentinel.exists()
    assert load_local(write_checkpoint(tmp_path / "clean", 2) / "local" / "rank0.pt")["modules"] == {}


def test_pruning_never_leaves_a_half_deleted_checkpoint_that_looks_complete(tmp_path):
    write_checkpoint(tmp_path, 2, keep=1)
    write_checkpoint(tmp_path, 4, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_000004"]
    shutil.rmtree(tmp_path / "step_000004" / "local")  # damage after the commit is caught on load
    with pytest.raises(CheckpointError, match=r"local/rank0\.pt is listed in hetero\.json but missing"):
        check_resumable(tmp_path / "step_000004", identity())
