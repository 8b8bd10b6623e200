"""Users' data through the data formats: LLaVA conversations and WebDataset image-caption shards
(written by ``hetero data example`` from real images), text JSONL, mixtures, bad samples and samples too
long for a row, shaped for the ``own_data_vlm`` graph (a tower and a projector of items, an LLM)."""

import functools
import json
import subprocess
import sys

import pytest
import torch

from hetero.config import load_experiment
from hetero.data.chat import ChatTokenizer
from hetero.data.digits import IGNORE_INDEX
from hetero.data.example import write_llava, write_webdataset
from hetero.data.sample_batches import DataError
from hetero.testing.kinds import build_graph
from hetero.testing.bad_samples import write_cases
from hetero.data.splits import check, load
from hetero.errors import ConfigError

PLACEHOLDERS = 16  # the tower's (32 / 8)² patches per image


@functools.cache
def example(tmp_root: str):
    from pathlib import Path

    root = Path(tmp_root)
    return write_llava(root / "llava", 200, seed=0), write_webdataset(root / "shards", 120, seed=0, per_shard=50)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return example(str(tmp_path_factory.mktemp("own_data")))


def batches(*overrides, split="train", name="own_data_vlm"):
    experiment = load_experiment(name, list(overrides))
    return load(experiment, build_graph(experiment), split)


def test_conversations_become_rows_with_images_at_their_markers_and_a_loss_on_the_assistant(data):
    llava, _ = data
    source = batches(f"train.data.path={llava}")
    records = json.loads(llava.read_text())
    train_records = [r for i, r in enumerate(records) if i % 20 != 19]
    tokenizer = ChatTokenizer(None)
    per_row = []
    for step in range(3):
        batch = source.batch(step)
        assert batch["index"].tolist() == [source.locate(16 * step + row)[1] for row in range(16)]  # sample ids
        per_row += check_rows(source, batch, train_records, tokenizer)
    assert 0 in per_row and 2 in per_row and 1 in per_row  # text-only and multi-image samples too
    assert source.batch(0)["tokens"].equal(source.batch(0)["tokens"])  # a function of (seed, step)


def check_rows(source, batch, train_records, tokenizer):
    assert batch["tokens"].shape == batch["labels"].shape == (16, 192)
    per_row = []
    for row, sample_id in enumerate(batch["index"].tolist()):
        record = train_records[sample_id]
        sample = source.sources[0].sample(sample_id)
        paths = record.get("image", [])
        paths = [paths] if isinstance(paths, str) else paths
        mine = batch["image_row"] == row
        assert int(mine.sum()) == len(paths)
        for start in batch["image_start"][mine].tolist():
            assert (batch["tokens"][row, start : start + PLACEHOLDERS] == tokenizer.image_token_id).all()
            assert (batch["labels"][row, max(start - 1, 0) : start + PLACEHOLDERS - 1] == IGNORE_INDEX).all()
        encoded = tokenizer.encode_chat(sample.turns, [PLACEHOLDERS] * len(paths))
        length = len(encoded.tokens) - 1
        assert batch["tokens"][row, :length].tolist() == encoded.tokens[:-1]
        supervised = batch["labels"][row] != IGNORE_INDEX
        answers = "".join(t["value"] + "\n" for t in record["conversations"] if t["from"] == "gpt")
        assert bytes(batch["labels"][row][supervised].tolist()).decode() == answers
        per_row.append(len(paths))
    assert batch["image_pixels"].shape == (sum(per_row), 3, 32, 32)
    return per_row


def test_image_caption_shards_train_the_caption_as_the_answer(data):
    _, shards = data
    batch = batches("train.data.format=webdataset", f"train.data.path={shards[0].parent}").batch(1)
    assert len(batch["image_row"]) == 16 and batch["image_row"].tolist() == list(range(16))
    captions = [bytes(row[row != IGNORE_INDEX].tolist()).decode() for row in batch["labels"]]
    assert all(c.endswith(".\n") and ("handwritten" in c or len(c) > 12) for c in captions), captions
    braces = f"train.data.path='{shards[0].parent}/shard-{{000000..000002}}.tar'"
    assert batches("train.data.format=webdataset", braces).batch(1)["tokens"].equal(batch["tokens"])


def test_a_mixture_draws_each_source_by_weight_in_an_order_of_the_seed_alone(data):
    llava, shards = data
    mixture = (f"+train.data.mixture=[{{format: llava, path: '{llava}', weight: 3}}, "
               f"{{format: webdataset, path: '{shards[0].parent}', weight: 1}}]")
    first, again, other = batches(mixture), batches(mixture), batches(mixture, "seed=1")
    order = [first.locate(p) for p in range(400)]
    assert order == [again.locate(p) for p in range(400)] != [other.locate(p) for p in range(400)]
    assert sum(s == 0 for s, _ in order) == 300
    assert first.batch(3)["tokens"].equal(again.batch(3)["tokens"])


