"""The ``gpt`` kind: a decoder-only LLM reading token ids, with other modules' embeddings at placeholder
positions, trained on next-token cross-entropy.

- reads ``tokens`` and ``labels`` of every row, and ``documents`` where rows are packed (several
  documents per row, ``hetero.data.packing``): each token then attends only within its document and its
  RoPE position restarts where its document starts; ``rope_positions`` (rows, 3, seq_len) where the
  model has M-RoPE sections and the rows hold images or videos (``hetero.data.mrope_positions``: without
  it every token's three positions are its plain one); in evaluation also every ``*_position`` column
  present (e.g. ``digit_position``), whose next-token accuracy it reports as ``<name>_accuracy``;
- input ``embeddings`` (width ``hidden_size``): any number of edges, each replacing placeholder positions
  of the rows it carries (under CP and SP each rank the positions it holds);
- output ``hidden`` (``seq_len`` × ``hidden_size``): the final (normed) hidden states of its rows, e.g. a
  generator's condition (under CP and SP each rank's part of the sequence);
- loss: the cross-entropy summed over the tokens a rank holds, over the global count of supervised tokens;
  with experts (``num_experts`` > 0) also their auxiliary losses, means over every token of the global
  batch (``moe.py``), reported as the parts ``balance_loss`` and ``z_loss`` beside the loss (not in it),
  from every pipeline stage.

Under context parallelism each rank holds the zigzag chunks of its CP coordinate (tokens, labels and
their absolute positions); under TP the loss is computed vocab-parallel (``loss_parallel``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import ContextManager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from hetero.data.digits import IGNORE_INDEX
from hetero.kernels.documents import Documents, document_errors
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.flops import gpt_forward_flops_per_token
from hetero.models.gpt.megatron import MegatronGPT, to_megatron
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.moe import routed_layers
from hetero.models.gpt.plan import parallelize_gpt
from hetero.kinds.batch_rows import take_rows
from hetero.kinds.columns import INTEGER, LONG, Column, Dim, column_errors
from hetero.kinds.registry import Kind, Metric, Port, StageResult, StageStep
from hetero.parallel.context import split_for_cp, zigzag_indices
from hetero.parallel.layout import Layout
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions

# how an imported model trains, the module's to set in YAML over the checkpoint's: the router's losses and
# precision, and whether the pad token's embedding row trains (pad_token_id: null)
TRAINING_CHOICES = ("balance_loss", "balance_pooled", "router_z_loss", "capacity_factor", "router_fp32", "pad_token_id")
AUX_PARTS = ("balance_loss", "z_loss")


class GPTKind(Kind):
    name = "gpt"
    config = GPTConfig

    def build(self, config: GPTConfig) -> GPT:
        return GPT(config)

    def expert_parallel(self, config: GPTConfig) -> bool:
        return config.moe

    def expert_weights(self, model: GPT) -> set[str]:
        return {name for name, param in model.named_parameters()
                if ".feed_forward.experts." in name or getattr(param, "expert_shard", False)}

    def loss_parts(self, config: GPTConfig) -> tuple[str, ...]:
        return AUX_PARTS if config.moe else ()

    def routing_shape(self, config: GPTConfig) -> tuple[int, int] | None:
        return (config.num_layers, config.num_experts) if config.moe else None

    def take_routing(self, model: GPT) -> dict[int, torch.Tensor]:
        counts = {}
        for index, layer in routed_layers(model):
            counts[index] = torch.cat([layer.load, layer.assigned[None], layer.dropped[None]])
            layer.load, layer.assigned, layer.dropped = (torch.zeros_like(t) for t in (layer.load, layer.assigned, layer.dropped))
        return counts

    def counts_dispatch(self, config: GPTConfig, layout: Layout) -> bool:
        # the native experts' all-to-all (hetero.parallel.expert_parallel); megatron-core's token
        # dispatcher counts no bytes
        return config.moe and layout.ep > 1 and config.backend == "native"

    def dispatch_bytes(self, model: GPT) -> int:
        return sum(getattr(layer.dispatch, "bytes_sent", 0) for _, layer in routed_layers(model))

    def forward_flops(self, config: GPTConfig) -> float:
        return config.seq_len * gpt_forward_flops_per_token(config)

    def parallelize(self, model, mesh, options):
        if model.config.backend == "megatron":
            return to_megatron(model, mesh, options)
        return parallelize_gpt(model, mesh, options)

    def pretrained_config(self, module, path, fields):
        from hetero.interop.parts import open_part
        from hetero.models.gpt.hf import check_weights, gpt_config

        checkpoint = open_part(path, "text")
        training = {name: fields[name] for name in TRAINING_CHOICES if name in fields}  # the module's, not the checkpoint's
        config = replace(gpt_config(checkpoint.config, fields.get("seq_len"), module),
                         backend=fields.get("backend", "native"), **training)
        self.check_given(module, config, fields, {"seq_len", "backend", *TRAINING_CHOICES})
        check_weights(checkpoint, config, module)
        return config

    def hf_export(self, config, source):
        from hetero.interop.hf_checkpoint import HFExport
        from hetero.interop.parts import open_part
        from hetero.models.gpt.hf import ROUTED_BY_SIGMOID, beyond_layers, weight_names
        from hetero.models.gpt.hf_export_config import hf_config
        from hetero.models.gpt.hf_experts import StackedExperts, assemble_experts, with_zero_selection_bias

        if source is None:
            config_json = hf_config(config)
            family = config_json["model_type"]
            block = "block_sparse_moe" if family == "mixtral" else "mlp"  # the hub's spelling
            assemble = assemble_experts(block, set()) if config.moe else HFExport.assemble
            if family in ROUTED_BY_SIGMOID and not config.selection_bias:
                assemble = with_zero_selection_bias(assemble, config.num_experts)
            shared = "shared_experts" if family in ROUTED_BY_SIGMOID else "shared_expert"
            return HFExport(config_json, weight_names(config, block, shared), assemble=assemble)
        part = open_part(source, "text")  # a decoder, or a whole LLaVA's LM
        raw = getattr(part, "raw", lambda name: name)
        if not config.moe:
            return HFExport(part.config, weight_names(config), raw)
        experts = StackedExperts(part, config.num_experts)  # written back in the layout the source holds
        return HFExport(part.config, weight_names(config, experts.block, experts.shared), raw,
                        carried={name: raw(name) for name in part.names() if beyond_layers(name, config)},
                        assemble=assemble_experts(experts.block, set(experts.fused), experts.transposed))

    def load_pretrained(self, model, path):
        from hetero.models.gpt.hf import load_gpt

        return load_gpt(model, path)

    def data_keys(self, config: GPTConfig) -> tuple[str, ...]:
        return ("tokens", "labels")

    def optional_keys(self, available) -> tuple[str, ...]:
        return tuple(key for key in ("documents", "rope_positions") if key in available)

    def columns(self, config: GPTConfig) -> tuple[Column, ...]:
        row = (Dim("seq_len", config.seq_len),)
        ids = dict(dtype=LONG, high=config.vocab_size, bound="vocab_size")
        return (Column("tokens", row, **ids), Column("labels", row, ignore=IGNORE_INDEX, **ids),
                Column("documents", row, INTEGER, optional=True),
                Column("rope_positions", (Dim("", 3), *row), LONG, low=0, optional=True,
                       meaning="M-RoPE's temporal, height and width positions of each token, from 0",
                       fix="compute them with hetero.data.mrope_positions"),
                Column("label_counts", (), INTEGER, high=config.seq_len + 1, optional=True,
                       meaning=f"the labels of a row that carry a loss, 0..seq_len={config.seq_len}",
                       fix="count each row's labels other than the ignored ones"))

    def batch_errors(self, module: str, config: GPTConfig, batch: dict[str, torch.Tensor]) -> list[str]:
        errors = super().batch_errors(module, config, batch)
        if errors:
            return errors
        positions = [Column(key, (), INTEGER, low=-1, high=config.seq_len, meaning=f"a position of its "
                            f"{module}.model.seq_len={config.seq_len} long rows, or -1 for none",
                            fix="point each at a position of its row, or -1 for none")
                     for key in self.evaluation_keys(batch)]
        errors = column_errors(module, positions, batch)
        if "rope_positions" in batch and not config.mrope_sections:
            errors.append(f"{module}: the batch carries rope_positions (M-RoPE's three per token), but "
                          f"{module}.model.mrope_sections is empty; set the sections or leave the column out")
        if not errors and "documents" in batch:
            errors = [f"{module}: {error}" for error in document_errors(batch["documents"])]
        return errors

    def evaluation_keys(self, available) -> tuple[str, ...]:
        return tuple(key for key in available if key.endswith("_position"))

    def metric_names(self, config: GPTConfig, available) -> list[tuple[str, str]]:
        return [(key.removesuffix("_position") + "_accuracy", "mean") for key in self.evaluation_keys(available)]

    def inputs(self, config: GPTConfig) -> dict[str, Port]:
        width = config.hidden_size * (1 + len(config.deepstack_layers))  # DeepStack's features beside each
        return {"embeddings": Port(width, tokens=config.seq_len, placeholders=True, field="hidden_size",
                                   sequence=True)}

    def outputs(self, config: GPTConfig) -> dict[str, Port]:
        return {"hidden": Port(config.hidden_size, tokens=config.seq_len, field="hidden_size", sequence=True)}

    def loss_count(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> int:
        """The supervised labels of ``rows``: ``label_counts`` where the batch has it (a loader that leaves
        out the rows a rank does not read), else counted."""
        if "label_counts" in batch:
            return int(batch["label_counts"][rows].sum())
        return int((take_rows(batch, "labels", rows) != IGNORE_INDEX).sum())

    def stage_shape(self, config: GPTConfig, rows: int, layout: Layout, options: ParallelOptions) -> tuple[int, ...]:
        """The residual stream: this rank's tokens (its CP chunks, its SP part), fp32 under bf16 autocast."""
        seq = config.seq_len // layout.cp
        if options.sequence_parallel and layout.tp > 1:
            seq //= layout.tp
        return (rows, seq, config.hidden_size)

    def compute(self, mesh: ModuleMesh) -> ContextManager:
        return loss_parallel() if mesh.layout.tp > 1 else contextlib.nullcontext()  # native: DTensor logits

    def stage(self, model: GPT, step: StageStep) -> StageResult:
        mesh, data = step.mesh, step.data
        cp, cp_rank = mesh.layout.cp, mesh.coord.cp
        tokens, labels = data["tokens"], data["labels"]
        seq_len = tokens.shape[1]
        # Where in the row the tokens this rank holds sit (its zigzag chunks under CP); their RoPE
        # positions, which restart per document in packed rows.
        held = torch.arange(seq_len, device=step.device)
        if cp > 1:
            tokens, labels = split_for_cp(tokens, 1, cp, cp_rank), split_for_cp(labels, 1, cp, cp_rank)
            held = zigzag_indices(seq_len, cp, cp_rank, device=step.device)
        documents = Documents(step.host["documents"], step.device) if "documents" in step.host else None
        if "rope_positions" in data:  # M-RoPE's, computed on the host per row: (3, rows, held)
            positions = data["rope_positions"][:, :, held].transpose(0, 1)
        else:
            positions = held if documents is None else documents.positions()[:, held]
        x = tokens if mesh.is_first_stage else step.activation
        inserts = [(arrival.index, arrival.tensor, arrival.positions) for arrival in step.inputs]
        # The experts' auxiliary losses are means over every token of the global batch; reported as sums
        # over the runtime's divisor, like the loss.
        aux_scale = 1.0 / (max(step.global_rows, 1) * seq_len) if step.config.moe else None
        report = step.loss_count * aux_scale if aux_scale is not None else 0.0
        if not mesh.is_last_stage:
            activation = model(x, positions, inserts=inserts, documents=documents, aux_scale=aux_scale)
            return StageResult(activation=activation, parts=_aux_parts(model, report, step))
        logits, hidden = model(x, positions, return_hidden=True, inserts=inserts, documents=documents,
                               aux_scale=aux_scale)
        if isinstance(hidden, DTensor):  # sequence parallelism: this rank's part of the sequence
            hidden = hidden.to_local()
        loss = model.token_loss_sum(logits, labels) if isinstance(model, MegatronGPT) else token_loss_sum(logits, labels)
        result = StageResult(outputs={"hidden": hidden}, loss=loss, parts=_aux_parts(model, report, step))
        if not step.training and self.evaluation_keys(data):
            if isinstance(logits, DTensor):  # TP collectives
                logits = logits.full_tensor()
            elif isinstance(model, MegatronGPT):
                logits = model.whole_vocabulary(logits)
            for key in self.evaluation_keys(data):
                result.metrics[key.removesuffix("_position") + "_accuracy"] = _position_accuracy(
                    logits, labels, data[key], held, seq_len
                )
        return result


