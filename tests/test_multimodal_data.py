"""Multimodal samples: presence flags drawn per sample (deterministic, independent of the batch size, at
the configured rates), absent modalities zeroed and their facts unsupervised, the clip clause from the
clip's scene 0, agreement with ``DigitDnaBatches`` where everything is present, and a clear seq_len error.

The genome windows are 1024 bases (not 256 as in ``test_digit_dna``): every loader reads all training
windows for the GC bins, and four times fewer windows keep this file within its time budget."""

import re

import pytest
import torch

from hetero.data.digit_dna import DigitDnaBatches
from hetero.data.digits import IGNORE_INDEX, PAD_TOKEN, ensure_digit_shards
from hetero.data.genome import GenomeOptions, ensure_genome_shards
from hetero.data.multimodal import CLIP_STRIDE, MultimodalBatches, Presence, clip_clause, presence_flags
from hetero.data.shards import read_split
from hetero.data.video_clips import ClipOptions, digit_indices, ensure_video_shards

IMAGE_TOKENS, DNA_TOKENS = 4, 8
PLACEHOLDERS = IMAGE_TOKENS + DNA_TOKENS
CLIPS = ClipOptions(frames=12, size=16, gap=5, a_len=4)
HELDOUT_CLIPS = 6


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multimodal")
    ensure_digit_shards(root / "digits")
    ensure_genome_shards(root / "genome", GenomeOptions(window=1024))
    ensure_video_shards(root / "clips", 12, HELDOUT_CLIPS, CLIPS, samples_per_shard=8)
    return {name: root / name for name in ("digits", "genome", "clips")}


@pytest.fixture(scope="module")
def scenes(shards) -> dict[int, dict]:
    """Scene 0 of each held-out clip, by the clip's index."""
    return {s["json"]["index"]: s["json"]["scenes"][0] for s in read_split(shards["clips"], "heldout")}


@pytest.fixture(scope="module")
def seq_len(shards, scenes) -> int:
    """The least seq_len that holds every held-out caption with both clauses."""
    longest = max(
        len(s["txt"] + " gc 0." + clip_clause(scenes[s["json"]["index"] * CLIP_STRIDE % HELDOUT_CLIPS]))
        for s in read_split(shards["digits"], "heldout")
    )
    return PLACEHOLDERS + longest


def loader(shards, seq_len, batch_size=8, presence=Presence(), seed=0) -> MultimodalBatches:
    return MultimodalBatches(
        shards["digits"], shards["genome"], shards["clips"], "heldout", batch_size, IMAGE_TOKENS, DNA_TOKENS,
        seq_len, seed, presence,
    )


@pytest.fixture(scope="module")
def heldout(shards, seq_len) -> MultimodalBatches:
    return loader(shards, seq_len)


@pytest.fixture(scope="module")
def pairs(shards, seq_len) -> DigitDnaBatches:
    return DigitDnaBatches(shards["digits"], shards["genome"], "heldout", 8, IMAGE_TOKENS, DNA_TOKENS, seq_len)


def whole(data) -> dict[str, torch.Tensor]:
    """Every sample of ``data`` in stored order, as one batch."""
    batches = data.ordered_batches()
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def caption_text(tokens: torch.Tensor) -> str:
    return bytes(tokens[PLACEHOLDERS:].tolist()).split(bytes([PAD_TOKEN]))[0].decode()


def test_batches_are_deterministic_and_flags_do_not_depend_on_the_batch_size(shards, seq_len, heldout):
    other = loader(shards, seq_len, batch_size=5)
    mine = [heldout.batch(step) for step in range(30)]  # 240 samples: the stream crosses an epoch
    theirs = [other.batch(step) for step in range(48)]
    for key in mine[0]:
        assert torch.equal(torch.cat([b[key] for b in mine]), torch.cat([b[key] for b in theirs])), key
    # The flags are a function of (seed, split, index) alone.
    flags = torch.stack([heldout.column(f"has_{name}") for name in ("image", "dna", "clip")], 1)
    assert torch.equal(flags, presence_flags(0, "heldout", heldout.column("index").tolist(), Presence()))
    assert not torch.equal(flags, presence_flags(1, "heldout", heldout.column("index").tolist(), Presence()))
    assert not torch.equal(flags, presence_flags(0, "train", heldout.column("index").tolist(), Presence()))


def test_presence_rates_match_the_probabilities_independently():
    presence = Presence()
    train = presence_flags(0, "train", digit_indices("train").tolist(), presence).double()
    assert len(train) == 1621
    rates = train.mean(0)
    assert (rates - torch.tensor([0.75, 0.5, 0.5], dtype=torch.float64)).abs().max() < 0.05, rates
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert abs((train[:, a] * train[:, b]).mean() - rates[a] * rates[b]) < 0.03
    skewed = presence_flags(0, "train", range(1797), Presence(image=0.1, dna=0.9, clip=0.3)).double().mean(0)
    assert (skewed - torch.tensor([0.1, 0.9, 0.3], dtype=torch.float64)).abs().max() < 0.05, skewed
    with pytest.raises(ValueError, match="presence.clip=1.5"):
        Presence(clip=1.5)


