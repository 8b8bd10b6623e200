"""The region budget: how GeneZip routes intergenic and coding DNA at their own bases-per-token targets
from raw bases.

The Region-Aware Ratio loss alone does not separate the regions: its gradient reaches the router only
through the mean boundary probability of each region, the router sees no region label, and coding DNA
(about 89% of the training bases) dominates the shared weights, so both regions end near one average rate.
The budget adds what the router lacks:

- a causal **region classifier** (dilated convolutions over the bases, their reading-frame stop-codon
  distances and codon-position composition) trained by cross-entropy on the annotations (loss part
  ``region``); at inference it reads raw DNA only;
- a **router bias per predicted region**: stage 1's boundary probability becomes
  ``sigmoid(logit p + bias[k])`` with k the classifier's call (coding when its logit exceeds the log-odds
  of coding in the training data seen so far). The shifted probability chooses the chunk starts and feeds
  the de-chunker; the ratio loss keeps training the router on p itself (``model.py`` says why);
- a **controller** that sets the two biases after every optimizer step. From the step's counts (bases and
  chunk starts per true × predicted region) it keeps an EMA, reads each true region's rate error
  ``e = log(achieved / wanted)`` and the share ``S[r][k]`` of region r's chunk starts that fall in call k
  (how far bias k moves region r's log-rate), and steps the biases by ``-gain · S⁻¹ e``. While the calls
  do not yet separate the regions (det S small) both biases move together toward the overall target; a
  bias at its limit (a region the router cannot thin further) holds, and the other bias takes the
  least-squares step for both regions' errors. After warm-up the gain anneals with the learning rate:
  the EMA reads the last ~10 noisy batches (a batch's intergenic rate ranges over 4.5-18 bases per token),
  and at a constant gain the biases end on that noise (at one seed intergenic DNA ended 10% over its
  target on the whole training split, 13% held out); annealed, they settle as the weights do.

The counts are loss parts, so the runtime sums them over microbatches and ranks before ``update``: every
replica applies the same update and the state (buffers, checkpointed with the model) stays identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.data.genome import BASES

# Codon ids (base-5 over BASES = ACGTN) of the stop codons, read forward and as reverse complements.
_A, _C, _G, _T = (BASES.index(b) for b in "ACGT")
_FORWARD_STOPS = tuple(25 * x + 5 * y + z for x, y, z in ((_T, _A, _A), (_T, _A, _G), (_T, _G, _A)))
_REVERSE_STOPS = tuple(25 * x + 5 * y + z for x, y, z in ((_T, _T, _A), (_C, _T, _A), (_T, _C, _A)))
COMPOSITION_WINDOWS = (48, 192)
FEATURES = len(BASES) + 8 + 12 * len(COMPOSITION_WINDOWS)
# Bases, then chunk starts, per (true region, predicted region): the loss parts ``update`` reads. Region
# ids follow ``REGIONS`` (intergenic 0, coding 1).
STATISTICS = tuple(f"{count}_{r}{k}" for count in ("bases", "starts") for r in (0, 1) for k in (0, 1))
CLASSIFIER_DILATIONS = (1, 2, 4, 8, 16, 32, 64)
EMA = 0.1
# Past the router's largest log-odds (its probability is clamped to 1 - 1e-6: 13.8), so a bias can thin a
# region down to the forced chunk starts: the router's confident starts otherwise outrun a smaller limit.
BIAS_LIMIT = 16.0
SEPARATION = 0.2  # the least determinant of the calls' start shares for which the controller steers each region


def reading_frame_features(bases: torch.Tensor) -> torch.Tensor:
    """(batch, length, 8), causal: per reading frame, relative to the codon ending at t, log(1 + bases
    since that frame's last stop codon), forward strand then reverse complement, then each strand's
    longest open frame; over 6."""
    b = bases.long()
    batch, length = b.shape
    codon = torch.full_like(b, -1)
    codon[:, 2:] = 25 * b[:, :-2] + 5 * b[:, 1:-1] + b[:, 2:]
    position = torch.arange(length, device=b.device).expand(batch, length)
    relative = (position[..., None] - torch.arange(3, device=b.device)) % 3
    strands = []
    for stops in (_FORWARD_STOPS, _REVERSE_STOPS):
        stop = torch.isin(codon, torch.tensor(stops, device=b.device))
        since = []
        for frame in range(3):
            last = torch.where(stop & (position % 3 == frame), position, -1).cummax(1).values
            since.append((position - last).float())
        strands.append(torch.stack(since, -1).gather(-1, relative).log1p())
    forward, reverse = strands
    longest = [s.max(-1, keepdim=True).values for s in strands]
    return torch.cat([forward, reverse, *longest], -1) / 6


def codon_composition_features(bases: torch.Tensor) -> torch.Tensor:
    """(batch, length, 12 per window), causal: over the last W bases, the share of A, C, G and T at the
    positions in phase with t, t-1 and t-2 (coding DNA's codon positions differ in composition)."""
    b = bases.long()
    batch, length = b.shape
    onehot = F.one_hot(b.clamp(max=3), 4).float() * (b < 4)[..., None]
    position = torch.arange(length, device=b.device)
    phase_of = (position[:, None] - torch.arange(3, device=b.device)) % 3
    out = []
    for window in COMPOSITION_WINDOWS:
        counts = []
        for phase in range(3):
            running = (onehot * (position % 3 == phase)[None, :, None]).cumsum(1)
            counts.append(running - F.pad(running, (0, 0, window, 0))[:, :length])
        counts = torch.stack(counts, 2).gather(2, phase_of[None, :, :, None].expand(batch, length, 3, 4))
        out.append((counts / counts.sum(-1, keepdim=True).clamp(min=1)).flatten(2))
    return torch.cat(out, -1)


def region_features(bases: torch.Tensor) -> torch.Tensor:
    onehot = F.one_hot(bases.long(), len(BASES)).float()
    return torch.cat([onehot, reading_frame_features(bases), codon_composition_features(bases)], -1)


class RegionClassifier(nn.Module):
    """Causal residual dilated convolutions (dilations 1..64, a receptive field of 255 bases); the logit
    that base t is coding, from bases <= t."""

    def __init__(self, channels: int, dilations: tuple[int, ...] = CLASSIFIER_DILATIONS):
        super().__init__()
        self.dilations = dilations
        self.input = nn.Linear(FEATURES, channels)
        self.convs = nn.ModuleList(nn.Conv1d(channels, channels, 3, dilation=d) for d in dilations)
        self.output = nn.Linear(channels, 1)

    def forward(self, bases: torch.Tensor) -> torch.Tensor:
        h = self.input(region_features(bases)).transpose(1, 2)
        for conv, dilation in zip(self.convs, self.dilations):
            h = h + F.gelu(conv(F.pad(h, (2 * dilation, 0))))
        return self.output(h.transpose(1, 2)).squeeze(-1)


class RegionBudget(nn.Module):
    """The classifier, the bias per predicted region, and the controller's state (see the module doc)."""

    def __init__(self, targets: torch.Tensor, channels: int, gain: float):
        super().__init__()
        self.classifier = RegionClassifier(channels)
        self.gain = gain
        self.register_buffer("wanted", 1 / targets.float())  # chunk starts per base, per true region
        self.register_buffer("bias", torch.zeros(2))
        # EMA of each step's STATISTICS as shares of the step's bases (the scale the counts came at drops out)
        self.register_buffer("counts", torch.zeros(len(STATISTICS), dtype=torch.float64))
        self.register_buffer("seen", torch.zeros(2, dtype=torch.float64))  # training bases per true region
        self.register_buffer("updates", torch.zeros((), dtype=torch.long))

    def forward(self, bases: torch.Tensor) -> torch.Tensor:
        return self.classifier(bases)

    def called_coding(self, logits: torch.Tensor) -> torch.Tensor:
        seen = self.seen.clamp(min=torch.finfo(self.seen.dtype).tiny)  # log-odds 0 before any update
        threshold = torch.log(seen[1] / seen[0]).float()
        return logits.detach() > threshold

    def router_bias(self, logits: torch.Tensor) -> torch.Tensor:
        return self.bias[self.called_coding(logits).long()]

    def statistics(self, logits: torch.Tensor, boundary: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
        """The ``STATISTICS`` counts of a batch (float64)."""
        called = self.called_coding(logits)
        cells = [(regions == r) & (called == bool(k)) for r in (0, 1) for k in (0, 1)]
        return torch.stack([c.sum() for c in cells] + [(c & boundary).sum() for c in cells]).double()

    @torch.no_grad()
    def update(self, statistics: torch.Tensor, decay: float = 1.0) -> None:
        """One controller step from a step's ``STATISTICS`` summed over every microbatch and rank (any
        common scale), at the gain times ``decay`` (the learning rate's ``OptimizerConfig.decay_at``). Runs
        without a host sync: a step without DNA rows leaves the state as it was."""
        statistics = statistics.to(self.counts.device)
        total = statistics[:4].sum()
        present = total > 0
        tiny = torch.finfo(self.counts.dtype).tiny
        shares = statistics / total.clamp(min=tiny)
        blended = torch.where(self.updates == 0, shares, (1 - EMA) * self.counts + EMA * shares)
        self.counts.copy_(torch.where(present, blended, self.counts))
        self.seen += statistics[:4].view(2, 2).sum(1)
        self.updates += present.long()

        bases, starts = self.counts[:4].view(2, 2), self.counts[4:].view(2, 2)  # [true region, called region]
        region_bases, region_starts = bases.sum(1), starts.sum(1)
        wanted = self.wanted.double()
        observed = (region_bases > 0) & (region_starts > 0)
        error = torch.where(observed, torch.log(region_starts.clamp(min=tiny) / (region_bases.clamp(min=tiny) * wanted)), 0.0)
        # d log(rate of region r) / d bias[k] ~ the share of region r's starts that fall in call k.
        jacobian = starts / region_starts.clamp(min=tiny)[:, None]
        determinant = jacobian[0, 0] * jacobian[1, 1] - jacobian[0, 1] * jacobian[1, 0]
        adjugate = torch.stack([jacobian[1, 1], -jacobian[0, 1], -jacobian[1, 0], jacobian[0, 0]]).view(2, 2)
        solved = adjugate @ error / determinant.clamp(min=SEPARATION)
        # Calls that do not yet separate the regions: one shift for both, toward the bases' overall target.
        pooled = torch.log(region_starts.sum().clamp(min=tiny) / (region_bases * wanted).sum().clamp(min=tiny))
        separated = determinant > SEPARATION
        bias = self.bias.double()
        gain = self.gain * decay
        delta = -gain * torch.where(separated, solved, pooled.expand(2))
        # A bias the step would push past its limit holds there, and the other takes the least-squares step
        # for both regions' errors (without this, the held region's error winds the other bias past its own
        # target). held[k]: bias k's step to its limit; other[k]: the other bias's step while k holds.
        held = (bias + delta).clamp(-BIAS_LIMIT, BIAS_LIMIT) - bias
        other = torch.stack([
            -(jacobian[:, 1 - k] @ (gain * error + jacobian[:, k] * held[k]))
            / (jacobian[:, 1 - k] @ jacobian[:, 1 - k]).clamp(min=tiny)
            for k in (0, 1)
        ])
        over = separated & ((bias + delta).abs() > BIAS_LIMIT)
        delta = torch.where(over[0] & ~over[1], torch.stack([held[0], other[0]]), delta)
        delta = torch.where(over[1] & ~over[0], torch.stack([other[1], held[1]]), delta)
        self.bias.copy_(torch.where(present, bias + delta, bias).clamp(-BIAS_LIMIT, BIAS_LIMIT).float())
