"""An independent statement of the layout rules, written as plain loops, that tests check hetero against.

Megatron order: tp varies fastest, then cp, then dp, then pp. Ranks are the explicit list, or the
degrees' product (or the rest of the world when dp is unset) starting at the offset.
"""

from pathlib import Path

import yaml


def module_ranks(layout: dict, world_size: int) -> list[int]:
    tp, cp, pp = layout.get("tp", 1), layout.get("cp", 1), layout.get("pp", 1)
    offset = layout.get("offset", 0)
    if "ranks" in layout:
        return list(layout["ranks"])
    if "dp" in layout:
        return list(range(offset, offset + tp * cp * pp * layout["dp"]))
    return list(range(offset, world_size))


def grid_coords(layout: dict, world_size: int) -> dict[int, dict[str, int]]:
    """{global rank: {"tp": .., "cp": .., "dp": .., "pp": ..}} for one module."""
    ranks = module_ranks(layout, world_size)
    tp, cp, pp = layout.get("tp", 1), layout.get("cp", 1), layout.get("pp", 1)
    dp = len(ranks) // (tp * cp * pp)
    coords = {}
    i = 0
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    coords[ranks[i]] = {"tp": t, "cp": c, "dp": d, "pp": p}
                    i += 1
    return coords


def modules_of_yaml(path) -> tuple[dict[str, dict], int]:
    """The module entries (top-level mappings with a kind) and world_size of an experiment YAML."""
    raw = _with_parents(Path(path))
    return {k: v for k, v in raw.items() if isinstance(v, dict) and "kind" in v}, raw["world_size"]


def _with_parents(path: Path) -> dict:
    """The YAML merged over the sibling experiments its ``defaults`` list names (``/hetero/...`` schemas skipped)."""
    raw = yaml.safe_load(open(path))
    merged: dict = {}
    for parent in raw.pop("defaults", []):
        if isinstance(parent, str) and not parent.startswith("/") and parent != "_self_":
            merged = _merge(merged, _with_parents(path.with_name(f"{parent}.yaml")))
    return _merge(merged, raw)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
