"""A module's parallel layout: TP, CP, DP, PP degrees over an ordered list of global ranks, and EP.

Ranks are laid out in Megatron's order: tp varies fastest, then cp, then dp, then pp, so TP peers are
neighbouring ranks. Local index of a coordinate = ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp,
and the global rank is ``ranks[local index]``. Expert parallelism splits the dp axis: ``dp = edp × ep``
with ep the inner factor (a replica's EP coordinate is ``dp % ep``), so an EP group is ``ep`` replicas
next to each other at one tp, cp and pp coordinate, and the ranks holding the same experts and other
tokens (the expert-data-parallel group: replicas ``ep`` apart, with their CP and TP ranks, which route
other tokens too) are the rest of the stage. Everything here is pure arithmetic: no process groups.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from hetero.errors import ConfigError

# Mesh dimension order, outermost first; tp is innermost (fastest varying).
MESH_AXES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
# The process groups every module gets: one entry per group kind, each a tuple of mesh axes.
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("dp", "cp"),
}


class Coord(NamedTuple):
    """A rank's position inside one module's grid."""

    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism and the global ranks a module runs on."""

    tp: int
    cp: int
    dp: int
    pp: int
    ranks: tuple[int, ...]
    ep: int = 1  # expert parallelism: a factor of dp

    def __post_init__(self) -> None:
        for axis in MESH_AXES:
            if getattr(self, axis) < 1:
                raise ConfigError(f"layout.{axis}={getattr(self, axis)} must be >= 1")
        if self.ep < 1 or self.dp % self.ep:
            raise ConfigError(f"layout.ep={self.ep} must be >= 1 and divide dp={self.dp}")
        if len(self.ranks) != self.size:
            raise ConfigError(
                f"layout tp*cp*dp*pp = {self.tp}*{self.cp}*{self.dp}*{self.pp} = {self.size} "
                f"but {len(self.ranks)} ranks were given"
            )
        if len(set(self.ranks)) != len(self.ranks):
            raise ConfigError(f"layout ranks {list(self.ranks)} contain duplicates")

    @property
    def size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in ``MESH_AXES`` order."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    def degree(self, axes: Iterable[str]) -> int:
        size = 1
        for axis in axes:
            size *= getattr(self, axis)
        return size

    def rank_at(self, coord: Coord) -> int:
        local = ((coord.pp * self.dp + coord.dp) * self.cp + coord.cp) * self.tp + coord.tp
        return self.ranks[local]

    @functools.cached_property
    def _local_index(self) -> dict[int, int]:
        return {rank: local for local, rank in enumerate(self.ranks)}

    def coord(self, rank: int) -> Coord | None:
        """The rank's coordinate, or None when the module does not run on ``rank``."""
        local = self._local_index.get(rank)
        if local is None:
            return None
        local, tp = divmod(local, self.tp)
        local, cp = divmod(local, self.cp)
        pp, dp = divmod(local, self.dp)
        return Coord(tp=tp, cp=cp, dp=dp, pp=pp)

    def coords(self) -> Iterable[tuple[int, Coord]]:
        """Every (global rank, coordinate) of the module, in rank-list order."""
        for rank in self.ranks:
            coord = self.coord(rank)
            assert coord is not None
            yield rank, coord

    def groups(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """All groups of ranks that differ only along ``axes``, in a deterministic order.

        Inside a group, ranks are ordered as in the mesh (outer axis first), so a group's local rank
        equals the flattened coordinate along ``axes``.
        """
        fixed = [axis for axis in MESH_AXES if axis not in axes]
        varying = [axis for axis in MESH_AXES if axis in axes]
        result = []
        for fixed_values in itertools.product(*(range(getattr(self, a)) for a in fixed)):
            members = []
            for varying_values in itertools.product(*(range(getattr(self, a)) for a in varying)):
                values = dict(zip(fixed, fixed_values)) | dict(zip(varying, varying_values))
                members.append(self.rank_at(Coord(**values)))
            result.append(tuple(members))
        return result

    def group_of(self, rank: int, axes: tuple[str, ...]) -> tuple[int, ...] | None:
        """The group along ``axes`` that contains ``rank``; None when the module is not on it."""
        for group in self.groups(axes):
            if rank in group:
                return group
        return None

    def expert_groups(self) -> list[tuple[int, ...]]:
        """The EP groups: the ``ep`` neighbouring replicas (dp coordinates ``g·ep .. g·ep+ep-1``) at each
        tp, cp and pp coordinate, in EP-coordinate order; an expert shard's tokens meet in one."""
        groups: dict[tuple, list[int]] = {}
        for rank, c in self.coords():
            groups.setdefault((c.pp, c.dp // self.ep, c.cp, c.tp), []).append(rank)
        return [tuple(members) for _, members in sorted(groups.items())]

    def expert_data_groups(self) -> list[tuple[int, ...]]:
        """The ranks holding the same experts and routing other tokens (every ``ep``-th replica, with
        their CP and TP ranks) at each pp coordinate: where expert gradients are summed."""
        groups: dict[tuple, list[int]] = {}
        for rank, c in self.coords():
            groups.setdefault((c.pp, c.dp % self.ep), []).append(rank)
        return [tuple(members) for _, members in sorted(groups.items())]

    def describe_ranks(self) -> str:
        return format_ranks(self.ranks)


def format_ranks(ranks: Iterable[int]) -> str:
    """Compact text for a rank list: contiguous runs as ``a-b``, e.g. ``0-3,6``."""
    ranks = list(ranks)
    if not ranks:
        return "none"
    parts = []
    start = prev = ranks[0]
    for rank in ranks[1:] + [None]:  # type: ignore[list-item]
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if rank is not None:
            start = prev = rank
    return ",".join(parts)


@dataclass
class LayoutSpec:
    """A layout as written in YAML: degrees plus where the ranks are.

    Ranks are either an explicit list, or ``size`` consecutive ranks starting at ``offset``. ``dp``
    left unset is inferred from the rank count; ``size`` left unset is the degrees' product (or, when
    ``dp`` is unset too, every rank from ``offset`` to the end of the world).
    """

    tp: int = 1
    cp: int = 1
    dp: int | None = None
    pp: int = 1
    ep: int = 1  # expert parallelism: experts split over ep neighbouring DP replicas (a factor of dp)
    offset: int = 0
    size: int | None = None
    ranks: list[int] | None = None

    def resolve(self, field: str, world_size: int | None) -> Layout:
        """The concrete layout; ``field`` (e.g. ``llm.layout``) prefixes every error message."""
        for axis in ("tp", "cp", "pp"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"{field}.{axis}={getattr(self, axis)} must be >= 1")
        if self.dp is not None and self.dp < 1:
            raise ConfigError(f"{field}.dp={self.dp} must be >= 1 (or left unset to infer it)")
        if self.offset < 0:
            raise ConfigError(f"{field}.offset={self.offset} must be >= 0")
        ranks = self._rank_list(field, world_size)
        model_parallel = self.tp * self.cp * self.pp
        dp = self.dp
        if dp is None:
            if len(ranks) % model_parallel:
                raise ConfigError(
                    f"{field}: tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model_parallel} does not "
                    f"divide the {len(ranks)} ranks ({format_ranks(ranks)}), so dp cannot be inferred; "
                    f"set {field}.dp or give a rank count that is a multiple of {model_parallel}"
                )
            dp = len(ranks) // model_parallel
        product = model_parallel * dp
        if product != len(ranks):
            hint = (
                f"e.g. {field}.dp={len(ranks) // model_parallel}"
                if len(ranks) % model_parallel == 0
                else f"use {product} ranks"
            )
            raise ConfigError(
                f"{field}: tp*cp*dp*pp = {self.tp}*{self.cp}*{dp}*{self.pp} = {product} but the layout "
                f"has {len(ranks)} ranks ({format_ranks(ranks)}); make the product equal the rank "
                f"count ({hint})"
            )
        if world_size is not None:
            outside = [r for r in ranks if r >= world_size]
            if outside:
                raise ConfigError(
                    f"{field}: ranks {format_ranks(outside)} are outside the world of {world_size} "
                    f"ranks (0-{world_size - 1}); use ranks below {world_size} or raise world_size"
                )
        if self.ep < 1 or dp % self.ep:
            raise ConfigError(
                f"{field}.ep={self.ep} does not divide {field}.dp={dp}: experts are split over ep data-parallel "
                f"replicas; choose ep from {', '.join(str(d) for d in range(1, dp + 1) if dp % d == 0)} or raise dp"
            )
        return Layout(tp=self.tp, cp=self.cp, dp=dp, pp=self.pp, ranks=tuple(ranks), ep=self.ep)

    def _rank_list(self, field: str, world_size: int | None) -> list[int]:
        if self.ranks is not None:
            if self.offset != 0 or self.size is not None:
                raise ConfigError(
                    f"{field}: give either ranks or offset/size, not both "
                    f"(ranks={list(self.ranks)}, offset={self.offset}, size={self.size})"
                )
            if not self.ranks:
                raise ConfigError(f"{field}.ranks is empty; list at least one rank")
            negative = [r for r in self.ranks if r < 0]
            if negative:
                raise ConfigError(f"{field}.ranks: negative ranks {negative}; ranks start at 0")
            duplicates = sorted({r for r in self.ranks if list(self.ranks).count(r) > 1})
            if duplicates:
                raise ConfigError(
                    f"{field}.ranks lists ranks {duplicates} more than once; list each rank once"
                )
            return list(self.ranks)
        if self.size is not None:
            count = self.size
        elif self.dp is not None:
            count = self.tp * self.cp * self.dp * self.pp
        elif world_size is not None:
            count = world_size - self.offset
        else:
            raise ConfigError(
                f"{field}: dp, size and ranks are all unset and world_size is unknown; "
                f"set {field}.dp or world_size"
            )
        if count < 1:
            raise ConfigError(
                f"{field}: offset={self.offset} leaves no ranks in a world of {world_size}; "
                f"lower {field}.offset or raise world_size"
            )
        return list(range(self.offset, self.offset + count))

    def highest_rank(self) -> int | None:
        """The highest rank this spec names without knowing the world size (None if unknown)."""
        if self.ranks:
            return max(self.ranks)
        if self.size is not None:
            return self.offset + self.size - 1
        if self.dp is not None:
            return self.offset + self.tp * self.cp * self.dp * self.pp - 1
        return None
