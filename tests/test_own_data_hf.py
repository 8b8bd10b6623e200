"""Users' conversations for imported modules: the LLM's own tokenizer and chat template (a Qwen2-style one,
built offline, beside a tiny Qwen2 checkpoint) and the tower's own image processor (SigLIP's, beside a tiny
SigLIP tower): the rows hold ``apply_chat_template``'s ids with each ``<image>`` as its run of
``<|image_pad|>`` tokens, and the images are the processor's ``pixel_values``."""

import json

import torch
import transformers
from PIL import Image

from hetero.config import load_experiment
from hetero.data.example import write_llava
from hetero.testing.kinds import build_graph
from hetero.data.splits import load

from test_chat_tokens import QWEN2_TEMPLATE, save_tokenizer, template_ids

PATCHES = 16  # (32 / 8)²


def imported(tmp_path):
    torch.manual_seed(0)
    llm = save_tokenizer(tmp_path / "qwen2", "<|image_pad|>", QWEN2_TEMPLATE)
    vocab = len(transformers.AutoTokenizer.from_pretrained(llm))
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512)).save_pretrained(llm)
    tower = tmp_path / "siglip"
    transformers.SiglipVisionModel(transformers.SiglipVisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_channels=3,
        image_size=32, patch_size=8, vision_use_head=False)).save_pretrained(tower)
    processor = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    processor.save_pretrained(tower)
    return llm, tower, processor, vocab


def test_rows_follow_the_llms_chat_template_and_the_towers_processor(tmp_path):
    llm, tower, processor, vocab = imported(tmp_path)
    data = write_llava(tmp_path / "llava", 120, seed=0)
    experiment = load_experiment("own_data_vlm", [
        f"train.data.path={data}", f"llm.init.hf={llm}", f"llm.model.vocab_size={vocab}", "llm.model.seq_len=256",
        f"vision.init.hf={tower}"])  # the YAML's other sizes restate the checkpoints
    source = load(experiment, build_graph(experiment), "train")
    chat = source.shaper.tokenizer
    assert chat.templated and chat.image_token_id == chat.encode_text("<|image_pad|>")[0]
    batch = source.batch(0)
    records = [r for i, r in enumerate(json.loads(data.read_text())) if i % 20 != 19]
    item = 0
    for row, index in enumerate(batch["index"].tolist()):
        sample = source.sources[0].sample(index)
        ids = template_ids(chat, sample.turns, [PATCHES] * len(sample.images))
        assert batch["tokens"][row, : len(ids) - 1].tolist() == ids[:-1]
        for ref in sample.images:
            with Image.open(ref.path) as image:
                expected = processor(images=image, return_tensors="pt").pixel_values[0]
            assert torch.equal(batch["image_pixels"][item], expected)
            item += 1
        supervised = batch["labels"][row] != -100
        answers = "".join(t["value"] + "<|im_end|>" for t in records[index]["conversations"] if t["from"] == "gpt")
        assert chat.decode(batch["labels"][row][supervised].tolist()) == answers
    assert item == len(batch["image_pixels"]) > 0
