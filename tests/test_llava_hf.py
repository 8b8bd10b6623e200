"""Whole-VLM Hugging Face checkpoints in and out (``hetero/interop/llava.py``, ``vlm_export.py``): tiny
random ``LlavaForConditionalGeneration`` directories built offline (``hetero tiny-llava``: CLIP + Llama
with the ``default`` strategy at layer -2, SigLIP + Qwen2 with ``full`` at -1 and tied embeddings), each
with its tokenizer, chat template and processor, imported into a vision dp2 → projector dp2 (ranks 0-1)
→ LLM tp2 (ranks 2-3) graph. On real photographs behind a chat prompt (the processor's ids and pixels):

- imported, hetero's logits on every LLM rank equal transformers' (1e-5);
- exported untrained, the directory holds the source's tensors bit for bit, its config and side files;
- trained 3 steps and exported, transformers loads it and its logits equal the job's (1e-5); its greedy
  ``generate`` picks at every step the token hetero's forward of the export ranks first.
"""

import json

import pytest
import skimage.data
import torch
import transformers
from PIL import Image
from torch.distributed.tensor import DTensor

from hetero.data.images import ImagePipeline
from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.llava import check_llava
from hetero.interop.tiny_llava import write_tiny_llava
from hetero.models import default_registry
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

SEQ = 96
PROMPTS = (("chelsea",), ("astronaut", "coffee"))  # the photographs of each row
LAYOUTS = {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2, "offset": 2}}


@pytest.fixture(scope="module", params=["clip-llama", "siglip-qwen2"])
def llava(request, tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp(request.param), request.param)


def inputs(path, generated=()):
    """Per row, the processor's ``input_ids`` (then ``generated[row]``) and ``pixel_values``."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    rows = []
    for r, photos in enumerate(PROMPTS):
        content = "\n".join(["<image>"] * len(photos)) + "\nWhat is in the picture?"
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        images = [Image.fromarray(getattr(skimage.data, photo)()) for photo in photos]
        row = processor(images=images, text=prompt, return_tensors="pt")
        ids = row["input_ids"][0]
        if generated:
            ids = torch.cat([ids, torch.tensor(generated[r])])
        rows.append((ids, row["pixel_values"]))
    return rows


def hetero_batch(path, rows):
    """The rows as a batch of the graph: tokens padded to SEQ, each image's placeholders found by its
    token, the pixels as hetero's own pipeline makes them from the checkpoint's processor."""
    config = HFCheckpoint(path).config
    image_token = config["image_token_index"]
    pipeline = ImagePipeline.from_hf(path)
    tokens = torch.zeros(len(rows), SEQ, dtype=torch.long)
    pixels, image_row, image_start = [], [], []
    for r, ((ids, _), photos) in enumerate(zip(rows, PROMPTS)):
        tokens[r, : len(ids)] = ids
        starts = [i for i in range(len(ids)) if ids[i] == image_token and (i == 0 or ids[i - 1] != image_token)]
        image_row += [r] * len(starts)
        image_start += starts
        pixels += [pipeline(Image.fromarray(getattr(skimage.data, photo)())) for photo in photos]
    labels = torch.where(tokens == image_token, -100, tokens).roll(-1, 1)
    for r, (ids, _) in enumerate(rows):
        labels[r, len(ids) - 1:] = -100  # the next token of the text only, not of the padding
    return {"tokens": tokens, "labels": labels, "image_pixels": torch.stack(pixels),
            "image_row": torch.tensor(image_row), "image_start": torch.tensor(image_start)}


def transformers_logits(path, rows):
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=ids[None], pixel_values=pixels).logits[0] for ids, pixels in rows]


def graph(path, steps: int):
    blocks = {name: module(kind, {}, LAYOUTS[name], {"lr": 1e-3, "warmup_steps": 0}, init={"hf": str(path)})
              for name, kind in (("vision", "vit"), ("projector", "projector"), ("llm", "gpt"))}
    blocks["vision"]["model"] = blocks["projector"]["model"] = {"items": True}
    blocks["llm"]["model"] = {"seq_len": SEQ}
    return experiment(4, blocks, edges=[("vision", "projector"), ("projector", "llm")], global_batch=2,
                      microbatches=1)


def logits_of(runtime, batch):
    """The LLM's logits of ``batch`` on its ranks (None elsewhere), from ``evaluate``."""
    if "llm" not in runtime.modules:
        runtime.evaluate([batch])
        return None
    seen = []

    def keep(_, __, out):
        logits = out[0] if isinstance(out, tuple) else out  # (logits, hidden) where a consumer takes both
        seen.append((logits.full_tensor() if isinstance(logits, DTensor) else logits).detach().clone())

    hook = runtime.modules["llm"].model.register_forward_hook(keep)
    runtime.evaluate([batch])
    hook.remove()
    return seen[0]


