"""Which past frames an autoregressive video generator keeps in its KV cache, under a fixed frame budget.

The generator produces (or consumes) one frame at a time and attends to the frames its cache holds. Each
frame arrives with a summary key (e.g. the mean of its attention keys, shape ``(d,)``) and, for the
learned policy, a router's importance score in [0, 1]. ``FrameMemory`` only keeps the books: after each
admitted frame it names the frames to evict, and the model drops their keys and values. Policies::

    full         every frame (a reference; unbounded)
    sliding      the last ``budget`` frames
    sink_window  the first ``sink`` frames forever, plus the last ``budget - sink``
    slow_fast    sink frames + slow keyframes + a fast window of the last ``window`` frames: a frame leaving
                 the fast window becomes a keyframe only if its key differs enough from the last keyframe's,
                 so a long static stretch costs one slot instead of all of them, and a full slow memory
                 drops its most redundant keyframe (Context Forcing)
    learned      the last ``window`` frames, plus the older frames with the highest EMA importance (L2M)

Every bounded policy hands the model positions ``0..len(kept)-1`` (slot order) rather than frame indices,
so a generator trained on ``budget`` frames never meets a position it has not seen, however long the video.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetero.errors import ConfigError

POLICIES = ("full", "sliding", "sink_window", "slow_fast", "learned")


@dataclass
class MemoryConfig:
    policy: str = "sliding"  # full | sliding | sink_window | slow_fast | learned
    budget: int = 8  # most frames the cache holds (full: ignored)
    sink: int = 1  # sink_window, slow_fast: the first frames, kept forever
    window: int = 4  # slow_fast, learned: the most recent frames, always kept
    similarity: float = 0.95  # slow_fast: a leaving frame becomes a keyframe when its cosine is below this
    ema: float = 0.9  # learned: importance = ema * old + (1 - ema) * new score

    def errors(self, where: str) -> list[str]:
        """Problems with this block. Each field's own range is checked whatever the policy (a value no
        policy can use is a typo); the checks between fields apply to the policies that read them."""
        found = []
        if self.policy not in POLICIES:
            found.append(f"{where}.policy={self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.budget < 1:
            found.append(f"{where}.budget={self.budget} must be > 0 (frames the KV cache holds)")
        if self.sink < 0:
            found.append(f"{where}.sink={self.sink} must be >= 0 (0: no sink frames)")
        if self.window < 1:
            found.append(
                f"{where}.window={self.window} must be >= 1: the fast window is what keeps the newest frame "
                f"in the cache"
            )
        if not -1 < self.similarity <= 1:
            found.append(
                f"{where}.similarity={self.similarity} must be in (-1, 1]: it bounds a cosine, and at -1 or "
                f"below no frame would ever become a keyframe"
            )
        if not 0 <= self.ema < 1:
            found.append(
                f"{where}.ema={self.ema} must be in [0, 1): at 1 new router scores would never count "
                f"(0: the latest score replaces the old one)"
            )
        if found:
            return found
        if self.policy == "sink_window" and self.sink >= self.budget:
            found.append(
                f"{where}.sink={self.sink} fills the whole budget={self.budget}, leaving no slot for the "
                f"newest frame; sink_window needs sink < budget: lower sink or raise budget"
            )
        if self.policy in ("slow_fast", "learned") and self.window > self.budget:
            found.append(
                f"{where}.window={self.window} exceeds budget={self.budget}: the fast window must fit in the "
                f"budget; lower window or raise budget"
            )
        elif self.policy == "slow_fast" and self.sink + self.window > self.budget:
            found.append(
                f"{where}.sink={self.sink} + window={self.window} exceeds budget={self.budget}: slow_fast "
                f"keeps the sink frames and the fast window at all times; lower sink or window, or raise "
                f"budget"
            )
        return found


class FrameMemory:
    """The frames one generation stream keeps in its KV cache; one instance per stream, ``reset`` between
    videos. Frames are admitted in increasing order (gaps allowed); after each admission at most
    ``budget`` frames are kept (``full``: all), always including the newest."""

    def __init__(self, config: MemoryConfig) -> None:
        found = config.errors("memory")
        if found:
            raise ConfigError("\n".join(found))
        self.config = config
        self.reset()

    def reset(self) -> None:
        """Forget every frame, e.g. before the next video."""
        self._kept: list[int] = []
        self._keys: dict[int, torch.Tensor] = {}
        self._importance: dict[int, float] = {}
        self._admitted = 0
        self._last: int | None = None

    @property
    def kept(self) -> list[int]:
        """Frame indices in the cache, ascending (the order of the cache's slots)."""
        return list(self._kept)

    @property
    def importance(self) -> dict[int, float]:
        """The EMA importance of each kept frame (tracked under every policy; only ``learned`` evicts by
        it)."""
        return {frame: self._importance[frame] for frame in self._kept}

    def positions(self) -> list[int]:
        """Position ids for the kept frames, in ``kept`` order. Bounded policies use the slot order, so
        positions stay below ``budget`` however long the stream; ``full`` uses the frame indices."""
        if self.config.policy == "full":
            return list(self._kept)
        return list(range(len(self._kept)))

    @property
    def sink(self) -> list[int]:
        """slow_fast: the sink frames (the first ``sink`` admitted), kept forever."""
        return self._kept[: self._slow_fast_split()[0]]

    @property
    def slow(self) -> list[int]:
        """slow_fast: the keyframes taken from frames that left the fast window, oldest first."""
        n_sink, n_fast = self._slow_fast_split()
        return self._kept[n_sink : len(self._kept) - n_fast]

    @property
    def fast(self) -> list[int]:
        """slow_fast: the most recent ``window`` frames (fewer until that many follow the sink)."""
        n_fast = self._slow_fast_split()[1]
        return self._kept[len(self._kept) - n_fast :]

    def admit(self, frame: int, key: torch.Tensor, importance: float | None = None) -> list[int]:
        """Add ``frame`` with its summary ``key`` (shape ``(d,)``) and router score, apply the policy and
        return the frames this call evicted (the model drops their keys and values).

        ``importance`` None means 1.0: a frame counts as important until the router has scored it.
        """
        if frame < 0 or (self._last is not None and frame <= self._last):
            after = "frame >= 0" if self._last is None else f"frame > {self._last} (the last admitted)"
            raise ValueError(
                f"admit(frame={frame}): frames must be admitted in increasing order; expected {after}, "
                f"or call reset() to start a new stream"
            )
        self._check_key(frame, key)
        score = 1.0 if importance is None else self._checked_score(frame, importance)
        # Detached so the books never hold an autograd graph; cloned so a buffer the model reuses for the
        # next frame cannot change a stored key.
        self._keys[frame] = key.detach().clone()
        self._importance[frame] = score
        self._kept.append(frame)
        self._admitted += 1
        self._last = frame
        evicted = self._choose_evictions()
        for gone in evicted:
            self._kept.remove(gone)
            del self._keys[gone], self._importance[gone]
        return evicted

    def update_importance(self, scores: dict[int, float]) -> None:
        """Fold new router scores for kept frames into their EMA importance, e.g. after the router re-scores
        the cache each step. Smoothing lets one noisy score neither evict a keyframe nor rescue a stale one."""
        ema = self.config.ema
        for frame, score in scores.items():
            if frame not in self._importance:
                raise ValueError(
                    f"update_importance: frame {frame} is not in the cache (kept: {self._kept}); score only "
                    f"the kept frames, after the admit that may evict them"
                )
            self._importance[frame] = ema * self._importance[frame] + (1 - ema) * self._checked_score(
                frame, score
            )

    def _check_key(self, frame: int, key: torch.Tensor) -> None:
        if key.dim() != 1:
            raise ValueError(f"admit(frame={frame}): key must have shape (d,), got {tuple(key.shape)}")
        if self._keys:
            size = next(iter(self._keys.values())).numel()
            if key.numel() != size:
                raise ValueError(
                    f"admit(frame={frame}): key has {key.numel()} entries but the cached keys have {size}; "
                    f"use one key size per stream, or reset() first"
                )

    @staticmethod
    def _checked_score(frame: int, score: float) -> float:
        if not 0 <= score <= 1:
            raise ValueError(f"frame {frame}: importance score {score} must be in [0, 1]")
        return float(score)

    def _slow_fast_split(self) -> tuple[int, int]:
        """(sink frames, fast frames) at the two ends of ``kept``; the slow keyframes lie between."""
        if self.config.policy != "slow_fast":
            raise AttributeError(
                f"sink/slow/fast describe policy=slow_fast only; this memory's policy is {self.config.policy}"
            )
        n_sink = min(self.config.sink, self._admitted)
        return n_sink, min(self.config.window, self._admitted - n_sink)

    def _choose_evictions(self) -> list[int]:
        """The frames to evict now that the newest one is in ``_kept``."""
        config, kept = self.config, self._kept
        over = len(kept) - config.budget
        if config.policy == "full":
            return []
        if config.policy == "sliding":
            return kept[: max(over, 0)]
        if config.policy == "sink_window":
            return kept[config.sink : config.sink + over] if over > 0 else []
        if config.policy == "slow_fast":
            return self._slow_fast_evictions()
        # learned: everything older than the fast window competes; lowest importance goes, oldest on ties.
        candidates = kept[: len(kept) - config.window]
        return sorted(sorted(candidates, key=lambda f: (self._importance[f], f))[: max(over, 0)])

    def _slow_fast_evictions(self) -> list[int]:
        """The frame that just left the fast window becomes a keyframe if its key is unlike the last
        keyframe's (the last sink frame's while there is none, or unconditionally with no sink either);
        otherwise it is dropped. A full slow memory then drops its most redundant keyframe: the one most
        like another sink frame or keyframe (the oldest of those on ties), so every distinct scene
        keeps a keyframe for as long as the room allows and a long stretch of one scene does not push
        the others out."""
        config = self.config
        n_sink, n_fast = self._slow_fast_split()
        if self._admitted <= config.sink + config.window:
            return []  # nothing has left the fast window yet
        slow = self._kept[n_sink : len(self._kept) - n_fast]  # the old keyframes, then the leaving frame
        leaving, reference = slow[-1], self._kept[: len(self._kept) - n_fast - 1]
        if reference:
            cosine = F.cosine_similarity(self._keys[leaving], self._keys[reference[-1]], dim=0).item()
            if cosine >= config.similarity:
                return [leaving]
        capacity = config.budget - config.sink - config.window
        evicted: list[int] = []
        while len(slow) > capacity:
            held = self._kept[:n_sink] + slow
            keys = torch.stack([self._keys[f] for f in held])
            cosine = F.cosine_similarity(keys[:, None], keys[None], dim=-1).fill_diagonal_(-2.0)
            redundancy = cosine.max(1).values[n_sink:]
            gone = slow[int(torch.argmax(redundancy))]  # argmax takes the first (oldest) maximum
            slow.remove(gone)
            evicted.append(gone)
        return sorted(evicted)
