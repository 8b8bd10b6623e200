"""KV-cache memory policies of the frame-chunk video generator: which frames each policy keeps.

The scripted streams use one-hot keys so every cosine is exactly 0 or 1, and the expected cache after
each admit is worked out by hand from the policy's rule (the comments give the reasoning).
"""

import math
import pytest
import torch

from hetero.errors import ConfigError
from hetero.models.video.memory import POLICIES, FrameMemory, MemoryConfig

A, B, S = torch.eye(4)[0], torch.eye(4)[1], torch.eye(4)[2]
STREAM = [A] * 4 + [B] * 8 + [A] * 4  # frames 0-3 show content A, 4-11 B, 12-15 A again


def run(memory: FrameMemory, keys: list[torch.Tensor], scores: list[float] | None = None) -> list[list[int]]:
    """Admit ``keys`` as frames 0, 1, ...; the cache after each admit."""
    after = []
    for frame, key in enumerate(keys):
        memory.admit(frame, key, None if scores is None else scores[frame])
        after.append(memory.kept)
    return after


def test_full_keeps_every_frame_at_its_own_position():
    memory = FrameMemory(MemoryConfig(policy="full", budget=4))
    assert run(memory, STREAM) == [list(range(t + 1)) for t in range(16)]
    assert memory.positions() == list(range(16))


def test_sliding_keeps_the_last_budget_frames():
    memory = FrameMemory(MemoryConfig(policy="sliding", budget=4))
    assert run(memory, STREAM[:7]) == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2, 3],
        [1, 2, 3, 4],
        [2, 3, 4, 5],
        [3, 4, 5, 6],
    ]
    assert memory.admit(7, B) == [3]
    assert memory.positions() == [0, 1, 2, 3]


def test_sink_window_keeps_the_first_frames_and_the_last_ones():
    memory = FrameMemory(MemoryConfig(policy="sink_window", budget=4, sink=1))
    assert run(memory, STREAM[:7]) == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2, 3],
        [0, 2, 3, 4],
        [0, 3, 4, 5],
        [0, 4, 5, 6],
    ]
    assert memory.admit(7, B) == [4]


def test_slow_fast_scripted_stream():
    # budget 6 = sink 1 + window 2 + slow capacity 3. A leaving frame enters slow memory only if it differs
    # from the last keyframe (or from sink frame 0 while slow is empty).
    memory = FrameMemory(MemoryConfig(policy="slow_fast", budget=6, sink=1, window=2, similarity=0.95))
    assert run(memory, STREAM) == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 2, 3],  # 1 (A) leaves the window; like sink 0 (A): dropped
        [0, 3, 4],  # 2 (A) dropped
        [0, 4, 5],  # 3 (A) dropped
        [0, 4, 5, 6],  # 4 (B) unlike sink 0: the first keyframe
        [0, 4, 6, 7],  # 5 (B) like keyframe 4: dropped, and so on through the B stretch
        [0, 4, 7, 8],
        [0, 4, 8, 9],
        [0, 4, 9, 10],
        [0, 4, 10, 11],
        [0, 4, 11, 12],
        [0, 4, 12, 13],  # 11 (B) still like keyframe 4
        [0, 4, 12, 13, 14],  # 12 (A) unlike keyframe 4: the second keyframe
        [0, 4, 12, 14, 15],  # 13 (A) like keyframe 12: dropped
    ]
    assert (memory.sink, memory.slow, memory.fast) == ([0], [4, 12], [14, 15])
    assert memory.positions() == [0, 1, 2, 3, 4]


