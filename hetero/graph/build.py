"""Check an experiment and build its module graph, before any process group exists.

Everything a run could trip over later is refused here with the field, the numbers and the fix: unknown
kinds, model sizes a layout cannot split, placements that leave ranks idle, batches that do not divide,
edges naming no module or no port, widths that differ across an edge, cycles, a module no edge reaches,
an input nothing feeds, and settings the runtime does not support yet.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hetero.config import ExperimentConfig
from hetero.errors import ConfigError
from hetero.graph.frozen import frozen_errors
from hetero.graph.graph import Edge, Graph, Node
from hetero.kinds.registry import KindRegistry, Port
from hetero.parallel.sharding import Sharding
from hetero.parallel.placement import Placement, place

SCHEDULES = ("auto", "phased", "graph_1f1b")


def build_graph(experiment: ExperimentConfig, registry: KindRegistry) -> Graph:
    """The experiment's graph of modules and edges, each module of its kind in ``registry`` (assembled at the
    entry point: ``hetero.models.default_registry()`` and the user's kinds); ``ConfigError`` listing every
    problem found."""
    _check_names(experiment, registry)
    order = _topological_order(list(experiment.modules), [(e.src, e.dst) for e in experiment.edges])
    placement = place(
        {name: module.layout for name, module in experiment.modules.items()}, experiment.world_size, experiment.placement
    )
    nodes = {
        name: Node(name, i, registry[module.kind], experiment.model_config(name, registry), placement.layouts[name], module)
        for i, (name, module) in enumerate(experiment.modules.items())
    }
    errors: list[str] = []
    for name, node in nodes.items():
        frozen, trains = _frozen(node)
        errors += frozen
        nodes[name] = replace(node, trains=trains)
    for node in nodes.values():
        errors += node.kind.errors(node.name, node.config, node.layout, node.options)
        errors += node.options.errors(node.name)
        errors += node.settings.compression.errors(node.name, node.layout.cp, node.options.fsdp)
        errors += _expert_errors(node) + _megatron_errors(node)
        width = getattr(node.config, "hidden_size", 0)
        errors += node.settings.compression.pipeline.errors(f"{node.name}.compression.pipeline", experiment.train.sample_reuse, width)
    errors += _batch_errors(experiment, placement)
    errors += _train_errors(experiment)
    edges, edge_errors = _edges(experiment, nodes)
    errors += edge_errors
    if errors:
        raise ConfigError("\n".join(errors))
    _check_connected(nodes, edges)
    schedule = resolve_schedule(experiment, placement)
    graph = Graph(nodes, tuple(edges), order, placement, schedule)
    microbatches = experiment.num_microbatches(order[0], nodes[order[0]].layout.dp)
    if errors := [e for name in order for e in _forward_ahead_errors(graph, name, microbatches)]:
        raise ConfigError("\n".join(errors))
    return graph


def _forward_ahead_errors(graph: Graph, name: str, microbatches: int) -> list[str]:
    """What ``parallel.forward_ahead`` asks of a module: forward only in training, reading only the batch,
    on ranks of its own, one pipeline stage, plain outgoing edges, under graph_1f1b."""
    node = graph.nodes[name]
    ahead = node.options.forward_ahead
    if not ahead:
        return []
    field, errors = f"{name}.parallel.forward_ahead={ahead}", []
    if graph.backward(name):
        errors.append(f"{field}: only a module that runs forward only computes ahead (frozen, like everything it "
                      f"reads from), but {name} {'trains' if node.trains else 'reads from a module that trains'}")
    if graph.in_edges(name):
        errors.append(f"{field}: {name} reads from {', '.join(e.src for e in graph.in_edges(name))}; a module that "
                      "computes ahead reads only the batch")
    shared = sorted({other for rank in node.layout.ranks for other in graph.placement.modules_on(rank)} - {name})
    if shared:
        errors.append(f"{field}: {name} shares ranks with {', '.join(shared)}; give it ranks of its own "
                      f"({name}.layout.offset)")
    if node.layout.pp > 1:
        errors.append(f"{field}: {name}.layout.pp={node.layout.pp}; a module that computes ahead runs one stage")
    for edge in graph.out_edges(name):
        if edge.compression.enabled or edge.routed:
            errors.append(f"{field}: edge {edge.name} is {'compressed' if edge.compression.enabled else 'routed'}; "
                          "what a module computes ahead crosses plain edges (route or compress after a projector)")
    if graph.schedule != "graph_1f1b":
        errors.append(f"{field}: schedule={graph.schedule}; computing ahead needs schedule=graph_1f1b")
    if ahead > microbatches:
        errors.append(f"{field}: a step has {microbatches} microbatches; use at most {microbatches}")
    return errors


def _frozen(node: Node) -> tuple[list[str], bool]:
    """The module's ``frozen`` globs that match nothing, and whether it trains any parameter (its
    parameters' names from a build on the meta device: nothing allocated)."""
    settings = node.settings
    if not settings.frozen:
        return [], settings.trainable
    with torch.device("meta"):
        names = [name for name, _ in node.kind.build(node.config).named_parameters()]
    return frozen_errors(node.name, settings, names)


