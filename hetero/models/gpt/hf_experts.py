"""A Hugging Face MoE checkpoint's experts as hetero's stacked expert weights (``moe.Experts``: w1, w3
(E, ffn, hidden), w2 (E, hidden, ffn)).

The hub stores each expert's matrices on their own: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
(Qwen3-MoE, Qwen2-MoE) or ``block_sparse_moe.experts.{e}.w1/w3/w2`` (Mixtral). transformers 5 fuses them
in memory, and a checkpoint saved from that state holds ``mlp.experts.gate_up_proj`` (E, 2·ffn, hidden;
the gate's rows first) and ``mlp.experts.down_proj`` (E, hidden, ffn). The layout of each layer is told
by its key names, never by shapes (2·ffn = hidden would be ambiguous). Qwen3-VL-MoE's hub files hold the
fused pair transposed, (E, hidden, 2·ffn) and (E, ffn, hidden), where transformers 5 writes its own layout:
its part of the checkpoint says which (``experts_transposed``, from the transformers version that wrote it).

``StackedExperts`` wraps a checkpoint so that ``<layer>.<block>.experts.w1`` (and w3, w2) read as one
tensor each: a slice over experts reads only those experts' tensors, so an EP rank reads its own share.
It requires experts 0..E-1 exactly in every layer.
"""

from __future__ import annotations

import re

import torch

from hetero.errors import ConfigError

# the MoE block's name in a layer, and its experts' matrices named as hetero's w1 (gate), w3 (up), w2 (down)
BLOCKS = {"mlp": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
          "block_sparse_moe": {"w1": "w1", "w3": "w3", "w2": "w2"}}
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


