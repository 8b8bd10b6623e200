"""Every dataset that is not users' samples builds, on each rank, the compact batch its modules read: equal
to the global batch cut down to the rank's rows (``hetero.data.rank_batches.compact``), training and
held-out, on every rank of the shipped experiment's layout; a dataset held as a ``SampleTable`` makes no
row of a wide column that the rank does not read; the tower's replicas hold each image's pixels once."""

import json

import pytest
import torch

from hetero.config import load_experiment
from hetero.data.rank_batches import compact
from hetero.data.sample_table import SampleTable
from hetero.data.splits import load, prepare
from hetero.runtime.rows import rank_reads
from hetero.testing.kinds import build_graph

# experiment: its dataset, overrides that split its modules over ranks of their own
DATASETS = {
    "colocated_vlm": ["world_size=8", "placement=auto", "llm.layout.offset=4"],
    "dna_vlm": [],
    "full_graph": [],
    "video": [],
    "genezip": ["dna.layout.tp=1", "dna.layout.dp=2", "batch.micro_batch_size=8"],
    "text_lm": ["world_size=2", "llm.layout.dp=2", "batch.micro_batch_size=8"],
    "long_context_native_vlm": ["llm.layout.tp=2", "llm.layout.cp=1", "llm.layout.dp=2", "llm.micro_batch_size=2"],
}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("experiment", [*DATASETS, "text"])
def test_each_rank_builds_the_rows_it_reads_alone(tmp_path, monkeypatch, experiment):
    if experiment == "text":
        path = tmp_path / "text.jsonl"
        path.write_text("\n".join(json.dumps({"text": f"document {i}: " + "words " * (i % 7 + 1)}) for i in range(200)))
        name, overrides = "text_lm", ["train.data.format=text", f"train.data.path={path}", "world_size=2",
                                      "llm.layout.dp=2", "batch.micro_batch_size=8"]
    else:
        name, overrides = experiment, DATASETS[experiment]
    config = load_experiment(name, [*overrides, f"train.data_dir={tmp_path / 'digits'}",
                                    f"train.genome_dir={tmp_path / 'genome'}", f"train.clip_dir={tmp_path / 'clips'}"])
    graph = build_graph(config)
    first = next(iter(graph.nodes))
    microbatches = config.num_microbatches(first, graph.nodes[first].layout.dp)
    prepare(config, graph)
    train, heldout = load(config, graph, "train"), load(config, graph, "heldout")
    whole, whole_heldout = train.batch(1), heldout.ordered_batches()[0]
    built = []  # (column, rows) each SampleTable made
    values = SampleTable.values
    monkeypatch.setattr(SampleTable, "values", lambda self, key, ids: built.append((key, len(ids))) or values(self, key, ids))
    held, images = [], []
    for rank in range(config.world_size):
        reads = rank_reads(graph, microbatches, rank)
        built.clear()
        mine = train.batch(1, reads)
        assert same(mine, compact(whole, reads)), rank
        assert all(rows == int(mine[f"held:{key}"].sum()) for key, rows in built)
        assert same(heldout.ordered_batches(reads)[0], compact(whole_heldout, reads)), rank
        held.append({key[5:]: int(flags.sum()) for key, flags in mine.items() if key.startswith("held:")})
        if "image_held" in mine:
            images.append(mine["image_held"])
            held[-1]["images"] = len(mine["image_held"])
    print(f"\n{experiment}: rows (and images) held per rank {held}")
    if images:  # the tower's replicas hold each image's pixels once
        assert torch.cat(images).sort().values.tolist() == list(range(len(whole["image_row"])))
    assert any(any(rows < len(whole["index"]) for rows in h.values()) for h in held)  # some rank holds less