def _expert_errors(node: Node) -> list[str]:
    """What experts under ``layout.ep`` > 1 or ``tp`` > 1 ask of a module beyond its kind's own checks."""
    layout, name = node.layout, node.name
    if not node.kind.expert_parallel(node.config):
        return [] if layout.ep == 1 else [
            f"{name}.layout.ep={layout.ep}: this {node.kind.name} module has no experts to split (a gpt module has "
            f"them with model.num_experts > 0); set {name}.model.num_experts or remove {name}.layout.ep"]
    if node.settings.compression.compresses and (layout.ep > 1 or layout.tp > 1):
        return [f"{name}: compressed gradient syncs and DiLoCo run over dp×cp, while experts under ep={layout.ep}, "
                f"tp={layout.tp} sum their gradients over other ranks; turn {name}.compression.grad and "
                f"{name}.compression.diloco off or set ep=1 and tp=1"]
    return []


def _check_names(experiment: ExperimentConfig, registry: KindRegistry) -> None:
    for name, module in experiment.modules.items():
        if module.kind not in registry:
            raise ConfigError(
                f"{name}.kind={module.kind!r} is not a known module kind; use one of {', '.join(registry.names())} "
                f"(or register yours: hetero.kinds.KindRegistry.register, entry point group hetero.kinds)"
            )
    for i, edge in enumerate(experiment.edges):
        for end in ("src", "dst"):
            if getattr(edge, end) not in experiment.modules:
                raise ConfigError(
                    f"edges[{i}].{end}={getattr(edge, end)!r} names no module; modules are "
                    f"{', '.join(experiment.modules) or 'none'}"
                )
        if edge.src == edge.dst:
            raise ConfigError(f"edges[{i}] connects {edge.src} to itself; an edge joins two modules")
    if experiment.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"backend={experiment.backend!r} is not one of auto, gloo, nccl")
    if experiment.timeout_s <= 0:
        raise ConfigError(f"timeout_s={experiment.timeout_s} must be > 0")
    if experiment.schedule == "bubble_fill":
        raise ConfigError("schedule='bubble_fill': bubble filling is what schedule=graph_1f1b does where modules "
                          "share ranks with a pipelined one; set schedule=graph_1f1b")
    if experiment.schedule not in SCHEDULES:
        raise ConfigError(f"schedule={experiment.schedule!r} is not one of {', '.join(SCHEDULES)}")