def test_slow_fast_full_slow_memory_drops_the_oldest_of_equally_redundant_keyframes():
    # budget 4 = sink 1 + window 1 + slow capacity 2; alternating keys make every leaving frame a keyframe,
    # and every keyframe repeats another kept frame, so the oldest goes.
    memory = FrameMemory(MemoryConfig(policy="slow_fast", budget=4, sink=1, window=1))
    kept, evicted = [], []
    for frame, key in enumerate([A, B, A, B, A, B]):
        evicted.append(memory.admit(frame, key))
        kept.append(memory.kept)
    assert kept == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 2, 3, 4], [0, 3, 4, 5]]
    assert evicted == [[], [], [], [], [1], [2]]
    assert (memory.sink, memory.slow, memory.fast) == ([0], [3, 4], [5])


def test_slow_fast_full_slow_memory_drops_its_most_redundant_keyframe():
    # budget 4 = sink 1 + window 1 + slow capacity 2. Keyframes 1 (scene A), 2 (scene B) and 3 (B, moved:
    # cosine 0.9 with 2, a keyframe under similarity 0.95): 2 and 3 are the redundant pair, so the older of
    # them goes and the only keyframe of A stays (oldest-first would have dropped it).
    s, a, b, c = torch.eye(5)[:4]
    b_moved = 0.9 * b + math.sqrt(1 - 0.81) * c
    keys = [s, a, b, b_moved, torch.eye(5)[4]]
    memory = FrameMemory(MemoryConfig(policy="slow_fast", budget=4, sink=1, window=1, similarity=0.95))
    evicted = [memory.admit(frame, key) for frame, key in enumerate(keys)]
    assert evicted[-1] == [2]
    assert (memory.sink, memory.slow, memory.fast) == ([0], [1, 3], [4])


@pytest.mark.parametrize("similarity, keyframe", [(0.9, True), (0.7, False)])
def test_slow_fast_threshold_is_on_the_cosine(similarity, keyframe):
    # frame 1's key is at cosine 0.8 to sink frame 0's: a keyframe under 0.9, a duplicate under 0.7
    memory = FrameMemory(MemoryConfig(policy="slow_fast", budget=3, sink=1, window=1, similarity=similarity))
    for frame, key in enumerate(
        [torch.tensor([1.0, 0.0]), torch.tensor([0.8, 0.6]), torch.tensor([0.0, 1.0])]
    ):
        memory.admit(frame, key)
    assert memory.slow == ([1] if keyframe else [])


def test_slow_fast_without_slow_room_is_sink_window():
    def kept(config):
        memory = FrameMemory(config)
        return run(memory, [A, B] * 6)

    assert kept(MemoryConfig(policy="slow_fast", budget=3, sink=1, window=2)) == kept(
        MemoryConfig(policy="sink_window", budget=3, sink=1)
    )


def test_slow_fast_without_sink_takes_the_first_leaving_frame_as_keyframe():
    memory = FrameMemory(MemoryConfig(policy="slow_fast", budget=3, sink=0, window=1))
    run(memory, [A, A, A, B])
    # 0 (A) leaves with nothing to compare: keyframe; 1, 2 (A) like it: dropped; 3 is the fast window
    assert (memory.sink, memory.slow, memory.fast) == ([], [0], [3])


def test_slow_fast_keeps_an_early_keyframe_that_sliding_forgets():
    keys = [S] + [A] * 3 + [B] * 96  # a sink frame, a short A shot, then a long B stretch
    slow_fast = FrameMemory(MemoryConfig(policy="slow_fast", budget=6, sink=1, window=3))
    sliding = FrameMemory(MemoryConfig(policy="sliding", budget=6))
    run(slow_fast, keys)
    run(sliding, keys)
    assert slow_fast.slow == [1, 4]  # the first A frame and the first B frame
    assert 1 in slow_fast.kept
    assert all(frame >= 4 for frame in sliding.kept)  # no A frame left