def test_a_mixture_refuses_a_format_of_whole_batches_naming_those_it_draws(data):
    llava, _ = data
    experiment = load_experiment("own_data_vlm", [f"+train.data.mixture=[{{format: llava, path: '{llava}'}}, "
                                                  "{format: genome}]"])
    with pytest.raises(ConfigError, match=r"mixture\[1\].format=genome gives whole batches, not samples; a mixture "
                                          r"draws the samples of digits, llava, webdataset$"):
        check(experiment, build_graph(experiment))


def test_text_jsonl_packs_documents_into_rows_without_a_label_across_them(tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"document {i}: " + "words " * (i % 7 + 1)}) for i in range(200)))
    batch = batches("train.data.format=text", f"train.data.path={path}", "batch.global_batch_size=16",
                    "llm.model.seq_len=192", name="text_lm").batch(0)
    documents, labels, tokens = batch["documents"], batch["labels"], batch["tokens"]
    assert documents.shape == (16, 192) and (documents[:, 0] == 0).all()
    assert ((documents[:, 1:] - documents[:, :-1]) >= 0).all() and int(documents.max()) > 3
    ends = documents[:, 1:] != documents[:, :-1]  # a label at a document's last position would cross
    assert (labels[:, :-1][ends] == IGNORE_INDEX).all()
    within = (labels[:, :-1] != IGNORE_INDEX)
    assert labels[:, :-1][within].equal(tokens[:, 1:][within])


@pytest.mark.parametrize("case", range(7))
def test_each_bad_sample_is_named_or_skipped_and_counted(tmp_path_factory, case):
    cases = bad_cases(str(tmp_path_factory.getbasetemp()))
    bad = cases[case]
    where = [f"train.data.format={bad.format}", f"train.data.path={bad.path}"]
    with pytest.raises(DataError, match=r"(sample|line) .*(not found|not a readable image|markers but|from 'robot'|"
                                        r"conversation is empty|not UTF-8|truncated)"):
        for step in range(8):
            batches(*where).batch(step)
    skipping = batches(*where, "train.data.on_error=skip", "train.data.max_skip_fraction=0.05")
    for step in range(-(-len(skipping) // 16)):
        skipping.batch(step)
    assert skipping.skipped == 1
    with pytest.raises(DataError, match=r"1 samples of the \d+ in the train split were skipped, more than "
                                        r"train.data.max_skip_fraction=0.0; the last: "):
        strict = batches(*where, "train.data.on_error=skip", "train.data.max_skip_fraction=0")
        for step in range(8):
            strict.batch(step)


@functools.cache
def bad_cases(root: str):
    from pathlib import Path

    return write_cases(Path(root) / "bad")


def test_a_sample_too_long_for_a_row_is_refused_cut_or_skipped(data):
    llava, _ = data
    short = [f"train.data.path={llava}", "llm.model.seq_len=90"]
    with pytest.raises(DataError, match=r"positions with its images' placeholders, more than llm\.model\.seq_len=90; "
                                        r"raise it, or set train.data.too_long=truncate or skip"):
        for step in range(4):
            batches(*short).batch(step)
    cut = batches(*short, "train.data.too_long=truncate").batch(0)
    ends = cut["image_start"] + PLACEHOLDERS
    assert (ends <= 90).all() and cut["tokens"].shape == (16, 90)
    skipping = batches(*short, "train.data.too_long=skip", "train.data.max_skip_fraction=1")
    skipping.batch(0)
    assert skipping.skipped > 0


def test_a_wrong_path_stops_layout_before_any_rank(tmp_path):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "layout", "own_data_vlm",
                           f"train.data.path={tmp_path}/nothing.json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == f"hetero: error: train.data.path={tmp_path}/nothing.json does not exist\n"


def test_the_sources_benchmark_times_each_kind_of_sample(tmp_path, capsys):
    from hetero.bench import sources

    sources.main(["--samples", "4", "--data", str(tmp_path)])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("llava", "webdataset"))]
    assert len(rows) == 4 and all(float(row[-3]) > 0 and int(row[-1]) > 0 for row in rows), rows


def test_jsonl_records_and_json_captions_and_globs_read_as_their_json_and_txt_twins(data, tmp_path):
    llava, shards = data
    lines = tmp_path / "conversations.jsonl"
    lines.write_text("\n".join(json.dumps(record) for record in json.loads(llava.read_text())) + "\n")
    as_lines = batches(f"train.data.path={lines}", f"train.data.image_root={llava.parent}").batch(2)
    assert as_lines["tokens"].equal(batches(f"train.data.path={llava}").batch(2)["tokens"])
    assert as_lines["image_pixels"].equal(batches(f"train.data.path={llava}").batch(2)["image_pixels"])
    import tarfile

    with tarfile.open(shards[0]) as tar, tarfile.open(tmp_path / "captions-0.tar", "w") as out:
        for member in tar.getmembers():
            data_ = tar.extractfile(member).read()
            if member.name.endswith(".txt"):
                data_ = json.dumps({"caption": data_.decode()}).encode()
                member.name = member.name.replace(".txt", ".json")
            member.size = len(data_)
            out.addfile(member, __import__("io").BytesIO(data_))
    webdataset = ["train.data.format=webdataset", "train.data.heldout_every=1000"]
    as_json = batches(*webdataset, f"train.data.path={tmp_path}/captions-*.tar").batch(0)
    as_txt = batches(*webdataset, f"train.data.path={shards[0]}").batch(0)
    assert as_json["tokens"].equal(as_txt["tokens"]) and as_json["labels"].equal(as_txt["labels"])


