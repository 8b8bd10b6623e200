"""What a kind's batch columns must look like, declared from its config (``Kind.columns``), and the check.

A ``Column`` gives a column's shape per row (or per item) with the model field that fixes each dimension,
its dtype family and, for integer ids, the range a model field (or an alphabet) bounds. ``column_errors``
checks a global batch against a kind's columns: dtypes and shapes, plus one min/max of each bounded
integer column and no other pass over the data. It is a pure function of the batch, which every rank
holds alike, so every rank finds the same errors before the step's first message and none waits on
another. Each error names the module, the column, the field that disagrees and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

INTEGER, LONG, FLOATING, BOOL = "integer", "long", "floating", "bool"
_FAMILIES = {INTEGER: "integers (e.g. torch.long)", LONG: "64-bit integer ids (torch.long: embeddings and "
             "cross-entropy take no other integers)", FLOATING: "floating point values (e.g. torch.float32)",
             BOOL: "booleans (torch.bool)"}


@dataclass(frozen=True)
class Dim:
    """One dimension of a column's rows: ``size`` fixed by the model field ``field`` (``field`` empty:
    fixed by the format), or, with ``size`` None, any size of at least ``minimum``, ``field`` naming it.
    Free dimensions of one name agree across a kind's columns (a clip's frames and its ``revisit`` flags)."""

    field: str
    size: int | None = None
    minimum: int = 0


@dataclass(frozen=True)
class Column:
    """A batch column a kind reads. ``dims``: its shape after the first dimension, which is the batch's
    rows (``rows``) or the batch's items (e.g. image patches). ``dtype``: ``INTEGER``, ``LONG`` (int64
    only), ``FLOATING`` or ``BOOL``. Integer values must lie in ``low .. high - 1`` (``high`` None:
    unchecked), or equal ``ignore`` (labels' ignored positions); ``bound`` is the model field that sets
    ``high`` (named with its value, and as a fix), else ``meaning`` says what the range is and ``fix`` how
    to get into it. ``optional``: checked only when the batch has it."""

    name: str
    dims: tuple[Dim, ...] = ()
    dtype: str = FLOATING
    low: int = 0
    high: int | None = None
    bound: str = ""
    meaning: str = ""
    ignore: int | None = None
    fix: str = ""
    optional: bool = False
    rows: bool = True


def column_errors(module: str, columns: Iterable[Column], batch: dict[str, torch.Tensor]) -> list[str]:
    """What in ``batch`` does not match ``columns`` (a kind's, for its module ``module``); empty when all do."""
    errors: list[str] = []
    free: dict[str, tuple[str, int]] = {}  # free dimension name -> (first column with it, its size)
    for column in columns:
        if column.name not in batch:
            if not column.optional:
                errors.append(f"{module} reads the batch column {column.name}, which the batch lacks (it has "
                              f"{', '.join(sorted(batch)) or 'no columns'}); add it to the data")
            continue
        errors += _errors(module, column, batch[column.name], free)
    return errors


def _errors(module: str, column: Column, tensor: torch.Tensor, free: dict[str, tuple[str, int]]) -> list[str]:
    name, unit = column.name, "row" if column.rows else "item"
    if not _matches(tensor.dtype, column.dtype):
        return [f"{module}: the batch's {name} are {tensor.dtype}, but {module} takes {_FAMILIES[column.dtype]}; "
                f"convert the column"]
    got = tuple(tensor.shape[1:])
    if tensor.dim() != 1 + len(column.dims):
        want = _shape(d.field if d.size is None else d.size for d in column.dims)
        spec = " × ".join(d.field or str(d.size) for d in column.dims) or "one value"
        return [f"{module}: the batch's {name} hold {_held(got)} per {unit} but {module} takes {want} per {unit} "
                f"({spec})"]
    errors = _size_errors(module, column, got, unit)
    for dim, size in zip(column.dims, got):
        if dim.size is not None:
            continue
        if size < dim.minimum:
            errors.append(f"{module}: the batch's {name} have {size} {dim.field} per {unit}; {module} needs at "
                          f"least {dim.minimum} {dim.field} per {unit}")
        seen = free.setdefault(dim.field, (name, size))
        if seen[1] != size:
            errors.append(f"{module}: the batch's {name} have {size} {dim.field} per {unit} but its {seen[0]} "
                          f"have {seen[1]}; give both the same {dim.field}")
    if errors or column.high is None or tensor.numel() == 0:
        return errors
    return _range_errors(module, column, tensor)


def _size_errors(module: str, column: Column, got: tuple[int, ...], unit: str) -> list[str]:
    """The dimensions fixed by a model field (or the format) that differ, with the fields to set where each
    field's dimensions have one size in the batch."""
    fixed = [(dim, size) for dim, size in zip(column.dims, got) if dim.size is not None]
    wrong = [dim for dim, size in fixed if dim.size != size]
    if not wrong:
        return []
    want = _shape(d.field if d.size is None else d.size for d in column.dims)
    named = {dim.field: dim.size for dim in wrong if dim.field}
    given = {f: {size for dim, size in fixed if dim.field == f} for f in named}
    stated = " and ".join(f"{module}.model.{f}={size}" for f, size in named.items()) or f"{module} takes {want}"
    fix = f"make them {want} per {unit}"
    if all(dim.field for dim in wrong) and all(len(sizes) == 1 for sizes in given.values()):
        fix += " or set " + " and ".join(f"{module}.model.{f}={next(iter(given[f]))}" for f in named)
    return [f"{module}: the batch's {column.name} hold {_held(got)} per {unit} but {stated}; {fix}"]


def _range_errors(module: str, column: Column, tensor: torch.Tensor) -> list[str]:
    """One min/max of the values (of those not ``ignore``): within ``low .. high - 1``?"""
    lo, hi = (int(v) for v in torch.aminmax(tensor))
    if column.ignore is not None and lo < column.low:
        lo = int(tensor.masked_fill(tensor == column.ignore, column.low).min())
    if column.low <= lo and hi < column.high:
        return []
    allowed = f"{column.low}..{column.high - 1}"
    if column.ignore is not None:
        allowed += f" or {column.ignore} (ignored)"
    why = f"{module}.model.{column.bound}={column.high}" if column.bound else column.meaning
    fixes = [column.fix] if column.fix else []
    if not column.fix and hi >= column.high:
        fixes.append(f"keep them below {column.high}"
                     + (f" or set {module}.model.{column.bound}={hi + 1}" if column.bound else ""))
    if not column.fix and lo < column.low:
        fixes.append(f"keep them at least {column.low}"
                     + (f" (or {column.ignore} where ignored)" if column.ignore is not None else ""))
    return [f"{module}: the batch's {column.name} hold values {lo}..{hi}, outside {allowed} ({why}); "
            f"{'; '.join(fixes)}"]


def _matches(dtype: torch.dtype, family: str) -> bool:
    if family == LONG:
        return dtype == torch.int64
    if family == INTEGER:
        return not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)
    return dtype == torch.bool if family == BOOL else dtype.is_floating_point


def _shape(sizes: Iterable[int | str]) -> str:
    return "×".join(str(s) for s in sizes) or "one value"


def _held(sizes: tuple[int, ...]) -> str:
    return f"{_shape(sizes)} values" if sizes else "one value"
