"""Videos in LLaVA-style conversations for a Qwen-VL graph (``hetero.data.videos``), against transformers'
own pieces: its frame sampling (``Qwen3VLVideoProcessor.sample_frames``), Qwen3-VL's video size and
timestamps, its PyAV reader (``read_video_pyav``), the tokenizer's chat template with the processors'
placeholder rule, ``get_rope_index`` and the model's logits on those ids, grids and patches, with the tower
at dp2 (ranks 0-1) and the LLM at tp2 (ranks 2-3).

Not checked here: the resize of a video's frames against transformers' video processor, which calls
torchvision (``tvF.resize`` on uint8 tensors); the only torchvision wheel for torch 2.13 on PyPI is a CUDA
build that does not import beside the CPU torch. hetero resizes as that function does (``docs/qwen_vl.md``).
"""

import json
import math
import re
import types as pytypes

import av
import numpy as np
import pytest
import skimage.data
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as image_size
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_video_size
from transformers.video_utils import VideoMetadata, read_video_pyav

from hetero.config import load_experiment
from hetero.data.images import qwen_patches
from hetero.data.collate import Shaper
from hetero.data.sample_index import build_index
from hetero.data.samples import SampleError, VideoRef
from hetero.data.sources.llava import Conversations
from hetero.data.splits import load
from hetero.data.videos import VideoHeader, VideoPipeline, decode, probe, video_size
from hetero.interop.tiny_vlm import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, write_tiny_vlm
from hetero.testing.kinds import build_graph
from hetero.testing.multiprocess import run_ranks
from test_qwen_vl_data import MODELS, ROLES, llm_logits, whole_sequences

# Qwen3VLVideoProcessor's sampling settings (its class defaults), for its sample_frames
QWEN3_SAMPLING = pytypes.SimpleNamespace(fps=Qwen3VLVideoProcessor.fps, min_frames=Qwen3VLVideoProcessor.min_frames,
                                         max_frames=Qwen3VLVideoProcessor.max_frames)


def write_video(path, frames, fps):
    """``frames`` (H, W, 3 uint8 each) as a PNG-coded QuickTime file: lossless, so decoding gives them back."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("png", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "rgb24"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Conversations with a video file, an image and a video, a video given as frame files, and text alone;
    the frames pan across real photographs."""
    root = tmp_path_factory.mktemp("videos")
    astronaut, coffee = skimage.data.astronaut(), skimage.data.coffee()
    write_video(root / "pan.mov", [astronaut[10 * k:10 * k + 60, 5 * k:5 * k + 90] for k in range(6)], 8)
    write_video(root / "cup.mov", [coffee[100 + 7 * k:170 + 7 * k, 200:250] for k in range(7)], 4)
    for k in range(3):
        Image.fromarray(astronaut[300 + 9 * k:360 + 9 * k, 100:156]).save(root / f"frame{k}.png")
    Image.fromarray(coffee[:80, :60]).save(root / "cup.png")

    def turn(who, text):
        return {"from": who, "value": text}

    records = [
        {"id": "pan", "video": "pan.mov", "conversations": [turn("human", "<video>\nWhat moves?"), turn("gpt", "A face.")]},
        {"id": "both", "image": "cup.png", "video": "cup.mov",
         "conversations": [turn("human", "Compare <image> with <video>."), turn("gpt", "Both a cup.")]},
        {"id": "frames", "video": [f"frame{k}.png" for k in range(3)], "fps": 3,
         "conversations": [turn("human", "Frames: <video>"), turn("gpt", "Three of them.")]},
        {"id": "text", "conversations": [turn("human", "Hi"), turn("gpt", "Hello.")]},
    ]
    (root / "heldout.json").write_text(json.dumps(records[-1:]))
    path = root / "conversations.json"
    path.write_text(json.dumps(records * 2))
    return path


