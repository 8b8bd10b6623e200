"""LLaVA-style conversations into a Qwen-VL graph (``configs/experiment/qwen_vl_sft.yaml``) from tiny random
Qwen2.5-VL and Qwen3-VL directories (``hetero tiny-vlm``) and the example dataset (digits and cropped
photographs, one, two or no images a conversation): each row's token ids equal what the tokenizer's chat
template and the Qwen processor's placeholder rule give, its images' patches and grids equal the image
processor's bit for bit, and, imported with the tower at dp2 (ranks 0-1) and the LLM at tp2 (ranks 2-3),
hetero's logits equal transformers' on those ids and pixels (1e-5)."""

import json

import pytest
import torch
import transformers
from PIL import Image

from hetero.config import load_experiment
from hetero.data.example import write_llava
from hetero.data.splits import load
from hetero.interop.tiny_vlm import IMAGE_TOKEN, write_tiny_vlm
from hetero.testing.kinds import build_graph
from hetero.testing.multiprocess import run_ranks
from hetero.testing.qwen_vl import llm_logits as evaluated_logits

ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
MODELS = {"qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
          "qwen3-vl": transformers.Qwen3VLForConditionalGeneration}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_llava(tmp_path_factory.mktemp("llava"), 12, seed=3)


def experiment_of(model, data):
    return load_experiment("qwen_vl_sft", [f"vision.init.hf={model}", f"train.data.path={data}",
                                           "batch.global_batch_size=12", "train.data.per_rank=false"])


def reference_rows(model, data, index):
    """Per sample: the ids transformers' side gives (the chat template over image and text parts, each
    <|image_pad|> then repeated once per merge block of its image) and the image processor's output."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    images = transformers.AutoImageProcessor.from_pretrained(model)
    records, root = json.loads(data.read_text()), data.parent
    rows = []
    for sample in index.tolist():
        record = records[sample]
        messages = []
        for turn in record["conversations"]:
            pieces, content = turn["value"].split("<image>"), []
            for k, piece in enumerate(pieces):
                content += ([{"type": "image"}] if k else []) + ([{"type": "text", "text": piece}] if piece else [])
            messages.append({"role": ROLES[turn["from"]], "content": content})
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        files = record.get("image", [])
        files = [files] if isinstance(files, str) else files
        pixels = images(images=[Image.open(root / f) for f in files], return_tensors="pt") if files else None
        counts = (pixels["image_grid_thw"].prod(1) // images.merge_size**2).tolist() if files else []
        parts = text.split(IMAGE_TOKEN)
        text = parts[0] + "".join(IMAGE_TOKEN * n + part for n, part in zip(counts, parts[1:]))
        rows.append((torch.tensor(tokenizer(text)["input_ids"]), pixels))
    return rows


def llm_logits(rank, world_size, experiment, batch):
    from hetero.testing.kinds import build_runtime

    return evaluated_logits(build_runtime(experiment), batch)


def whole_sequences(results) -> list[torch.Tensor]:
    """Each TP rank's logits over whole rows: under CP its CP partners' chunks put in place (ranks in
    order: CP coordinates outer to TP's, as the module's mesh lays them out)."""
    parts = [r for r in results if r is not None]
    length = max(int(held.max()) for held, _ in parts) + 1
    cp = length // len(parts[0][0])
    tp = len(parts) // cp
    wholes = []
    for t in range(tp):
        logits = parts[0][1]
        whole = torch.zeros(logits.shape[0], length, *logits.shape[2:])
        for c in range(cp):
            held, chunk = parts[c * tp + t]
            whole[:, held] = chunk
        wholes.append(whole)
    return wholes


@pytest.mark.parametrize("family", list(MODELS))
def test_conversations_train_a_qwen_vl_as_transformers_reads_them(family, data, tmp_path):
    model = write_tiny_vlm(tmp_path / family, family)
    experiment = experiment_of(model, data)
    batch = load(experiment, build_graph(experiment), "train").batch(0)
    rows = reference_rows(model, data, batch["index"])
    offset, images = 0, 0
    for r, (ids, pixels) in enumerate(rows):
        # a row keeps a document's next-token pairs: every token but the last, which only a label holds
        assert torch.equal(batch["tokens"][r, :len(ids) - 1], ids[:-1]), r
        if pixels is None:
            continue
        mine = batch["image_row"] == r
        assert torch.equal(batch["image_grid"][mine], pixels["image_grid_thw"])
        size = int(pixels["image_grid_thw"].prod(1).sum())
        assert torch.equal(batch["image_patches"][offset:offset + size], pixels["pixel_values"])
        offset, images = offset + size, images + len(pixels["image_grid_thw"])
    assert offset == len(batch["image_patches"]) and images >= 8

    theirs = MODELS[family].from_pretrained(model, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids, pixels in rows:
            extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]} if pixels else {}
            types = (ids == theirs.config.image_token_id).int()
            expected.append(theirs(input_ids=ids[None], mm_token_type_ids=types[None], **extra).logits[0])
    held = whole_sequences(run_ranks(llm_logits, 4, experiment, batch, timeout_s=300))
    errors = [((ours[r, :len(want) - 1] - want[:-1]).abs().max() / want.abs().max()).item()
              for ours in held for r, want in enumerate(expected)]
    print(f"\n{family}: {len(rows)} conversations, {images} images; logits rel. errors up to {max(errors):.1e}")
    assert len(held) == 2 and max(errors) <= 1e-5


def test_packed_rows_under_cp_and_tp_equal_each_conversation_alone(data, tmp_path):
    """qwen_vl_long_context: conversations packed into rows of 1024 positions, the LLM at cp2·tp2 (ranks 2-5)
    beside the tower at dp2: each packed conversation's logits equal transformers' on it alone."""
    model = write_tiny_vlm(tmp_path / "qwen3-vl", "qwen3-vl")
    experiment = load_experiment("qwen_vl_long_context", [f"vision.init.hf={model}", f"train.data.path={data}",
                                                          "train.data.per_rank=false"])
    batch = load(experiment, build_graph(experiment), "train").batch(0)
    theirs = MODELS["qwen3-vl"].from_pretrained(model, dtype=torch.float32).eval()
    held = whole_sequences(run_ranks(llm_logits, 6, experiment, batch, timeout_s=400))
    sizes = batch["image_grid"].prod(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    errors, documents = [], 0
    with torch.no_grad():
        for r in range(len(batch["tokens"])):
            ids_of = batch["documents"][r]
            for d in ids_of.unique().tolist()[:-1]:  # the last is the padding's
                span = torch.nonzero(ids_of == d).flatten()
                a, b = int(span[0]), int(span[-1]) + 1
                mine = torch.nonzero((batch["image_row"] == r) & (batch["image_start"] >= a) & (batch["image_start"] < b)).flatten()
                extra = {}
                if len(mine):
                    extra = {"pixel_values": torch.cat([batch["image_patches"][offsets[i]:offsets[i + 1]] for i in mine]),
                             "image_grid_thw": batch["image_grid"][mine]}
                ids = batch["tokens"][r, a:b]
                types = (ids == theirs.config.image_token_id).int()
                want = theirs(input_ids=ids[None], mm_token_type_ids=types[None], **extra).logits[0]
                errors += [((ours[r, a:b] - want).abs().max() / want.abs().max()).item() for ours in held]
                documents += 1
    print(f"\npacked: {documents} conversations in {len(batch['tokens'])} rows; logits rel. errors up to {max(errors):.1e}")
    assert len(held) == 2 and documents > 2 * len(batch["tokens"]) and max(errors) <= 1e-5
