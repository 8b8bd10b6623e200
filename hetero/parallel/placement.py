"""Which ranks run which modules, and whether modules share ranks (colocated) or not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hetero.errors import ConfigError
from hetero.parallel.layout import Coord, Layout, LayoutSpec, format_ranks

PlacementMode = Literal["colocated", "non_colocated", "mixed"]
REQUESTED_MODES = ("auto", "colocated", "non_colocated")


@dataclass(frozen=True)
class Placement:
    """All modules' layouts over one world, validated."""

    world_size: int
    layouts: dict[str, Layout]
    mode: PlacementMode

    def modules_on(self, rank: int) -> list[str]:
        """Modules that run on ``rank``, in declaration order."""
        return [name for name, layout in self.layouts.items() if layout.coord(rank) is not None]

    def coord(self, module: str, rank: int) -> Coord | None:
        return self.layouts[module].coord(rank)

    def relation(self, a: str, b: str) -> Literal["colocated", "disjoint", "overlapping"]:
        ranks_a, ranks_b = set(self.layouts[a].ranks), set(self.layouts[b].ranks)
        if ranks_a == ranks_b:
            return "colocated"
        return "overlapping" if ranks_a & ranks_b else "disjoint"


def infer_world_size(specs: dict[str, LayoutSpec]) -> int:
    """The smallest world holding every module, when no world_size is given."""
    highest = {name: spec.highest_rank() for name, spec in specs.items()}
    unknown = [name for name, rank in highest.items() if rank is None]
    if unknown:
        raise ConfigError(
            f"world_size is unset and {', '.join(unknown)} give no rank count (no dp, size or "
            f"ranks); set world_size or {unknown[0]}.layout.dp"
        )
    return max(highest.values()) + 1  # type: ignore[type-var, operator]


def place(
    specs: dict[str, LayoutSpec], world_size: int | None = None, requested: str = "auto"
) -> Placement:
    """Resolve every module's layout and check that together they tile the world as requested."""
    if not specs:
        raise ConfigError("the experiment declares no modules; add at least one (e.g. llm: {kind: gpt})")
    if requested not in REQUESTED_MODES:
        raise ConfigError(
            f"placement={requested!r} is not one of {', '.join(REQUESTED_MODES)}"
        )
    if world_size is None:
        world_size = infer_world_size(specs)
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    layouts = {name: spec.resolve(f"{name}.layout", world_size) for name, spec in specs.items()}

    covered = set().union(*(layout.ranks for layout in layouts.values()))
    idle = [rank for rank in range(world_size) if rank not in covered]
    if idle:
        shrink = f" or set world_size={len(covered)}" if covered == set(range(len(covered))) else ""
        raise ConfigError(
            f"world_size={world_size} but ranks {format_ranks(idle)} run no module; assign them to a "
            f"module's layout (offset/size or ranks){shrink}"
        )

    names = list(layouts)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    rank_sets = {name: set(layout.ranks) for name, layout in layouts.items()}
    if requested == "colocated":
        for a, b in pairs:
            if rank_sets[a] != rank_sets[b]:
                raise ConfigError(
                    f"placement=colocated but {a} runs on ranks {format_ranks(layouts[a].ranks)} and "
                    f"{b} on ranks {format_ranks(layouts[b].ranks)}; give every module the same ranks "
                    f"or set placement=auto"
                )
    if requested == "non_colocated":
        for a, b in pairs:
            shared = sorted(rank_sets[a] & rank_sets[b])
            if shared:
                free = max(covered) + 1
                raise ConfigError(
                    f"placement=non_colocated but {a} (ranks {format_ranks(layouts[a].ranks)}) and "
                    f"{b} (ranks {format_ranks(layouts[b].ranks)}) share ranks {format_ranks(shared)}; "
                    f"give them disjoint ranks (e.g. {b}.layout.offset={free}) or set placement=auto"
                )

    if all(rank_sets[a] == rank_sets[b] for a, b in pairs):
        mode: PlacementMode = "colocated"
    elif all(not rank_sets[a] & rank_sets[b] for a, b in pairs):
        mode = "non_colocated"
    else:
        mode = "mixed"
    return Placement(world_size=world_size, layouts=layouts, mode=mode)