def test_sampling_sizes_and_timestamps_follow_transformers():
    ours = VideoPipeline.from_hf(None, "qwen3-vl")
    for total in (1, 3, 4, 7, 30, 61, 300, 2000):
        for rate in (None, 2.0, 24.0, 29.97, 60.0):
            header = VideoHeader(total, rate, 100, 200)
            theirs = Qwen3VLVideoProcessor.sample_frames(QWEN3_SAMPLING, VideoMetadata(total_num_frames=total, fps=rate))
            assert ours.indices(header) == theirs.tolist(), (total, rate)
            seconds = Qwen3VLProcessor._calculate_timestamps(None, theirs, rate or 24.0, 2)
            assert ours.stamps(header) == [f"<{t:.1f} seconds>" for t in seconds]
    assert VideoPipeline.from_hf(None, "qwen2.5-vl").indices(VideoHeader(7, 30.0, 9, 9)) == list(range(7))
    for frames in (2, 3, 4, 9, 16):
        for height, width in ((10, 300), (64, 64), (480, 640), (1080, 1920), (33, 17), (200, 31)):
            for budget in (32 * 32 * 64, 32 * 32 * 768):
                expected = qwen3_video_size(frames, height, width, 2, 32, 64 * 64, budget)
                assert video_size(frames, height, width, 2, 32, 64 * 64, budget) == expected
    with pytest.raises(ValueError, match="must be larger than temporal_factor"):
        qwen3_video_size(1, 64, 64, 2, 32, 64 * 64, 32 * 32 * 64)
    with pytest.raises(ValueError, match="1 sampled frames is shorter than one temporal patch of 2"):
        video_size(1, 64, 64, 2, 32, 64 * 64, 32 * 32 * 64)


def test_frames_decode_as_transformers_pyav_reader_reads_them(data):
    ours = VideoPipeline.from_hf(None, "qwen3-vl")
    for name in ("pan.mov", "cup.mov"):
        ref = VideoRef(name, data.parent / name)
        header = probe(ref, name)
        frames, metadata = read_video_pyav(str(ref.path), lambda metadata, **_: Qwen3VLVideoProcessor.sample_frames(
            QWEN3_SAMPLING, metadata))
        assert (header.frames, header.fps, header.height, header.width) == (
            metadata.total_num_frames, metadata.fps, metadata.height, metadata.width)
        assert ours.indices(header) == list(metadata.frames_indices)
        assert torch.equal(decode(ref, ours.indices(header), name), torch.from_numpy(frames).permute(0, 3, 1, 2))