def test_learned_scripted_stream():
    # The router scores A frames 0.9 and B frames 0.2 at admit; no re-scoring. Budget 4, fast window 2:
    # over budget, the lowest-scored frame older than the window goes, the oldest on ties.
    scores = [0.9 if key is A else 0.2 for key in STREAM]
    memory = FrameMemory(MemoryConfig(policy="learned", budget=4, window=2))
    assert run(memory, STREAM, scores) == [
        [0],
        [0, 1],
        [0, 1, 2],
        [0, 1, 2, 3],
        [1, 2, 3, 4],  # 0, 1, 2 tie at 0.9: the oldest goes
        [2, 3, 4, 5],
        [2, 3, 5, 6],  # 4 (0.2) has left the window and is the lowest
        [2, 3, 6, 7],
        [2, 3, 7, 8],
        [2, 3, 8, 9],
        [2, 3, 9, 10],
        [2, 3, 10, 11],
        [2, 3, 11, 12],
        [2, 3, 12, 13],
        [3, 12, 13, 14],  # 2, 3, 12 tie at 0.9: the oldest goes
        [12, 13, 14, 15],
    ]


@pytest.mark.parametrize("frame0_score, frame0_kept", [(1.0, True), (0.0, False)])
def test_learned_keeps_the_frame_the_router_keeps_scoring_high(frame0_score, frame0_kept):
    # Every frame arrives at 0.5; after each admit the router re-scores the cache: frame 0 at
    # frame0_score, the rest at 0.1. Each older frame's EMA falls below the next one's, so the frame that
    # leaves the window is the first to go; frame 0 re-scored at 0 sinks lowest and goes first.
    memory = FrameMemory(MemoryConfig(policy="learned", budget=4, window=2, ema=0.5))
    for frame in range(40):
        evicted = memory.admit(frame, A, 0.5)
        memory.update_importance({f: frame0_score if f == 0 else 0.1 for f in memory.kept})
        if frame >= 4:
            assert evicted == ([frame - 3] if frame0_kept else [frame - 4]), frame
    assert memory.kept == ([0, 37, 38, 39] if frame0_kept else [36, 37, 38, 39])


def test_learned_importance_is_an_ema_of_router_scores():
    memory = FrameMemory(MemoryConfig(policy="learned", budget=4, window=1, ema=0.75))
    memory.admit(0, A, 0.8)
    memory.admit(1, A)  # unscored: presumed important
    assert memory.importance == pytest.approx({0: 0.8, 1: 1.0})
    memory.update_importance({0: 0.0})
    assert memory.importance[0] == pytest.approx(0.6)
    memory.update_importance({0: 1.0, 1: 0.0})
    assert memory.importance == pytest.approx({0: 0.7, 1: 0.75})


def stress(policy: str, frames: int) -> FrameMemory:
    """Admit ``frames`` random frames (random keys and router scores, re-scored each step), checking the
    invariants after every admit."""
    config = MemoryConfig(policy=policy, budget=8, sink=2, window=3, similarity=0.3)
    memory = FrameMemory(config)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(frames, 4, generator=gen)
    scores = torch.rand(frames, generator=gen).tolist()
    before: list[int] = []
    for frame in range(frames):
        evicted = memory.admit(frame, keys[frame], scores[frame])
        kept = memory.kept
        assert kept == sorted(kept) and kept[-1] == frame
        assert sorted(kept + evicted) == before + [frame]  # evicted frames were cached, nothing else vanished
        assert len(kept) <= config.budget or policy == "full"
        memory.update_importance({f: scores[(f * 7 + frame) % frames] for f in kept})
        before = kept
    return memory


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_holds_over_a_long_stream(policy):
    memory = stress(policy, 200)
    if policy == "full":
        assert memory.kept == list(range(200))
    else:
        assert len(memory.kept) == 8


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "full"])
def test_positions_stay_below_the_budget(policy):
    memory = stress(policy, 2000)
    assert memory.kept[-1] == 1999  # frame indices far beyond anything seen in training...
    assert memory.positions() == list(range(len(memory.kept)))  # ...but positions are slots
    assert max(memory.positions()) < 8


