"""``hetero bench sources``: how many samples per second one process reads, decodes, preprocesses and
tokenizes from users' formats, on real images: the example conversations about scikit-learn's digits
and about scikit-image's photographs (``hetero data example``), and the image-caption shards.

Each figure is one process on one thread (what a data worker does), over the samples of one kind, for
the ``own_data_vlm`` graph (32×32 RGB images, 16 placeholders each, byte tokens) or, with
``--image-size 224``, a SigLIP-sized tower (224×224, 196 placeholders).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from hetero.config import load_experiment
from hetero.data.example import write_llava, write_webdataset
from hetero.data.sources.registry import data_format
from hetero.graph import build_graph
from hetero.models import default_registry


def throughput(overrides: list[str], keep, limit: int) -> tuple[float, int, int]:
    """(samples/s, samples, images) shaping the samples ``keep`` accepts (by their images' names)."""
    experiment = load_experiment("own_data_vlm", overrides)
    graph = build_graph(experiment, default_registry())
    source = experiment.train.data.sources()[0]
    fmt = data_format(source.format)
    samples, shaper = fmt.split(experiment, source, "train"), fmt.shaper(experiment, graph)
    chosen = [i for i in range(len(samples)) if keep([ref.name for ref in samples.sample(i).images])][:limit]
    images = 0
    start = time.perf_counter()
    for index in chosen:
        images += len(shaper.document(samples.sample(index)).images)
    return len(chosen) / (time.perf_counter() - start), len(chosen), images


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hetero bench sources", description=__doc__)
    parser.add_argument("--samples", type=int, default=400, help="samples of each kind timed")
    parser.add_argument("--image-size", type=int, default=32, help="the tower's image size (patch 8 below 224, else 16)")
    parser.add_argument("--data", type=Path, default=None, help="where the example data goes (default: a temporary folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = args.data or Path(tempfile.mkdtemp(prefix="bench_sources."))
    conversations = root / "llava" / "conversations.json"
    if not conversations.is_file():
        write_llava(root / "llava", 3 * args.samples, seed=0)
        write_webdataset(root / "shards", 2 * args.samples, seed=0)
    patch = 16 if args.image_size >= 224 else 8
    tokens = (args.image_size // patch) ** 2
    model = [f"vision.model.image_size={args.image_size}", f"vision.model.patch_size={patch}",
             f"projector.model.tokens={tokens}", f"llm.model.seq_len={64 + 3 * tokens + 128}"]
    cases = {
        "llava, digits (8×8 PNG)": ([f"train.data.path={conversations}"], lambda n: n and all("digit" in x for x in n)),
        "llava, photographs (JPEG crops)": ([f"train.data.path={conversations}"], lambda n: n and all("photo" in x for x in n)),
        "webdataset, digits (PNG)": (["train.data.format=webdataset", f"train.data.path={root / 'shards'}"],
                                     lambda n: n[0].endswith(".png")),
        "webdataset, photographs (JPEG)": (["train.data.format=webdataset", f"train.data.path={root / 'shards'}"],
                                           lambda n: n[0].endswith(".jpg")),
    }
    print(f"one process, one thread; images to {args.image_size}×{args.image_size}, {tokens} placeholders each")
    print(f"{'samples':34s} {'samples/s':>10s} {'images/s':>10s} {'timed':>6s}")
    for name, (overrides, keep) in cases.items():
        rate, count, images = throughput(overrides + model, keep, args.samples)
        print(f"{name:34s} {rate:10.1f} {rate * images / max(count, 1):10.1f} {count:6d}")