def _aux_parts(model: GPT, scale: float, step: StageStep) -> dict[str, torch.Tensor]:
    """The experts' auxiliary losses of the forward just run, summed over this stage's layers and (each TP
    rank routes its part of the tokens) over its TP group, times ``scale``; none without experts."""
    if not step.config.moe:
        return {}
    mesh = step.mesh
    layers = [layer for _, layer in routed_layers(model)]
    if not layers:
        return {}
    parts = torch.stack([torch.stack([layer.last_aux[name] for layer in layers]).sum() for name in AUX_PARTS]) * scale
    if mesh.layout.tp > 1:
        dist.all_reduce(parts, group=mesh.group("tp"))
    return dict(zip(AUX_PARTS, parts))


def _position_accuracy(
    logits: torch.Tensor, labels: torch.Tensor, wanted: torch.Tensor, local: torch.Tensor, seq_len: int
) -> Metric:
    """Next-token accuracy at one position per row (``wanted``, global; -1 or an unsupervised label: not
    evaluated) from the whole vocabulary's ``logits``, counted on the rank whose sequence chunk holds it."""
    where = torch.full((seq_len,), -1, dtype=torch.long, device=local.device)
    where[local] = torch.arange(len(local), device=local.device)
    index = where[wanted.clamp(min=0)]
    rows = torch.nonzero((wanted >= 0) & (index >= 0)).flatten()
    rows = rows[labels[rows, index[rows]] != IGNORE_INDEX]
    hits = (logits[rows, index[rows]].argmax(-1) == labels[rows, index[rows]]).sum()
    return Metric(hits.double(), torch.tensor(float(len(rows)), dtype=torch.float64, device=local.device))