def test_reset_starts_a_new_stream():
    memory = FrameMemory(MemoryConfig(policy="sliding", budget=2))
    run(memory, [A, A, A])
    memory.reset()
    assert memory.kept == []
    assert memory.admit(0, torch.ones(7)) == []  # frame 0 and a new key size are fine again
    assert memory.kept == [0]


@pytest.mark.parametrize("frames", [[3, 3], [3, 2], [-1]])
def test_out_of_order_frames_are_refused(frames):
    memory = FrameMemory(MemoryConfig())
    for frame in frames[:-1]:
        memory.admit(frame, A)
    with pytest.raises(ValueError, match=rf"admit\(frame={frames[-1]}\).*increasing order"):
        memory.admit(frames[-1], A)


def test_bad_keys_and_scores_are_refused():
    memory = FrameMemory(MemoryConfig(policy="learned", budget=2, window=1))
    memory.admit(0, A)
    with pytest.raises(ValueError, match="shape"):
        memory.admit(1, torch.ones(2, 4))
    with pytest.raises(ValueError, match="entries"):
        memory.admit(1, torch.ones(5))
    with pytest.raises(ValueError, match=r"importance score 1\.5"):
        memory.admit(1, A, 1.5)
    with pytest.raises(ValueError, match="frame 9 is not in the cache"):
        memory.update_importance({9: 0.5})
    assert memory.kept == [0]  # refused admits leave the books untouched


def test_slow_fast_views_belong_to_slow_fast():
    memory = FrameMemory(MemoryConfig(policy="sink_window"))
    with pytest.raises(AttributeError, match="policy=slow_fast"):
        memory.slow


@pytest.mark.parametrize("policy", POLICIES)
def test_defaults_are_valid(policy):
    assert MemoryConfig(policy=policy).errors("memory") == []


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"budget": 0}, "memory.budget=0 must be > 0"),
        ({"budget": -3, "policy": "full"}, "memory.budget=-3"),
        ({"policy": "learned", "budget": 4, "window": 6}, "memory.window=6 exceeds budget=4"),
        ({"policy": "slow_fast", "budget": 4, "window": 6}, "memory.window=6 exceeds budget=4"),
        ({"policy": "slow_fast", "budget": 4, "sink": 5, "window": 1}, "memory.sink=5 + window=1"),
        ({"policy": "slow_fast", "budget": 4, "sink": 2, "window": 3}, "memory.sink=2 + window=3"),
        ({"policy": "sink_window", "budget": 4, "sink": 4}, "memory.sink=4 fills the whole budget=4"),
        ({"sink": -1}, "memory.sink=-1"),
        ({"policy": "slow_fast", "window": 0}, "memory.window=0"),
        ({"policy": "lru"}, "memory.policy='lru' is not one of full, sliding, sink_window"),
        ({"similarity": 1.5}, "memory.similarity=1.5"),
        ({"similarity": -1.0}, "memory.similarity=-1.0"),
        ({"ema": 1.0}, "memory.ema=1.0"),
        ({"ema": -0.1}, "memory.ema=-0.1"),
    ],
)
def test_invalid_settings_name_the_field(settings, message):
    with pytest.raises(ConfigError) as info:
        FrameMemory(MemoryConfig(**settings))
    assert message in str(info.value)


def test_every_error_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        FrameMemory(MemoryConfig(budget=0, ema=1.0))
    assert str(info.value).splitlines() == [
        MemoryConfig(budget=0).errors("memory")[0],
        MemoryConfig(ema=1.0).errors("memory")[0],
    ]


def test_windows_are_checked_only_for_the_policies_that_use_them():
    # sliding ignores sink and window, learned ignores sink: neither may be refused for them
    assert MemoryConfig(policy="sliding", budget=2, sink=5, window=9).errors("memory") == []
    assert MemoryConfig(policy="learned", budget=4, sink=9, window=4).errors("memory") == []