def _batch_errors(experiment: ExperimentConfig, placement) -> list[str]:
    batch, errors = experiment.batch, []
    if batch.global_batch_size < 1 or batch.micro_batch_size < 1:
        return [f"batch.global_batch_size={batch.global_batch_size} and batch.micro_batch_size="
                f"{batch.micro_batch_size} must be >= 1"]
    for name, layout in placement.layouts.items():
        mbs = experiment.micro_batch_size(name)
        if mbs < 1:
            errors.append(f"{name}.micro_batch_size={mbs} must be >= 1")
        elif batch.global_batch_size % (layout.dp * mbs):
            errors.append(
                f"batch.global_batch_size={batch.global_batch_size} is not divisible by {name}'s "
                f"dp*micro_batch_size = {layout.dp}*{mbs} = {layout.dp * mbs}; use a global batch "
                f"that is a multiple of {layout.dp * mbs}"
            )
    if errors:
        return errors
    counts = {n: experiment.num_microbatches(n, l.dp) for n, l in placement.layouts.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(
            f"{n}: {batch.global_batch_size}/({placement.layouts[n].dp}*{experiment.micro_batch_size(n)}) = {c}"
            for n, c in counts.items()
        )
        errors.append(
            f"modules split the global batch into different numbers of microbatches ({listed}); "
            f"set each module's micro_batch_size so that global_batch_size/(dp*micro_batch_size) agree"
        )
    return errors


def _megatron_errors(node: Node) -> list[str]:
    """A module on the gpt kind's megatron backend freezes all of itself or nothing: megatron-core fuses
    q, k and v and the gate and up projections, which native-named globs could split."""
    if getattr(node.config, "backend", "native") != "megatron" or list(node.settings.frozen) in ([], ["*"]):
        return []
    return [f"{node.name}.frozen={list(node.settings.frozen)}: a megatron-backend module freezes all of itself "
            f"(frozen: ['*']) or nothing; use backend=native to freeze parts"]


def _train_errors(experiment: ExperimentConfig) -> list[str]:
    train, errors = experiment.train, []
    if train.sample_reuse < 1:
        errors.append(f"train.sample_reuse={train.sample_reuse} must be >= 1 (1: a fresh batch every step)")
    if train.wandb not in ("offline", "disabled"):
        errors.append(f"train.wandb={train.wandb!r} is not one of offline, disabled")
    if train.steps < 1:
        errors.append(f"train.steps={train.steps} must be >= 1")
    for key, allowed in (("nonfinite", ("skip", "stop")), ("bad_shards", ("error", "skip"))):
        if getattr(train, key) not in allowed:
            errors.append(f"train.{key}={getattr(train, key)!r} is not one of {', '.join(allowed)}")
    checkpoint = train.checkpoint
    if checkpoint.every < 0 or checkpoint.keep < 0:
        errors.append(f"train.checkpoint.every={checkpoint.every} and train.checkpoint.keep={checkpoint.keep} must be >= 0")
    return errors


def _port(ports: dict, chosen: str, module: str, what: str, field: str) -> tuple[str | None, str | None]:
    """The port an edge end names (or the module's only one), or an error."""
    if chosen:
        if chosen not in ports:
            return None, f"{field}={chosen!r} is not one of {module}'s {what}s: {', '.join(ports) or 'none'}"
        return chosen, None
    if len(ports) == 1:
        return next(iter(ports)), None
    if not ports:
        verb = "produces nothing another module can take" if what == "output" else "takes nothing from other modules"
        return None, f"{module} {verb}; remove the edge"
    return None, f"{module} has {what}s {', '.join(ports)}; name one with {field}"


def _edges(experiment: ExperimentConfig, nodes: dict[str, Node]) -> tuple[list[Edge], list[str]]:
    edges, errors, seen = [], [], set()
    offsets: dict[tuple[str, str], int] = {}
    for i, config in enumerate(experiment.edges):
        src, dst = nodes[config.src], nodes[config.dst]
        where = f"edges[{i}] ({src.name} -> {dst.name})"
        outputs, inputs = src.kind.outputs(src.config), dst.kind.inputs(dst.config)
        output, problem = _port(outputs, config.output, src.name, "output", f"edges[{i}].output")
        if problem:
            errors.append(f"{where}: {problem}")
        port_in, problem = _port(inputs, config.input, dst.name, "input", f"edges[{i}].input")
        if problem:
            errors.append(f"{where}: {problem}")
        if output is None or port_in is None:
            continue
        sent, taken = outputs[output], inputs[port_in]
        if (src.name, dst.name, output, port_in) in seen:
            errors.append(f"{where}: the same output already feeds the same input; remove the duplicate")
        seen.add((src.name, dst.name, output, port_in))
        if sent.width != taken.width:
            fix = (f"set {dst.name}.model.{taken.field}={sent.width}" if taken.width == 0 or not sent.field
                   else f"set {src.name}.model.{sent.field}={taken.width}")
            errors.append(
                f"{where}: {src.name} hands on width {sent.width} ({src.name}.model.{sent.field or output}) but "
                f"{dst.name}.model.{taken.field or port_in}={taken.width}; {fix}"
            )
        items = _item_errors(where, src, dst, sent, taken, port_in)
        errors += items
        if not items and not taken.placeholders and taken.tokens is not None and sent.tokens != taken.tokens:
            unit = "image" if src.kind.per_item(src.config) else "row"
            errors.append(
                f"{where}: {src.name} hands on {sent.tokens} tokens per {unit} but {dst.name}'s input {port_in} takes "
                f"{taken.tokens}; make {dst.name}.model match {src.name}'s {sent.tokens} tokens"
            )
        for module, port, name in ((src, sent, f"output {output}"), (dst, taken, f"input {port_in}")):
            if _splits_sequence(module) and not port.sequence:
                errors.append(
                    f"{where}: {module.name}'s {name} is whole on every rank, so {module.name} runs with cp=1 and "
                    f"sequence_parallel=false here (got {module.name}.layout.cp={module.layout.cp}, "
                    f"{module.name}.parallel.sequence_parallel={str(module.options.sequence_parallel).lower()})"
                )
        routed = src.kind.per_item(src.config) and taken.placeholders
        if routed and config.compression.enabled:
            errors.append(f"{where}: images' tokens routed to their placeholders travel uncompressed; turn "
                          f"edges[{i}].compression off")
        if config.compression.enabled and (_splits_sequence(src) or _splits_sequence(dst)):
            errors.append(
                f"{where}: a compressed edge carries whole sequences; run {src.name} and {dst.name} with cp=1 and "
                f"sequence_parallel=false, or turn edges[{i}].compression off"
            )
        offset = 0
        if taken.placeholders and not routed:
            offset = offsets.get((dst.name, port_in), 0)
            offsets[(dst.name, port_in)] = offset + sent.tokens
            if taken.tokens is not None and offset + sent.tokens > taken.tokens:
                errors.append(
                    f"{where}: {dst.name}'s placeholders end at position {offset + sent.tokens} (the edges into it "
                    f"hold {offset + sent.tokens} tokens in edge order) beyond {dst.name}.model.seq_len={taken.tokens}"
                )
        elif not taken.placeholders and src.kind.modality not in (None, dst.kind.modality):
            errors.append(
                f"{where}: {dst.name} needs its {port_in} on every row it processes (rows with {dst.kind.modality}), "
                f"but {src.name} only processes rows with {src.kind.modality}"
            )
        errors += config.compression.errors(f"edges[{i}].compression", experiment.train.sample_reuse, sent.width)
        window = (offset, taken.tokens) if taken.placeholders and taken.tokens is not None else None
        tokens = 0 if routed else sent.tokens or 0
        edges.append(Edge(i, src.name, dst.name, output, port_in, tokens, sent.width, taken.placeholders,
                          offset, config.compression, _sharding(src), _sharding(dst, window), routed))
    for node in nodes.values():
        for port, spec in node.kind.inputs(node.config).items():
            feeding = [e for e in edges if e.dst == node.name and e.input == port]
            if not spec.placeholders and spec.width and len(feeding) != 1:
                fix = "add an edge into it or configure the model without it" if not feeding else "keep one"
                errors.append(f"{node.name}: its input {port} takes exactly one edge, got {len(feeding)}; {fix}")
    return edges, errors


def _item_errors(where: str, src: Node, dst: Node, sent: Port, taken: Port, port_in: str) -> list[str]:
    """What an edge into a non-placeholder input cannot carry between modules of items (images, any number
    per row) and of rows, or of items with their own token counts."""
    src_items, dst_items = src.kind.per_item(src.config), dst.kind.per_item(dst.config)
    if taken.placeholders or not (src_items or dst_items):
        return []
    if src_items and sent.tokens is None:
        field = getattr(src.config, "max_patches", None)
        native = f" ({src.name}.model.max_patches={field})" if field is not None else ""
        return [f"{where}: {src.name} hands on each image's own number of tokens{native}, which only placeholders "
                f"take, not {dst.name}'s input {port_in}; route {src.name} straight into placeholders, or give it "
                f"fixed-size images (max_patches=0, items=true)"]
    if not dst_items:
        fix = (f"set {dst.name}.model.items=true" if hasattr(dst.config, "items")
               else f"feed {src.name} into placeholders")
        return [f"{where}: {src.name} hands on images as items, any number per row, but {dst.name}'s input {port_in} "
                f"takes one per row; {fix}"]
    if not src_items:
        fix = (f"set {src.name}.model.items=true" if hasattr(src.config, "items")
               else f"feed {dst.name} from a module of items")
        return [f"{where}: {dst.name} takes images as items, any number per row, but {src.name} hands on one per row; "
                f"{fix}"]
    return []


def _splits_sequence(node: Node) -> bool:
    return node.layout.cp > 1 or (node.options.sequence_parallel and node.layout.tp > 1)


def _sharding(node: Node, window: tuple[int, int] | None = None) -> Sharding:
    """How ``node`` lays out an edge tensor ``(rows, tokens, width)``: rows over DP, and tokens as its
    sequence (zigzag over CP, SP's parts over TP) where it splits its sequence, else whole on every rank."""
    if not _splits_sequence(node):
        return Sharding(batch_dim=0, seq_dim=None)
    sequence_parallel = node.options.sequence_parallel and node.layout.tp > 1
    return Sharding(batch_dim=0, seq_dim=1, zigzag=True, sequence_parallel=sequence_parallel, window=window)


def _topological_order(names: list[str], edges: list[tuple[str, str]]) -> tuple[str, ...]:
    order, state = [], dict.fromkeys(names, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(name: str, path: list[str]) -> None:
        if state[name] == 2:
            return
        if state[name] == 1:
            cycle = list(reversed(path[path.index(name):] + [name]))  # in the edges' direction
            raise ConfigError(f"edges form a cycle {' -> '.join(cycle)}; a module graph must be acyclic")
        state[name] = 1
        for src, dst in edges:
            if dst == name:
                visit(src, path + [name])
        state[name] = 2
        order.append(name)

    for name in names:
        visit(name, [])
    return tuple(order)


def _check_connected(nodes: dict[str, Node], edges: list[Edge]) -> None:
    if len(nodes) < 2:
        return
    joined = {e.src for e in edges} | {e.dst for e in edges}
    alone = [name for name in nodes if name not in joined]
    if alone:
        raise ConfigError(
            f"module {alone[0]} is joined to no other module; add an edge from or to it (edges: [{{src: ..., dst: "
            f"{alone[0]}}}]) or remove it"
        )


def resolve_schedule(experiment: ExperimentConfig, placement: Placement) -> str:
    """The schedule ``experiment`` runs on ``placement``: what it asks for, or what ``auto`` picks."""
    if experiment.schedule == "auto":
        # Where every module spans every rank, filling a pipeline's bubbles measured no faster here
        # (hetero bench schedules): there it stays opt-in.
        return "phased" if placement.mode == "colocated" else "graph_1f1b"
    return experiment.schedule