def test_packed_conversations_fill_rows_with_documents_planned_from_text_and_headers(data):
    llava, _ = data
    packed = batches(f"train.data.path={llava}", "train.data.pack=true", "llm.model.seq_len=384")
    single = batches(f"train.data.path={llava}", "llm.model.seq_len=384")
    batch = packed.batch(0)
    documents, labels = batch["documents"], batch["labels"]
    rows = packed._rows(0)
    assert sum(len(row) for row in rows) >= 48  # samples of 50-190 positions, several to a row of 384
    for r, row in enumerate(rows):  # each packed sample is the sample's own row, moved to its offset
        offset = 0
        for d, place in enumerate(row):
            document = single._document(place)
            alone, length = single.shaper.batch([[document]], torch.zeros(1), False), document.length
            assert length == packed._length(place)  # planned from the text and the images' headers
            assert (documents[r, offset : offset + length] == d).all()
            assert batch["tokens"][r, offset : offset + length].equal(alone["tokens"][0, :length])
            assert labels[r, offset : offset + length].equal(alone["labels"][0, :length])
            offset += length
        assert (labels[r, offset:] == IGNORE_INDEX).all()
    starts = batch["image_start"]
    assert (batch["tokens"][batch["image_row"][:, None], starts[:, None] + torch.arange(PLACEHOLDERS)] == 0).all()
    seen = [place for step in range(3) for row in packed._rows(step) for place in row]
    assert len(seen) == len(set(seen))  # a pass serves each sample once
    assert packed.batch(0)["tokens"].equal(batch["tokens"])


NATIVE = """
name: native
world_size: 2
placement: colocated
batch: {global_batch_size: 8, micro_batch_size: 4}
vision:
  kind: vit
  model: {image_size: 32, patch_size: 8, channels: 3, hidden_size: 32, num_layers: 1, num_heads: 2, out_size: 32,
          class_token: false, max_patches: 24}
  layout: {dp: 2}
llm:
  kind: gpt
  model: {vocab_size: 256, hidden_size: 32, num_layers: 1, num_heads: 2, seq_len: 512}
  layout: {tp: 2}
  micro_batch_size: 8
train: {data: {format: llava, path: PATH, pack: true}}
edges:
  - {src: vision, dst: llm}
"""


def test_native_resolution_images_keep_their_aspect_and_packing_plans_them_from_headers(data, tmp_path):
    from hetero.data.images import header_size

    llava, _ = data
    config = tmp_path / "native.yaml"
    config.write_text(NATIVE.replace("PATH", str(llava)))
    experiment = load_experiment(str(config))
    source = load(experiment, build_graph(experiment), "train")
    for step in range(3):
        batch = source.batch(step)
        grids = batch["image_grid"]
        assert (grids.prod(1) <= 24).all() and len(set(map(tuple, grids.tolist()))) > 1  # photos of many shapes
        assert batch["image_patches"].shape == (int(grids.prod(1).sum()), 3 * 8 * 8)
        for row in source._rows(step):
            for place in row:
                sample = source.sources[0].sample(place[1])
                document = source._document(place)
                assert document.length == source._length(place)
                for ref, (_, image) in zip(sample.images, document.images):
                    width, height = header_size(ref.read(sample.where))
                    rows, cols = image.shape[1] // 8, image.shape[2] // 8
                    assert abs(cols / rows - width / height) <= max(1 / rows, 1 / cols) * width / height + 0.5


def test_the_sample_index_is_kept_beside_the_data_until_a_file_changes(tmp_path, monkeypatch):
    import os

    from hetero.data import sample_index

    path = write_llava(tmp_path / "llava", 60, seed=0)
    first = batches(f"train.data.path={path}", "train.data.pack=true")
    kept = sorted((tmp_path / "llava" / ".hetero-index").glob("*.pt"))
    assert len(kept) == 1  # the training split's

    def built(*args):
        raise AssertionError("the index was built again")

    with monkeypatch.context() as patch:
        patch.setattr(sample_index, "build_index", built)
        again = batches(f"train.data.path={path}", "train.data.pack=true")
        assert again.batch(1)["tokens"].equal(first.batch(1)["tokens"])
    image = next((tmp_path / "llava" / "images").glob("digit_*.png"))
    os.utime(image, ns=(1, 1))  # an image the JSON names changes: a new index
    batches(f"train.data.path={path}", "train.data.pack=true")
    assert len(list((tmp_path / "llava" / ".hetero-index").glob("*.pt"))) == 2
