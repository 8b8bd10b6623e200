"""Bad batches on 4 gloo ranks where the bad module's partners sit on other ranks: the error each raises and
the seconds until every rank has left the step with it (issue 46's acceptance: at most 10 s each).

Two graphs, built with the runtime as a library (``hetero.testing.experiments``):

- ``vlm``: a ViT (image_size 16, 3 channels) dp2 on ranks 0-1 and GeneZip dp2 on ranks 2-3 feed an LLM at
  tp2·cp2 on ranks 0-3 (the issue's layout: before, 20×20 images raised inside the position table on
  ranks 0-1 while ranks 2-3 waited at the boundary for the 300 s timeout);
- ``video``: an LLM pp2 on ranks 0-1 conditions a video generator dp2 on ranks 2-3, one 1F1B over the graph.

Each row starts with a barrier, hands every rank the same bad batch (a training step, or an evaluation
where marked) and times from the first rank's start to the last rank's error; one good step on each graph
then shows that no rank was left behind. Run: ``python scripts/bad_batches.py``.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.distributed as dist

from hetero.config import OptimizerConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.gpt.config import GPTConfig
from hetero.models.video.config import VideoConfig
from hetero.models.vit.config import ViTConfig
from hetero.testing.kinds import build_runtime  # the built-in kinds
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

ROWS = 4
VISION = ViTConfig(image_size=16, patch_size=8, channels=3, hidden_size=16, num_layers=1, num_heads=2, out_size=16)
DNA = GeneZipConfig(seq_len=32, hidden_size=16, num_heads=2, main_layers=1, local_window=8, routing_window=16,
                    max_boundaries=2, out_size=16)
LLM = GPTConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, seq_len=16)
VIDEO = VideoConfig(frame_size=8, patch_size=4, hidden_size=16, num_layers=1, num_heads=2,
                    condition_size=LLM.hidden_size)
PLACEHOLDERS = VISION.num_patches + DNA.max_tokens()
Batch = dict[str, torch.Tensor]


def text(placeholders: int) -> Batch:
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(1, LLM.vocab_size, (ROWS, LLM.seq_len), generator=gen, device="cpu")
    tokens[:, :placeholders] = 0
    labels = torch.roll(tokens, -1, 1)
    labels[:, : max(placeholders - 1, 0)] = IGNORE_INDEX
    return {"tokens": tokens, "labels": labels}


def vlm_batch() -> Batch:
    gen = torch.Generator(device="cpu").manual_seed(1)
    return text(PLACEHOLDERS) | {
        "images": torch.rand(ROWS, 3, 16, 16, generator=gen, device="cpu"),
        "dna": torch.randint(0, 5, (ROWS, DNA.seq_len), generator=gen, device="cpu"),
        "dna_regions": torch.randint(0, 2, (ROWS, DNA.seq_len), generator=gen, device="cpu"),
    }


def video_batch() -> Batch:
    gen = torch.Generator(device="cpu").manual_seed(2)
    return text(0) | {"clips": torch.rand(ROWS, 4, 1, 8, 8, generator=gen, device="cpu"),
                      "index": torch.arange(ROWS, device="cpu")}


def changed(batch: Batch, key: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    return batch | {key: edit(batch[key].clone())}


def at(value: int, *where: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(tensor: torch.Tensor) -> torch.Tensor:
        tensor[where] = value
        return tensor
    return edit


def vlm_rows() -> list[tuple[str, bool, Batch]]:
    good = vlm_batch()
    return [
        ("images 20×20 (image_size 16)", True, good | {"images": torch.rand(ROWS, 3, 20, 20, device="cpu")}),
        ("images with 1 channel (channels 3)", True, good | {"images": torch.rand(ROWS, 1, 16, 16, device="cpu")}),
        ("float tokens", True, changed(good, "tokens", lambda t: t.float())),
        ("token id 32 (vocab_size 32)", True, changed(good, "tokens", at(32, 2, 12))),
        ("label -7 (neither an id nor -100)", True, changed(good, "labels", at(-7, 1, 14))),
        ("label id 40, in evaluation", False, changed(good, "labels", at(40, 3, 9))),
        ("DNA window of 30 bases (seq_len 32)", True, changed(good, "dna", lambda t: t[:, :30])),
        ("base id 5 (alphabet ACGTN)", True, changed(good, "dna", at(5, 0, 17))),
    ]


def video_rows() -> list[tuple[str, bool, Batch]]:
    good = video_batch()
    return [
        ("clips of 1 frame", True, changed(good, "clips", lambda t: t[:, :1])),
        ("clip frames 12×12 (frame_size 8)", True, good | {"clips": torch.rand(ROWS, 4, 1, 12, 12, device="cpu")}),
        ("clips with 3 channels (channels 1)", True, good | {"clips": torch.rand(ROWS, 4, 3, 8, 8, device="cpu")}),
    ]


GRAPHS = {
    "vlm": (lambda world: experiment(world, {
        "vision": module("vit", VISION, {"dp": 2, "ranks": [0, 1]}, OptimizerConfig()),
        "dna": module("genezip", DNA, {"dp": 2, "ranks": [2, 3]}, OptimizerConfig()),
        "llm": module("gpt", LLM, {"tp": 2, "cp": 2}, OptimizerConfig())},
        edges=[("vision", "llm"), ("dna", "llm")], global_batch=ROWS, microbatches=1), vlm_rows, vlm_batch),
    "video": (lambda world: experiment(world, {
        "llm": module("gpt", LLM, {"pp": 2, "ranks": [0, 1]}, OptimizerConfig()),
        "video": module("video", VIDEO, {"dp": 2, "ranks": [2, 3]}, OptimizerConfig())},
        edges=[("llm", "video")], global_batch=ROWS, microbatches=2, schedule="graph_1f1b"), video_rows, video_batch),
}


def feed(rank: int, world_size: int, graph: str) -> tuple[list[tuple[str, float, float]], float]:
    """Every bad batch of ``graph`` on this rank: (error, start, end) in wall-clock seconds; then a good
    step's ``stepped``."""
    build, rows, good = GRAPHS[graph]
    runtime = build_runtime(build(world_size))
    out = []
    for _, training, batch in rows():
        dist.barrier()
        start = time.time()
        try:
            runtime.train_step(batch) if training else runtime.evaluate([batch])
            message = "accepted"
        except ValueError as error:
            message = str(error)
        out.append((message, start, time.time()))
    return out, runtime.train_step(good())["stepped"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout per rank (s)")
    args = parser.parse_args()
    print("| graph | bad batch | error (every rank, the same) | s until every rank left the step |")
    print("| --- | --- | --- | --- |")
    for graph, (_, rows, _) in GRAPHS.items():
        results = run_ranks(feed, 4, graph, timeout_s=args.timeout * 4, collective_timeout_s=args.timeout)
        for i, (name, training, _) in enumerate(rows()):
            messages = {rank[0][i][0] for rank in results}
            seconds = max(rank[0][i][2] for rank in results) - min(rank[0][i][1] for rank in results)
            message = messages.pop() if len(messages) == 1 else f"ranks differ: {sorted(messages)}"
            print(f"| {graph} | {name} | {message.replace(chr(10), '<br>')} | {seconds:.3f} |")
        stepped = [rank[1] for rank in results]
        print(f"| {graph} | (a good batch after them) | stepped on every rank: {stepped} | |")


if __name__ == "__main__":
    main()
