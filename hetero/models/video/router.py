"""The learned memory's importance router (L2M-style) and the soft memory it is trained through.

The router scores a cached frame ``j`` each time a frame ``t`` is admitted, from the two frames' summary
keys, how alike they are, how far apart, and where ``j`` sits in the stream. The memory folds those
scores into an EMA importance per frame and evicts the lowest (``video_memory.FrameMemory``, policy
``learned``). Eviction is not differentiable, so training uses a soft memory instead: every earlier frame
stays visible, and attention to a frame older than the fast window adds ``log(importance + EPS)``, so an
unimportant frame fades out of the attention the way eviction removes it. A sparsity penalty on the
importance pushes the soft memory towards the few frames the hard budget can keep. Generation applies
the same log-importance bias to the frames actually kept, so the model sees what it was trained on.
"""

from __future__ import annotations

import math

import torch
from torch import nn

EPS = 1e-3  # floor inside the log: an importance of 0 is a bias of log(EPS) ≈ -6.9, not -inf
INDEX_SCALE = math.log1p(64)  # stream positions are fed as log1p(index) / INDEX_SCALE
PERIODS = (2.0, 4.0, 8.0, 16.0)  # sinusoidal features of a frame's index


def index_features(frames: torch.Tensor) -> torch.Tensor:
    """(n,) frame indices -> (n, 1 + 2·len(PERIODS)) features."""
    f = frames.to(torch.float32)[:, None]
    angles = 2 * math.pi * f / torch.tensor(PERIODS, device=f.device)
    return torch.cat([torch.log1p(f) / INDEX_SCALE, angles.sin(), angles.cos()], 1)


class ImportanceRouter(nn.Module):
    """Scores in (0, 1) for cached frames as each new frame arrives; a small MLP over pair features."""

    def __init__(self, key_size: int, width: int = 64):
        super().__init__()
        inputs = 2 * key_size + 2 + 2 * (1 + 2 * len(PERIODS))
        self.net = nn.Sequential(nn.Linear(inputs, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(),
                                 nn.Linear(width, 1))

    def forward(
        self, cached: torch.Tensor, cached_frames: torch.Tensor, current: torch.Tensor, current_frames: torch.Tensor
    ) -> torch.Tensor:
        """``cached`` (n, d) keys of frames ``cached_frames`` (n,), ``current`` (m, d) keys of the frames
        being admitted ``current_frames`` (m,) -> scores (n, m). Keys are detached: the router learns
        what to keep without moving the generator's embedding."""
        cached, current = cached.detach(), current.detach()
        n, m = cached.shape[0], current.shape[0]
        cosine = torch.nn.functional.cosine_similarity(cached[:, None], current[None], dim=-1)
        age = (current_frames[None] - cached_frames[:, None]).clamp(min=0).to(torch.float32)
        features = torch.cat([
            cached[:, None].expand(n, m, -1),
            current[None].expand(n, m, -1),
            cosine[..., None],
            (torch.log1p(age) / INDEX_SCALE)[..., None],
            index_features(cached_frames)[:, None].expand(n, m, -1),
            index_features(current_frames)[None].expand(n, m, -1),
        ], -1)
        return torch.sigmoid(self.net(features)[..., 0])

    def clip_scores(self, summaries: torch.Tensor) -> torch.Tensor:
        """(T, d) summaries of one clip's frames -> (T, T) scores, [j, t]: frame j when t is admitted."""
        frames = torch.arange(summaries.shape[0], device=summaries.device)
        return self(summaries, frames, summaries, frames)


def ema_importance(scores: torch.Tensor, ema: float) -> torch.Tensor:
    """EMA importance from router scores (T, T): entry [j, t] is frame j's importance once frame t is
    admitted, ``s[j, j]`` at admission and ``ema · I + (1 - ema) · s[j, t]`` after each later frame —
    what ``FrameMemory.update_importance`` tracks, for every frame and step at once (zero for t < j)."""
    count = scores.shape[0]
    steps = torch.arange(count, device=scores.device)
    gap = (steps[None] - steps[:, None]).to(scores.dtype)  # [u, t] = t - u
    later = gap >= 0
    decay = torch.where(later, torch.full_like(gap, ema) ** gap.clamp(min=0), torch.zeros_like(gap))
    folded = torch.triu(scores, 1) @ ((1 - ema) * decay)  # Σ over later frames u of (1-ema)·ema^(t-u)·s[j,u]
    return (folded + scores.diagonal()[:, None] * decay) * later


def log_importance(importance: torch.Tensor) -> torch.Tensor:
    return torch.log(importance + EPS)


def memory_frame_bias(importance: torch.Tensor, window: int) -> torch.Tensor:
    """(T, T) score bias, [q, j]: what frame q (being made) adds to its attention on frame j: the
    log-importance j has once q-1 is admitted, for frames older than the fast window; 0 otherwise."""
    count = importance.shape[0]
    q = torch.arange(count, device=importance.device)[:, None]
    j = torch.arange(count, device=importance.device)[None]
    previous = torch.cat([importance.new_ones(count, 1), importance[:, :-1]], 1).T  # [q, j] = I[j, q-1]
    return torch.where(j < q - window, log_importance(previous), torch.zeros_like(previous))


def sparsity(importance: torch.Tensor, window: int) -> torch.Tensor:
    """Mean importance of the frames that some later frame sees outside its fast window (entry [j, t]
    biases frame t+1 when j < t+1 - window): the L1 pull towards a memory that keeps few old frames."""
    count = importance.shape[0]
    j = torch.arange(count, device=importance.device)[:, None]
    t = torch.arange(count, device=importance.device)[None]
    old = (j + window <= t) & (t < count - 1)
    return importance[old].mean() if bool(old.any()) else importance.sum() * 0
