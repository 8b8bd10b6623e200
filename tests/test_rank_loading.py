"""Each rank reads only what its modules take: the tower's replicas decode each their share of every
step's images (together each image once, their pixels alone in the batch), LLM-only ranks none; the
LLM's replicas tokenize their rows and hold those alone (tower-only ranks none); the columns of one value
per row are the global batch's. Vision dp4 (ranks 0-3, its projector beside it) and an LLM
at dp2 (ranks 4-5) on the example conversations, one a row and packed, and on a mixture of conversations
and image-caption shards."""

import torch

from hetero.config import load_experiment
from hetero.data.example import write_llava, write_webdataset
from hetero.testing.kinds import build_graph
from hetero.runtime.rows import rank_reads
from hetero.data.splits import load

STEPS = 4
LAYOUT = ["world_size=6", "vision.layout.dp=4", "projector.layout.dp=4", "llm.layout.tp=1", "llm.layout.dp=2",
          "llm.layout.offset=4", "llm.micro_batch_size=4"]


def test_each_rank_decodes_its_share_and_holds_its_own_rows_alone(tmp_path):
    path = write_llava(tmp_path / "llava", 300, seed=0)
    shards = write_webdataset(tmp_path / "shards", 200, seed=0)[0].parent
    mixture = (f"+train.data.mixture=[{{format: llava, path: '{path}', weight: 2}}, "
               f"{{format: webdataset, path: '{shards}', weight: 1}}]")
    for data in ([f"train.data.path={path}"], [f"train.data.path={path}", "train.data.pack=true"], [mixture]):
        experiment = load_experiment("own_data_vlm", [*data, *LAYOUT])
        graph = build_graph(experiment)
        microbatches = experiment.num_microbatches("vision", 4)
        everything = load(experiment, graph, "train")
        table, tokenized = [], []
        for rank in range(6):
            reads, mine = rank_reads(graph, microbatches, rank), load(experiment, graph, "train")
            decoded = []
            for step in range(STEPS):
                whole, before = everything.batch(step), mine.shaper.decoded
                batch = mine.batch(step, reads)
                decoded.append(mine.shaper.decoded - before)
                rows, read = reads(batch)
                assert decoded[-1] == len(read) and (len(read) > 0) == (rank < 4) and (len(rows) > 0) == (rank >= 4)
                rowed = {"tokens", "labels", "documents"} & whole.keys()
                assert batch.keys() == whole.keys() | {"image_held"} | {f"held:{key}" for key in rowed}
                assert torch.equal(batch["image_held"], read)
                rows = rows.get("tokens", torch.zeros(0, dtype=torch.long))
                for key in rowed:
                    assert torch.equal(torch.nonzero(batch[f"held:{key}"]).flatten(), rows)
                for key in whole.keys() - rowed - {"image_pixels"}:
                    assert torch.equal(batch[key], whole[key]), key
                assert torch.equal(batch["image_pixels"], whole["image_pixels"][read])
                for key in rowed:  # the rank's rows alone
                    assert torch.equal(batch[key], whole[key][rows]), key
            table.append(decoded)
            tokenized.append(mine.shaper.tokenized)
        once = load(experiment, graph, "train")
        images = [len(once.batch(step)["image_row"]) for step in range(STEPS)]
        print(f"\n{data[-1][:40]}: images per step {images}; decoded per rank per step {table}; samples "
              f"tokenized per rank {tokenized}")
        assert [sum(column) for column in zip(*table)] == images  # each image once, by its own replica
        assert tokenized[:4] == [0] * 4 and sum(tokenized[4:]) == once.shaper.tokenized  # each sample once


def test_the_data_benchmark_measures_each_rank_and_simulates_large_worlds(tmp_path, capsys):
    from hetero.bench import data

    data.main(["--steps", "1", "--worlds", "64", "1024", "--balance-steps", "3", "--wait-steps", "0",
               "--data", str(write_llava(tmp_path / "llava", 120, seed=0))])
    lines = capsys.readouterr().out.splitlines()
    ranks = [line.split("|") for line in lines if line[:4].strip().isdigit() and "/" in line]
    assert [int(r[0]) for r in ranks] == list(range(6))
    own = [float(r[1].split("/")[0]) for r in ranks]
    assert own[4] == own[5] == 0 and all(x > 0 for x in own[:4])
    tokenized = [float(r[3].split("/")[0]) for r in ranks]
    assert tokenized[:4] == [0] * 4 and all(x > 0 for x in tokenized[4:])
    worlds = [line.split("|") for line in lines if "/" not in line and line.split("|")[0].strip() in ("64", "1024")]
    assert [(int(w[2]), int(w[3]), int(w[4])) for w in worlds] == [(2, 0, 16), (2, 0, 16)]  # rows: 2·(N/2)/(N/16)
    splits = {line.split()[2]: float(line.split(": mean ")[1].split(",")[0]) for line in lines if line.startswith("split by")}
    assert splits.keys() == {"patches", "count"} and 1 <= splits["patches"] <= splits["count"]