def reference_rows(model, family, data, index):
    """Per sample of ``index``: transformers' ids (the chat template with each image's and video's
    placeholders as its processor writes them), token types, and its images (processor output) and videos
    (frames as transformers' PyAV reader samples them, grid, seconds per temporal patch)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    image_processor = transformers.AutoImageProcessor.from_pretrained(model)
    settings = json.loads((model / "video_preprocessor_config.json").read_text())
    factor, (low, high) = settings["patch_size"] * 2, settings["size"].values()
    records, root, rows = json.loads(data.read_text()), data.parent, []
    for sample in index.tolist():
        record = records[sample]
        messages = []
        for turn in record["conversations"]:
            pieces = re.split("(<image>|<video>)", turn["value"])
            content = [{"type": piece[1:-1]} if piece in ("<image>", "<video>") else {"type": "text", "text": piece}
                       for piece in pieces if piece]
            messages.append({"role": ROLES[turn["from"]], "content": content})
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        files = [record["image"]] if "image" in record else []
        images = image_processor(images=[Image.open(root / f) for f in files], return_tensors="pt") if files else None
        video = record.get("video")
        if isinstance(video, str):
            sampler = (lambda metadata, **_: Qwen3VLVideoProcessor.sample_frames(QWEN3_SAMPLING, metadata)
                       ) if family == "qwen3-vl" else (lambda metadata, **_: np.arange(metadata.total_num_frames))
            frames, metadata = read_video_pyav(str(root / video), sampler)
        elif video is not None:
            frames = np.stack([np.asarray(Image.open(root / f)) for f in video])
            metadata = VideoMetadata(total_num_frames=len(video), fps=record["fps"])
            metadata.frames_indices = (Qwen3VLVideoProcessor.sample_frames(QWEN3_SAMPLING, metadata)
                                       if family == "qwen3-vl" else np.arange(len(video)))
            frames = frames[metadata.frames_indices]
        if images is not None:
            counts = (images["image_grid_thw"].prod(1) // 4).tolist()
            text = text.replace(IMAGE_TOKEN, "\0").replace("\0", IMAGE_TOKEN * counts[0])
        videos = None
        if video is not None:
            n, height, width = len(frames), frames.shape[1], frames.shape[2]
            if family == "qwen3-vl":
                height, width = qwen3_video_size(n, height, width, 2, factor, low, high)
            else:
                height, width = image_size(height, width, factor, low, high)
            grid = [math.ceil(n / 2), height // settings["patch_size"], width // settings["patch_size"]]
            per_frame = grid[1] * grid[2] // 4
            if family == "qwen3-vl":
                seconds = Qwen3VLProcessor._calculate_timestamps(None, metadata.frames_indices, metadata.fps, 2)
                written = "".join(f"<{t:.1f} seconds>" + VISION_START + VIDEO_TOKEN * per_frame + VISION_END
                                  for t in seconds)
            else:
                written = VIDEO_TOKEN * (grid[0] * per_frame)
            text = text.replace(VIDEO_TOKEN, written, 1)
            videos = (torch.from_numpy(frames).permute(0, 3, 1, 2), grid, 2 / metadata.sampled_fps)
        ids = torch.tensor(tokenizer(text)["input_ids"])
        kinds = torch.zeros_like(ids)
        kinds[ids == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)] = 1
        kinds[ids == tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)] = 2
        rows.append((ids, kinds, images, videos))
    return rows


@pytest.mark.parametrize("family", list(MODELS))
def test_video_conversations_read_as_transformers_reads_them(family, data, tmp_path):
    model = write_tiny_vlm(tmp_path / family, family)
    experiment = load_experiment("qwen_vl_sft", [f"vision.init.hf={model}", f"train.data.path={data}",
                                                 "batch.global_batch_size=8", "train.data.per_rank=false",
                                                 f"train.data.heldout_path={data.parent / 'heldout.json'}"])
    batch = load(experiment, build_graph(experiment), "train").batch(0)
    rows = reference_rows(model, family, data, batch["index"])
    pipeline = VideoPipeline.from_hf(model, family)
    theirs = MODELS[family].from_pretrained(model, dtype=torch.float32).eval()
    sizes = batch["image_grid"].prod(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).tolist()
    expected, videos = [], 0
    for r, (ids, kinds, images, video) in enumerate(rows):
        assert torch.equal(batch["tokens"][r, :len(ids) - 1], ids[:-1]), r
        mine = torch.nonzero(batch["image_row"] == r).flatten().tolist()
        items = [(int(batch["image_start"][i]), batch["image_grid"][i].tolist(),
                  batch["image_patches"][offsets[i]:offsets[i + 1]]) for i in mine]
        extra = {}
        if images is not None:  # the image comes first in these rows
            (_, grid, patches), items = items[0], items[1:]
            assert grid == images["image_grid_thw"][0].tolist() and torch.equal(patches, images["pixel_values"])
            extra |= {"pixel_values": images["pixel_values"], "image_grid_thw": images["image_grid_thw"]}
        if video is not None:
            frames, grid, seconds = video
            t, h, w = grid
            assert [g for _, g, _ in items] == ([[1, h, w]] * t if family == "qwen3-vl" else [grid])
            assert [s for s, _, _ in items] == [i for i in range(len(ids)) if kinds[i] == 2 and kinds[i - 1] != 2]
            patches = torch.cat([p for _, _, p in items])
            # the patches of the frames transformers' reader gives, through hetero's resize and normalization
            assert torch.equal(patches, qwen_patches(pipeline(frames), pipeline.patch_size, 2, 2)[0])
            extra |= {"pixel_values_videos": patches, "video_grid_thw": torch.tensor([grid])}
            extra |= {"second_per_grid_ts": torch.tensor([seconds])} if family == "qwen2.5-vl" else {}
            videos += 1
        positions, _ = theirs.model.get_rope_index(ids[None], kinds[None], image_grid_thw=extra.get("image_grid_thw"),
                                                   video_grid_thw=extra.get("video_grid_thw"),
                                                   **({"second_per_grid_ts": extra["second_per_grid_ts"]}
                                                      if "second_per_grid_ts" in extra else {}))
        ours = batch["rope_positions"][r, :, :len(ids)]
        if family == "qwen2.5-vl" and video is not None:
            # transformers 5.x restarts the text after a video below its last temporal position; hetero
            # keeps the original rule (tests/test_mrope.py): equal up to the end of the video
            end = max(i for i in range(len(ids)) if kinds[i] == 2) + 1
            assert torch.equal(ours[:, :end], positions[:, 0, :end])
            extra["position_ids"] = ours[:, None]
        else:
            assert torch.equal(ours, positions[:, 0]), r
        with torch.no_grad():
            expected.append(theirs(input_ids=ids[None], mm_token_type_ids=kinds[None], **extra).logits[0])
    assert videos == 6 and sorted(batch["index"].tolist()) == list(range(8))  # every record, two of each kind
    held = whole_sequences(run_ranks(llm_logits, 4, experiment, batch, timeout_s=300))
    errors = [((ours[r, :len(want) - 1] - want[:-1]).abs().max() / want.abs().max()).item()
              for ours in held for r, want in enumerate(expected)]
    print(f"\n{family}: {len(rows)} conversations, {videos} videos; logits rel. errors up to {max(errors):.1e}")
    assert len(held) == 2 and max(errors) <= 1e-5


@pytest.mark.parametrize("family", list(MODELS))
def test_documents_planned_from_the_index_equal_those_read_whole(family, data, tmp_path):
    """The index holds each video item's size, temporal patches and time step (and Qwen3-VL's timestamps
    among the text tokens), so a document planned from it is the one read whole: items, text and pixels."""
    model = write_tiny_vlm(tmp_path / family, family)
    experiment = load_experiment("qwen_vl_sft", [f"vision.init.hf={model}", f"train.data.path={data}"])
    samples, shaper = Conversations(str(data), None), Shaper(build_graph(experiment), None, "error")
    index = build_index(samples, shaper.tokenizer, shaper.videos)
    assert not index.bad and int(index.image_frames.sum()) > 0
    for i in range(len(samples)):
        whole, planned = shaper.document(samples.sample(i)), shaper.planned(index, i, samples.sample(i))
        assert (planned.length, planned.label_count) == (whole.length, whole.label_count)
        assert all(torch.equal(a, b) for a, b in zip(planned.text(), whole.text()))
        assert [(s, p.shape, p.frames, p.time_step) for s, p in planned.images] == [
            (s, p.shape, p.frames, p.time_step) for s, p in whole.images]
        assert all(torch.equal(a.read(), b.read()) for (_, a), (_, b) in zip(planned.images, whole.images))


def test_bad_videos_are_refused_by_name(data, tmp_path):
    model = write_tiny_vlm(tmp_path / "qwen3-vl", "qwen3-vl")
    experiment = load_experiment("qwen_vl_sft", [f"vision.init.hf={model}", f"train.data.path={data}"])
    shaper = Shaper(build_graph(experiment), None, "error")
    (data.parent / "broken.mov").write_bytes(b"not a video")
    turns = [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "?"}]
    records = [{"id": "a", "video": "missing.mov", "conversations": turns},
               {"id": "b", "video": "broken.mov", "conversations": turns},
               {"id": "c", "video": 3, "conversations": turns},
               {"id": "d", "video": "pan.mov", "conversations": turns[1:]},
               {"id": "e", "video": ["frame0.png"], "conversations": turns}]
    (data.parent / "bad.json").write_text(json.dumps(records))
    samples = Conversations(str(data.parent / "bad.json"), None)
    messages = [r"video missing.mov not found at \S*missing.mov; fix the path or train.data.image_root",
                r"video broken.mov is not a readable video",
                r"video is 3; give a video file or a list of its frames' image files",
                r"0 <video> markers but 1 videos",
                r"video frame0.png: a video of 1 sampled frames is shorter than one temporal patch of 2"]
    for k, message in enumerate(messages):
        with pytest.raises(SampleError, match=message):
            shaper.document(samples.sample(k))
    plain = load_experiment("own_data_vlm", [f"train.data.path={data}"])  # a ViT, no Qwen tower
    with pytest.raises(SampleError, match=r"holds 1 videos but no module of the graph reads videos \(a Qwen-VL tower\)"):
        Shaper(build_graph(plain), None, "error").document(Conversations(str(data), None).sample(0))
