"""ProjectorConfig: the widths and token count of a projector, and what its layout must divide."""

from __future__ import annotations

from dataclasses import dataclass

from hetero.kinds.layout_checks import shape_errors
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions


@dataclass
class ProjectorConfig:
    in_size: int = 64  # the encoder's feature width
    out_size: int = 64  # the LLM's width
    tokens: int = 64  # tokens per image, as the encoder hands them on
    # Images as items (from a tower of items, ``items: true``): any number per row, each ``tokens`` long,
    # handed on as items (e.g. routed to the LLM's placeholders) rather than one per row.
    items: bool = False

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        errors = shape_errors(module, in_size=self.in_size, out_size=self.out_size, tokens=self.tokens)
        if errors:
            return errors
        if self.out_size % layout.tp:
            errors.append(f"{module}.layout.tp={layout.tp} does not divide {module}.model.out_size={self.out_size}; "
                          f"choose tp from {', '.join(str(d) for d in range(1, self.out_size + 1) if self.out_size % d == 0)}")
        if layout.cp > 1 or layout.pp > 1:
            errors.append(f"{module}: a projector runs with cp=1 and pp=1 (got cp={layout.cp}, pp={layout.pp}); "
                          "spread it with dp or tp instead")
        if options is not None and options.fsdp and layout.tp > 1:
            errors.append(f"{module}.parallel.fsdp=true shards over dp only and runs with tp=1 (got tp={layout.tp}); "
                          "turn fsdp off or set tp=1")
        return errors
