"""The rank map of an experiment: which module runs where, at which grid coordinate.

Ranks follow Megatron's order: tp fastest, then cp, then dp, then pp. Expert parallelism splits dp
(``dp = edp × ep``, ep inner): the ``ep`` column is a replica's EP coordinate (``dp % ep``), which names
the experts it holds; the ranks of one EP group share ``dp // ep``.
"""

from __future__ import annotations

from typing import Any

from hetero.config import ExperimentConfig
from hetero.parallel.layout import MESH_AXES, format_ranks
from hetero.parallel.placement import Placement

COLUMNS = ("rank", "module", "tp", "cp", "dp", "ep", "pp", "colocated_with")


def rank_map(experiment: ExperimentConfig, placement: Placement, training: dict[str, str] | None = None
             ) -> dict[str, Any]:
    """A JSON-ready description of the placement: modules and one row per (rank, module); ``training``:
    per module what training runs of it (``Graph.training``), shown beside a frozen one."""
    modules = {
        name: {"kind": experiment.modules[name].kind}
        | {axis: getattr(layout, axis) for axis in ("tp", "cp", "dp", "ep", "pp")}
        | {"ranks": list(layout.ranks)}
        | ({"training": training[name]} if training else {})
        for name, layout in placement.layouts.items()
    }
    rows = []
    for rank in range(placement.world_size):
        here = placement.modules_on(rank)
        for name in here:
            coord = placement.coord(name, rank)
            assert coord is not None
            rows.append(
                {"rank": rank, "module": name}
                | coord._asdict()
                | {"ep": coord.dp % placement.layouts[name].ep}
                | {"colocated_with": [other for other in here if other != name]}
            )
    return {
        "experiment": experiment.name,
        "world_size": placement.world_size,
        "placement": placement.mode,
        "modules": modules,
        "ranks": rows,
    }


def format_rank_map(description: dict[str, Any]) -> str:
    """The rank map as aligned text: a module summary, then one line per (rank, module)."""
    lines = [
        f"experiment {description['experiment']}: {description['world_size']} ranks, "
        f"placement {description['placement']}",
        "",
    ]
    kind_width = max(len(module["kind"]) for module in description["modules"].values())
    for name, module in description["modules"].items():
        degrees = " ".join(f"{axis}{module[axis]}" for axis in reversed(MESH_AXES))
        degrees += f" ep{module['ep']}" if module["ep"] > 1 else ""
        frozen = f"  ({module['training']})" if module.get("training", "trained") != "trained" else ""
        lines.append(f"  {name:<12} {module['kind']:<{kind_width}} {degrees}  ranks {format_ranks(module['ranks'])}"
                     f"{frozen}")
    lines.append("")
    shares = any("parameters" in row for row in description["ranks"])  # ``hetero layout --params``
    table = [list(COLUMNS) + (["parameters", "checkpoint_bytes"] if shares else [])]
    for row in description["ranks"]:
        cells = [str(row[c]) for c in COLUMNS[:-1]] + [",".join(row["colocated_with"]) or "-"]
        if shares:
            read = row["checkpoint_bytes"]
            cells += [f"{row['parameters']:,}", "-" if read is None else f"{read:,}"]
        table.append(cells)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    return "\n".join(lines)
