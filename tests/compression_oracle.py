"""Plain single-process versions of the compressed sums, written from the definitions with loops.

Each function takes every replica's vector at once (a list) and returns the sum the replicas should all
end up with, updating the per-replica error-feedback state lists in place. hetero's multi-rank code must
reproduce them.
"""

import math

import torch


def fitted_two_bits(x, block, rounds=2):
    """2 bits per value: its sign and the nearer of two magnitudes per block, fitted by Lloyd's 1-D k-means on
    the magnitudes (split first at their mean; a magnitude equal to the split goes low), stored in bf16."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), block):
        piece = x[start : start + block]
        sizes = [abs(float(value)) for value in piece]
        split = sum(sizes) / len(sizes)
        for round_ in range(rounds + 1):
            low = [size for size in sizes if size <= split]
            high = [size for size in sizes if size > split]
            levels = (sum(low) / len(low) if low else 0.0, sum(high) / len(high) if high else 0.0)
            if round_ < rounds and high:
                split = (levels[0] + levels[1]) / 2
        levels = [float(torch.tensor(level, dtype=torch.float32).to(torch.bfloat16)) for level in levels]
        for k, value in enumerate(piece):
            magnitude = levels[1] if abs(float(value)) > split else levels[0]
            out[start + k] = -magnitude if float(value) < 0 else magnitude
    return out


def quantize(x, bits, block):
    """Round-to-nearest symmetric quantization with one bf16 scale per block (at 2 bits ``fitted_two_bits``);
    returns the decoded values."""
    if bits == 2:
        return fitted_two_bits(x, block)
    limit = 2 ** (bits - 1) - 1
    out = torch.empty_like(x)
    for start in range(0, x.numel(), block):
        piece = x[start : start + block]
        scale = (piece.abs().max() / limit).to(torch.bfloat16).float()
        if scale == 0:
            out[start : start + block] = 0
            continue
        codes = torch.clamp(torch.floor(piece / scale + 0.5), -limit, limit)
        out[start : start + block] = codes * scale
    return out


def pad(x, multiple):
    extra = math.ceil(x.numel() / multiple) * multiple - x.numel()
    return torch.cat([x, x.new_zeros(extra)])


def topk_sparsify(v, ratio, segment):
    """Keep the round(ratio*segment) largest magnitudes of every segment."""
    k = max(1, round(ratio * segment))
    padded = pad(v, segment).view(-1, segment)
    kept = torch.zeros_like(padded)
    for row in range(padded.shape[0]):
        idx = padded[row].abs().topk(k).indices
        kept[row, idx] = padded[row, idx]
    return kept.view(-1)[: v.numel()]


def topk_sum(vectors, residuals, ratio, segment, bits=None, block=64):
    """Error feedback with segmented top-k: each replica sends top-k of (g + e) and keeps the rest. With
    ``bits``, the kept values (segment after segment, each segment's in index order) are quantized in
    blocks of ``block`` and what the codes leave out stays in the residual too."""
    total = torch.zeros_like(vectors[0])
    for i, g in enumerate(vectors):
        v = g + residuals[i]
        sent = topk_sparsify(v, ratio, segment)
        if bits is not None:
            kept = sent != 0
            values = sent[kept]
            sent = sent.masked_scatter(kept, quantize(pad(values, block), bits, block)[: values.numel()])
        residuals[i] = v - sent
        total += sent
    return total


def shared_topk_sum(vectors, residuals, ratio, segment, chooser, bits=None, owners=None, block=64):
    """Error feedback with top-k entries shared by all: replica ``chooser`` picks them from its g + e (equal
    magnitudes, e.g. zeros, to the lower index), or with ``chooser="union"`` every replica picks its own and
    all of them are shared; every replica sends its g + e at those entries (with ``bits``, their two-phase
    quantized sum, ``owners`` its chunk owners' residuals) and keeps the rest."""
    numel = vectors[0].numel()
    padded = [pad(g + e, segment) for g, e in zip(vectors, residuals)]
    chosen = shared_entries(vectors, residuals, ratio, segment, chooser)
    compact = [v[chosen] for v in padded]
    if bits is None:
        sent, summed = compact, sum(compact)
    else:
        if owners[0].numel() != math.ceil(len(compact[0]) / (len(padded) * block)) * block:
            owners[:] = owner_zeros(len(compact[0]), len(padded), block)  # as the codec: a new size starts at zero
        errors = [torch.zeros_like(c) for c in compact]
        summed = quant_sum(compact, errors, owners, bits, block)
        sent = [c - e for c, e in zip(compact, errors)]  # what each replica's codes decode to
    for i, v in enumerate(padded):
        residuals[i] = v.masked_scatter(chosen, v[chosen] - sent[i])[:numel]
    total = torch.zeros_like(padded[0]).masked_scatter(chosen, summed)
    return total[:numel]


def shared_entries(vectors, residuals, ratio, segment, chooser):
    """The mask (over the vectors padded to whole segments) of the entries shared top-k sends: replica
    ``chooser``'s top-k of its g + e, or with ``"union"`` every replica's."""
    k = max(1, round(ratio * segment))
    padded = [pad(g + e, segment) for g, e in zip(vectors, residuals)]
    chosen = torch.zeros_like(padded[0], dtype=torch.bool).view(-1, segment)
    for picker in range(len(padded)) if chooser == "union" else [chooser]:
        rows = padded[picker].view(-1, segment)
        for row in range(rows.shape[0]):
            chosen[row, torch.sort(rows[row].abs(), descending=True, stable=True).indices[:k]] = True
    return chosen.view(-1)


def quant_sum(vectors, residuals, owner_residuals, bits, block, feedback=True):
    """Two-phase quantized sum: replicas quantize, chunk owners sum and quantize again (owner residual kept)."""
    n = len(vectors)
    numel = vectors[0].numel()
    sent = []
    for i, g in enumerate(vectors):
        v = pad(g + residuals[i] if feedback else g, n * block)
        q = quantize(v, bits, block)
        if feedback:
            residuals[i] = (v - q)[:numel]
        sent.append(q)
    chunk = sent[0].numel() // n
    out = []
    for j in range(n):
        s = sum(q[j * chunk : (j + 1) * chunk] for q in sent)
        s = s + owner_residuals[j]
        q = quantize(s, bits, block)
        owner_residuals[j] = s - q
        out.append(q)
    return torch.cat(out)[:numel]


def owner_zeros(numel, n, block):
    return [torch.zeros(math.ceil(numel / (n * block)) * block) for _ in range(n)]


def powersgd_sum(matrices, residuals, qs, rank):
    """One PowerSGD step with error feedback for one weight matrix held by every replica."""
    n = len(matrices)
    ms = [m + r for m, r in zip(matrices, residuals)]
    p = sum(m @ qs[0] for m in ms)
    p = torch.linalg.qr(p).Q
    q = sum(m.T @ p for m in ms)
    approx = p @ q.T
    for i in range(n):
        residuals[i] = ms[i] - approx / n
    qs[0] = q
    return approx
