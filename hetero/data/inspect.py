"""``hetero data inspect EXPERIMENT [overrides]``: what the job's data holds, before training on it.

For users' samples: how many there are, their images, a histogram of positions per sample (tokens with
the images' placeholders), the samples longer than the LLM's ``seq_len`` and the bad ones with their
reason; then one sample rendered: its text as the model sees it, each image's placeholders as
``<image: N tokens>``, the tokens that carry a loss between ``[[`` and ``]]``, and each image's shape after
preprocessing. For built-in datasets: the columns of the first batch and their shapes.
"""

from __future__ import annotations

import argparse

import torch

from hetero.config import ExperimentConfig
from hetero.data.collate import Shaper
from hetero.data.digits import IGNORE_INDEX
from hetero.data.samples import SampleError, SampleSource
from hetero.data.sources.registry import data_format
from hetero.data.sources.sample_format import SampleFormat
from hetero.graph.graph import Graph

BINS = 8


def render(shaper: Shaper, tokens: torch.Tensor, labels: torch.Tensor, images: list[tuple[int, torch.Tensor]]) -> str:
    """The sample's text with its placeholders collapsed and its supervised tokens in ``[[ ]]``."""
    supervised = torch.cat([torch.zeros(1, dtype=torch.bool), labels != IGNORE_INDEX])
    starts = {start: shaper.image_tokens(image) for start, image in images}
    parts, position, run, loss = [], 0, [], False
    while position < len(tokens):
        if position in starts:
            parts.append(shaper.tokenizer.decode(run) + ("]]" if loss else ""))
            parts.append(f"<image: {starts[position]} tokens>")
            run, loss, position = [], False, position + starts[position]
            continue
        if bool(supervised[position]) != loss:
            parts.append(shaper.tokenizer.decode(run) + ("]]" if loss else "[["))
            run, loss = [], not loss
        run.append(int(tokens[position]))
        position += 1
    parts.append(shaper.tokenizer.decode(run) + ("]]" if loss else ""))
    return "".join(parts)


def histogram(lengths: list[int], seq_len: int) -> list[str]:
    top = max(max(lengths), seq_len)
    width = -(-top // BINS)
    counts = [0] * BINS
    for length in lengths:
        counts[min(length // width, BINS - 1)] += 1
    most = max(counts) or 1
    return [f"  {b * width:6d}-{(b + 1) * width - 1:<6d} {count:7d} {'#' * round(40 * count / most)}"
            for b, count in enumerate(counts)]


def inspect_samples(name: str, samples: SampleSource, shaper: Shaper, limit: int) -> list[str]:
    seq_len = shaper.seq_len
    lengths, images, bad, example = [], 0, [], None
    checked = min(limit, len(samples))
    for index in range(checked):
        try:
            tokens, labels, placed = shaper.encode(samples.sample(index))
        except SampleError as err:
            bad.append(str(err))
            continue
        lengths.append(len(tokens) - 1)
        images += len(placed)
        if example is None or (placed and not example[3]):
            example = (index, tokens, labels, placed)
    lines = [f"{name}: {len(samples)} samples; the first {checked} read: {images} images, {len(bad)} bad, "
             f"{sum(n > seq_len for n in lengths)} longer than seq_len={seq_len}"]
    if lengths:
        lines += ["positions per sample (tokens with the images' placeholders):", *histogram(lengths, seq_len)]
    lines += [f"  bad: {reason}" for reason in bad[:5]]
    if example is not None:
        index, tokens, labels, placed = example
        lines += [f"sample {index} ({len(tokens) - 1} positions, {int((labels != IGNORE_INDEX).sum())} with a loss "
                  f"in [[ ]]):", render(shaper, tokens, labels, placed)]
        lines += [f"  image {k}: {tuple(image.shape)} after preprocessing, {shaper.image_tokens(image)} tokens"
                  for k, (_, image) in enumerate(placed)]
    return lines


def inspect(experiment: ExperimentConfig, graph: Graph, limit: int) -> str:
    lines = []
    for source in experiment.train.data.sources():
        fmt = data_format(source.format)
        if isinstance(fmt, SampleFormat):
            lines += inspect_samples(f"{source.format} {source.path}", fmt.split(experiment, source, "train"),
                                     fmt.shaper(experiment, graph), limit)
            continue
        fmt.prepare(experiment, graph, source)
        batch = fmt.load(experiment, graph, source, "train").batch(0)
        lines.append(f"{source.format}: the first batch holds " + ", ".join(
            f"{key} {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" for key, value in batch.items()))
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("inspect", help="count and render an experiment's data before training on it")
    parser.add_argument("config", nargs="*", metavar="CONFIG [OVERRIDE ...]",
                        help="experiment name or YAML path, then Hydra overrides like train.data.path=data.json")
    parser.add_argument("--limit", type=int, default=1000, help="samples read for the counts (default 1000)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> None:
    from hetero.config import load_experiment, split_config_and_overrides
    from hetero.graph import build_graph
    from hetero.data import splits

    name, overrides = split_config_and_overrides(args.config)
    experiment = load_experiment(name, overrides)
    graph = build_graph(experiment, args.registry())  # the kinds, from the entry point (hetero.cli)
    splits.check(experiment, graph)
    print(inspect(experiment, graph, args.limit))