def test_absent_modalities_are_zero_and_their_facts_unsupervised(shards, heldout, pairs):
    batch, reference = whole(heldout), whole(pairs)
    has_image, has_dna, has_clip = batch["has_image"], batch["has_dna"], batch["has_clip"]
    for flag in (has_image, has_dna, has_clip):  # 176 samples: every modality both present and absent
        assert 0.3 < flag.double().mean() < 0.9
    assert torch.equal(batch["index"], reference["index"])
    rows = torch.arange(len(batch["index"]))
    labels, tokens = batch["labels"], batch["tokens"]

    # Image: zeroed where absent; the digit is in the text but supervised only with its image.
    assert torch.equal(batch["images"][has_image], reference["images"][has_image])
    assert (batch["images"][~has_image] == 0).all() and (reference["images"].flatten(1).amax(1) > 0).all()
    digit = batch["label"] + ord("0")
    assert torch.equal(tokens[rows, batch["digit_position"] + 1], digit)
    assert torch.equal(labels[rows, batch["digit_position"]], torch.where(has_image, digit, IGNORE_INDEX))

    # DNA: zeroed where absent; the GC clause only with the DNA, supervised at gc_position.
    for key in ("dna", "dna_regions"):
        assert torch.equal(batch[key][has_dna], reference[key][has_dna])
        assert (batch[key][~has_dna] == 0).all()
    assert torch.equal(batch["gc"], torch.where(has_dna, reference["gc"], -1))
    assert torch.equal(batch["gc_position"], torch.where(has_dna, reference["gc_position"], -1))
    gc_rows = rows[has_dna]
    assert torch.equal(labels[gc_rows, batch["gc_position"][has_dna]], reference["gc"][has_dna] + ord("0"))

    # Clip: zeroed where absent; its frames are those of clip_index; its clause is never supervised.
    assert (batch["clips"][~has_clip] == 0).all() and (batch["clip_index"][~has_clip] == -1).all()
    clips = {s["json"]["index"]: torch.from_numpy(s["npy"]) for s in read_split(shards["clips"], "heldout")}
    for row in rows[has_clip].tolist():
        assert torch.equal(batch["clips"][row], clips[int(batch["clip_index"][row])])
    assert batch["clips"].shape == (len(rows), 12, 1, 16, 16) and batch["clips"].dtype == torch.float32

    for row in rows.tolist():
        text = caption_text(tokens[row])
        assert (" gc " in text) == bool(has_dna[row]) and (" clip: " in text) == bool(has_clip[row])
        # Labels: next bytes of the digit's caption and GC clause, less the digit without its image.
        supervised = text.split(" clip: ")[0].encode()
        expected = torch.full_like(labels[row], IGNORE_INDEX)
        expected[PLACEHOLDERS : PLACEHOLDERS + len(supervised) - 1] = torch.tensor(list(supervised[1:]))
        if not has_image[row]:
            expected[batch["digit_position"][row]] = IGNORE_INDEX
        assert torch.equal(labels[row], expected), text


def test_clip_clause_names_scene_zero_of_its_clip(heldout, scenes):
    batch = whole(heldout)
    for row in torch.nonzero(batch["has_clip"]).flatten().tolist():
        index, clip = int(batch["index"][row]), int(batch["clip_index"][row])
        assert clip == index * CLIP_STRIDE % HELDOUT_CLIPS
        match = re.fullmatch(r".* clip: (\d) on (\w+)\.", caption_text(batch["tokens"][row]))
        assert match and match.groups() == (str(scenes[clip]["label"]), scenes[clip]["texture"])


def test_certain_presence_reproduces_digit_dna_batches_and_zero_removes_everything(shards, seq_len, pairs):
    reference = whole(pairs)
    full = whole(loader(shards, seq_len, presence=Presence(image=1.0, dna=1.0, clip=0.5)))
    assert full["has_image"].all() and full["has_dna"].all()
    for key in ("images", "dna", "dna_regions", "gc", "gc_position", "digit_position", "labels", "label"):
        assert torch.equal(full[key], reference[key]), key
    # Tokens too, but where a clip is present its clause follows, over what is padding in DigitDnaBatches.
    has_clip, same = full["has_clip"], full["tokens"] == reference["tokens"]
    assert 0 < has_clip.sum() < len(has_clip) and same[~has_clip].all()
    assert (reference["tokens"][~same] == PAD_TOKEN).all()
    for row in torch.nonzero(has_clip).flatten().tolist():
        assert bytes(full["tokens"][row][~same[row]].tolist()).decode().startswith(" clip: ")

    none = loader(shards, PLACEHOLDERS + 23, presence=Presence(0.0, 0.0, 0.0))  # room for the digit alone
    batch = whole(none)
    assert not (batch["has_image"] | batch["has_dna"] | batch["has_clip"]).any()
    for key in ("images", "dna", "dna_regions", "clips"):
        assert (batch[key] == 0).all(), key
    assert (batch["gc_position"] == -1).all() and (batch["clip_index"] == -1).all()
    for row, tokens in enumerate(batch["tokens"]):
        assert re.fullmatch(r"[a-z ,]*\d[a-z ,]*\.", caption_text(tokens))  # the digit's caption alone
        assert batch["labels"][row, batch["digit_position"][row]] == IGNORE_INDEX


def test_seq_len_too_short_for_the_longest_caption_is_a_clear_error(shards, seq_len):
    with pytest.raises(ValueError, match=rf"seq_len={seq_len - 1} .* must be at least {seq_len}"):
        loader(shards, seq_len - 1)