class StackedExperts:
    """``checkpoint`` (an ``HFCheckpoint`` or a VLM's part of one) with each layer's experts read as hetero's
    stacked weights, ``<layer prefix>.experts.w1|w3|w2``; every other tensor as it is."""

    def __init__(self, checkpoint, num_experts: int, module: str = "llm"):
        self.checkpoint, self.num_experts = checkpoint, num_experts
        self.transposed = getattr(checkpoint, "experts_transposed", False)  # fused as (E, hidden, 2·ffn)
        self.path, self.config = checkpoint.path, checkpoint.config
        where = f"{module}.init.hf ({checkpoint.path})"
        self.per_expert: dict[str, dict[int, dict[str, str]]] = {}  # experts prefix -> expert -> matrix -> name
        self.fused: dict[str, dict[str, str]] = {}  # experts prefix -> gate_up_proj / down_proj -> name
        plain = []
        for name in checkpoint.names():
            if match := _PER_EXPERT.fullmatch(name):
                prefix, expert, matrix = match.groups()
                self.per_expert.setdefault(prefix, {}).setdefault(int(expert), {})[matrix] = name
            elif match := _FUSED.fullmatch(name):
                self.fused.setdefault(match.group(1), {})[match.group(2)] = name
            else:
                plain.append(name)
        for prefix, experts in self.per_expert.items():
            block = BLOCKS[prefix.rsplit(".", 2)[1]]
            if sorted(experts) != list(range(num_experts)):
                raise ConfigError(f"{where}: {prefix} holds experts {_ranges(sorted(experts))}; the config's "
                                  f"{num_experts} experts are 0..{num_experts - 1}")
            for expert, matrices in experts.items():
                if set(matrices) != set(block.values()):
                    raise ConfigError(f"{where}: {prefix}.{expert} holds {sorted(matrices)}; an expert holds "
                                      f"{', '.join(sorted(block.values()))}")
        for prefix, tensors in self.fused.items():
            if prefix in self.per_expert or set(tensors) != {"gate_up_proj", "down_proj"}:
                raise ConfigError(f"{where}: {prefix} mixes fused and per-expert tensors, or lacks one of "
                                  "gate_up_proj and down_proj")
            experts = checkpoint.shape(tensors["gate_up_proj"])[0]  # dimension 0 in both layouts
            if experts != num_experts:
                raise ConfigError(f"{where}: {tensors['gate_up_proj']} holds {experts} experts; the config "
                                  f"has {num_experts}")
        blocks = {prefix.rsplit(".", 2)[1] for prefix in [*self.per_expert, *self.fused]}
        if len(blocks) > 1:
            raise ConfigError(f"{where}: its layers name their experts' block both {' and '.join(sorted(blocks))}")
        self.block = blocks.pop() if blocks else "mlp"  # what the checkpoint calls a layer's experts' block
        # and its shared experts: Qwen2-MoE's one gated expert, GLM-4-MoE's ungated ones
        self.shared = "shared_experts" if any(".mlp.shared_experts." in name for name in plain) else "shared_expert"
        stacked = [f"{prefix}.{w}" for prefix in [*self.per_expert, *self.fused] for w in ("w1", "w3", "w2")]
        self.files = dict.fromkeys(plain + stacked, None)

    @property
    def bytes_read(self) -> int:
        return self.checkpoint.bytes_read

    def names(self) -> list[str]:
        return list(self.files)

    def tensor(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        prefix, _, matrix = name.rpartition(".")
        if prefix in self.per_expert:
            block = BLOCKS[prefix.rsplit(".", 2)[1]]
            experts = range(self.num_experts)[index[0]] if index else range(self.num_experts)
            rest = index[1:] if index else None
            return torch.stack([self.checkpoint.tensor(self.per_expert[prefix][e][block[matrix]], rest)
                                for e in experts])
        if prefix in self.fused:
            return self._fused(prefix, matrix, index)
        return self.checkpoint.tensor(name, index)

    def _fused(self, prefix: str, matrix: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        names = self.fused[prefix]
        experts, rows, cols = index if index else (slice(None), slice(None), slice(None))
        if matrix == "w2":
            if not self.transposed:
                return self.checkpoint.tensor(names["down_proj"], (experts, rows, cols))
            return self.checkpoint.tensor(names["down_proj"], (experts, cols, rows)).transpose(1, 2)
        shape = self.checkpoint.shape(names["gate_up_proj"])
        ffn = shape[2 if self.transposed else 1] // 2
        rows = range(ffn)[rows]
        start = rows.start + (ffn if matrix == "w3" else 0)  # the gate's rows, then the up projection's
        half = slice(start, start + len(rows))
        if not self.transposed:
            return self.checkpoint.tensor(names["gate_up_proj"], (experts, half, cols))
        return self.checkpoint.tensor(names["gate_up_proj"], (experts, cols, half)).transpose(1, 2)


def _ranges(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:8]) + (" ..." if len(values) > 8 else "")


def assemble_experts(block: str, fused: set[str], transposed: bool = False):
    """The export's ``HFExport.assemble`` for a mixture of experts: each stacked ``<prefix>.w1|w3|w2`` becomes
    each expert's matrix under ``block``'s names, or, for the prefixes in ``fused``, transformers' fused
    ``gate_up_proj`` (w1's rows, then w3's) and ``down_proj``, ``transposed`` as Qwen3-VL-MoE's hub files."""
    turn = (lambda t: t.transpose(1, 2).contiguous()) if transposed else (lambda t: t)
    matrices = BLOCKS[block]

    def assemble(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in tensors.items():
            prefix, _, matrix = name.rpartition(".")
            if not prefix.endswith(".experts") or matrix not in matrices:
                out[name] = tensor
            elif prefix in fused:
                if matrix == "w2":
                    out[f"{prefix}.down_proj"] = turn(tensor)
                elif matrix == "w1":
                    out[f"{prefix}.gate_up_proj"] = turn(torch.cat([tensor, tensors[f"{prefix}.w3"]], 1))
            else:  # copies: safetensors refuses tensors that share memory
                out |= {f"{prefix}.{e}.{matrices[matrix]}.weight": part.clone() for e, part in enumerate(tensor)}
        return out

    return assemble


def with_zero_selection_bias(assemble, num_experts: int):
    """``assemble``, plus a zero ``e_score_correction_bias`` beside each router it writes: GLM-4-MoE's routing
    always holds one, and a GPT routed by sigmoid without a selection bias is that routing with a zero one."""
    def with_bias(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = assemble(tensors)
        routers = [name.removesuffix(".weight") for name in out if name.endswith(".mlp.gate.weight")]
        return out | {f"{router}.e_score_correction_bias": torch.zeros(num_experts, dtype=torch.float32, device="cpu")
                      for router in routers}

    return with_bias
