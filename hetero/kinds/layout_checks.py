"""Checks that a transformer's shapes split evenly under a module's layout."""

from __future__ import annotations

from hetero.parallel.layout import Layout


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def transformer_layout_errors(
    module: str,
    layout: Layout,
    *,
    num_heads: int,
    num_kv_heads: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_layers: int,
    seq_len: int,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    fsdp: bool = False,
) -> list[str]:
    """Every way ``layout`` fails to split this transformer; empty when it fits."""
    errors = []
    tp, cp, pp = layout.tp, layout.cp, layout.pp
    sizes = [("num_heads", num_heads)]
    if num_kv_heads != num_heads:
        sizes.append(("num_kv_heads", num_kv_heads))
    sizes += [("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)]
    if vocab_size is not None:
        sizes.append(("vocab_size", vocab_size))
    for name, value in sizes:
        if value % tp:
            errors.append(
                f"{module}.layout.tp={tp} does not divide {module}.model.{name}={value}; "
                f"choose tp from {_divisors(value)}"
            )
    if cp > 1 and seq_len % (2 * cp):
        errors.append(
            f"{module}.layout.cp={cp}: sequence length {seq_len} is not divisible by 2*cp={2 * cp} "
            f"(load-balanced CP cuts the sequence into 2*cp chunks); use a sequence length that is "
            f"a multiple of {2 * cp} or a smaller cp"
        )
    if sequence_parallel and tp > 1 and (seq_len // max(cp, 1)) % tp:
        errors.append(
            f"{module}.parallel.sequence_parallel: the {seq_len // cp} tokens each CP rank holds do not "
            f"split over tp={tp}; use a sequence length that is a multiple of cp*tp={cp * tp}"
        )
    if fsdp and (tp > 1 or pp > 1):
        errors.append(
            f"{module}.parallel.fsdp=true shards over dp×cp only and runs with tp=1 and pp=1 "
            f"(got tp={tp}, pp={pp}); turn fsdp off for this layout or set tp=1 and pp=1"
        )
    if pp > num_layers:
        errors.append(
            f"{module}.layout.pp={pp} is larger than {module}.model.num_layers={num_layers}; every "
            f"pipeline stage needs at least one layer: use pp <= {num_layers}"
        )
    return errors


def shape_errors(module: str, **positive: int) -> list[str]:
    """Model sizes that must be at least 1."""
    return [
        f"{module}.model.{name}={value} must be >= 1" for name, value in positive.items() if value < 1
    ]


def patch_model_errors(
    module: str, layout: Layout, what: str, *, size_field: str, size: int, patch_size: int, hidden_size: int,
    num_heads: int, pipeline: bool = False,
) -> list[str]:
    """What a transformer over image patches (``what``, e.g. "the vision encoder") needs of its sizes
    and layout: patches that tile the image, heads that split the width, and no cp (nor pp, unless
    ``pipeline``)."""
    errors = []
    if size % patch_size:
        errors.append(
            f"{module}.model.patch_size={patch_size} does not divide {module}.model.{size_field}={size}"
        )
    if hidden_size % num_heads:
        errors.append(
            f"{module}.model.num_heads={num_heads} does not divide {module}.model.hidden_size={hidden_size}; "
            f"pick a head count that divides it"
        )
    if pipeline and layout.cp > 1:
        errors.append(
            f"{module}: {what} runs with cp=1 (got cp={layout.cp}); its sequence is short: spread it with dp, tp "
            f"or pp instead"
        )
    elif not pipeline and (layout.cp > 1 or layout.pp > 1):
        errors.append(
            f"{module}: {what} runs with cp=1 and pp=1 (got cp={layout.cp}, pp={layout.pp}); its sequence "
            f"is short: spread it with dp or tp instead"
        )
    return errors