def imported_trained_exported(rank, world_size, path, batch, untrained, trained):
    from hetero.interop.vlm_export import export_vlm
    from hetero.testing.kinds import build_runtime

    runtime = build_runtime(graph(path, 3))
    before = logits_of(runtime, batch)
    export_vlm(runtime, untrained)
    for step in range(3):
        runtime.train_step(batch | {"image_pixels": batch["image_pixels"] + 0.1 * step})
    export_vlm(runtime, trained)
    return before, logits_of(runtime, batch)


def reimported(rank, world_size, path, batch):
    from hetero.testing.kinds import build_runtime

    return logits_of(build_runtime(graph(path, 0)), batch)


def largest_error(ours, theirs, rows) -> float:
    return max(((ours[r, : len(ids)] - theirs[r]).abs().max() / theirs[r].abs().max()).item()
               for r, (ids, _) in enumerate(rows))


def test_a_whole_llava_imports_trains_and_exports_under_layouts(llava, tmp_path):
    rows = inputs(llava)
    batch = hetero_batch(llava, rows)
    for (_, pixels), r in zip(rows, range(len(rows))):  # hetero's pipeline makes the processor's pixels
        assert torch.equal(batch["image_pixels"][batch["image_row"] == r], pixels)
    untrained, trained = tmp_path / "untrained", tmp_path / "trained"
    results = run_ranks(imported_trained_exported, 4, llava, batch, untrained, trained, timeout_s=300)
    held = [r for r in results if r[0] is not None]
    assert len(held) == 2  # both LLM ranks
    expected = transformers_logits(llava, rows)
    import_errors = [largest_error(before, expected, rows) for before, _ in held]

    source, copy = HFCheckpoint(llava), HFCheckpoint(untrained)
    assert sorted(copy.names()) == sorted(source.names())
    for name in source.names():
        assert torch.equal(source.tensor(name), copy.tensor(name)), name
    for file in ("config.json", "tokenizer.json", "chat_template.jinja", "processor_config.json"):
        assert (untrained / file).read_bytes() == (llava / file).read_bytes(), file

    exported = transformers_logits(trained, rows)
    export_errors = [largest_error(after, exported, rows) for _, after in held]
    moved = max((a - b).abs().max().item() for a, b in zip(exported, expected))
    model = transformers.LlavaForConditionalGeneration.from_pretrained(trained, dtype=torch.float32).eval()
    image_token = model.config.image_token_index  # not generated: it would stand for an image
    with torch.no_grad():
        generated = [model.generate(input_ids=ids[None], pixel_values=pixels, max_new_tokens=8,
                                    do_sample=False, bad_words_ids=[[image_token]])[0, len(ids):].tolist()
                     for ids, pixels in rows]
    again = inputs(trained, generated)
    ranked = [r for r in run_ranks(reimported, 4, trained, hetero_batch(trained, again), timeout_s=300)
              if r is not None]
    ranked[0][..., image_token] = -torch.inf
    picks = [[ranked[0][r, len(ids) - 1 + i].argmax().item() for i in range(len(generated[r]))]
             for r, (ids, _) in enumerate(rows)]
    print(f"\n{llava.name}: imported logits rel. errors {', '.join(f'{e:.1e}' for e in import_errors)}; "
          f"exported after 3 steps {', '.join(f'{e:.1e}' for e in export_errors)} (logits moved {moved:.2f}); "
          f"greedy tokens {generated}, hetero's picks {picks}")
    assert max(import_errors) <= 1e-5 and max(export_errors) <= 1e-5
    assert moved > 1e-3  # training changed the model
    assert picks == generated


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["LlavaNextForConditionalGeneration"]}, "anyres tiling"),
    ({"architectures": ["Qwen2VLForConditionalGeneration"]}, "Qwen2-VL.s vision tower"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "average-pools the SigLIP patches"),
    ({"vision_feature_layer": [-2, -1]}, "several layers concatenated"),
    ({"vision_feature_select_strategy": "default"}, "SigLIP tower (no class token) is an image patch"),
    ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu' is not modelled"),
    ({"image_grid_pinpoints": [[32, 32]]}, "does not model the LLaVA field(s) image_grid_pinpoints"),
])
def test_what_hetero_does_not_model_is_refused_by_name(tmp_path_factory, changes, message):
    path = write_tiny_llava(tmp_path_factory.mktemp("llava"), "siglip-qwen2")
    config = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        if "architectures" not in changes:
            check_llava(config, "config.json")
        default_registry()["vit"].pretrained_config("vision", str(path), {"items": True})
