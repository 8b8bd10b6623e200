"""A cluster description for the planner: nodes, devices and links, read from YAML.

    name: h100-64
    nodes: 8
    gpus_per_node: 8
    device: {memory_gib: 80, peak_tflops: 989, matmul_tflops: 700, matmul_overhead_us: 8,
             memory_gb_s: 2700, elementwise_overhead_us: 4, activation_bytes: 2, precision: bf16}
    intra_node: {bandwidth_gb_s: 360, latency_us: 6}
    inter_node: {bandwidth_gb_s: 45, latency_us: 12}
    host: {decode_ms_per_megapixel: 12, loader_workers: 8}

``peak_tflops`` is the datasheet figure MFU divides by; ``matmul_tflops`` and ``matmul_overhead_us``
are what a GEMM really takes (time = overhead + FLOPs / rate), measured on the machine itself by
``hetero plan --calibrate`` or taken from published GEMM sweeps for a cluster not at hand.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import yaml

from hetero.errors import ConfigError


@dataclass
class DeviceSpec:
    memory_gib: float = 80.0
    peak_tflops: float = 989.0  # declared peak, MFU's denominator
    matmul_tflops: float = 700.0  # sustained GEMM rate
    matmul_overhead_us: float = 8.0  # per GEMM (launch, tails): small GEMMs run below the sustained rate
    # GEMM efficiency by shape (0: off, every GEMM at the sustained rate): the output is computed in
    # gemm_tile x gemm_tile tiles, one per streaming multiprocessor at a time (sms of them), so a GEMM pays
    # for its padded tiles and one with fewer tiles than SMs leaves the rest idle.
    sms: int = 0
    gemm_tile: int = 128
    attention_head_tile: int = 0  # attention kernels round head_dim up to a multiple of this (0: exact)
    attention_tflops: float = 0.0  # sustained attention rate (0: the GEMM rate)
    memory_gb_s: float = 2700.0  # sustained memory bandwidth of elementwise kernels
    elementwise_overhead_us: float = 4.0  # per elementwise kernel
    # What tensor parallelism adds to one layer's forward and backward beyond its all-reduces (DTensor's
    # dispatch and redistributions); calibrated on CPU, where it is paid in full. On GPUs the host runs
    # ahead of the device and hides it for large layers: 0 unless measured.
    tp_layer_overhead_us: float = 0.0
    activation_bytes: int = 2  # bytes of an activation element (bf16: 2, fp32: 4)
    precision: str = "bf16"  # bf16: bf16 weights + fp32 grads and master/Adam sharded over DP; fp32: 16 B/param
    usable_memory: float = 0.9  # share of memory_gib the planner fills (allocator slack, workspaces)


@dataclass
class HostSpec:
    """The CPUs beside each device, as far as its data loading goes."""

    # Decoding and preprocessing an image (Pillow, then hetero's ImagePipeline) on one core, per megapixel
    # (0: free); the planner takes the model's input image (image_size²) as the decoded size. A rank
    # decodes its own replica's images (per-rank loading).
    decode_ms_per_megapixel: float = 0.0
    loader_workers: int = 4  # data workers per rank, decoding in parallel with the step


@dataclass
class LinkSpec:
    bandwidth_gb_s: float = 45.0  # per GPU, one direction
    latency_us: float = 10.0  # per collective step or message


@dataclass
class ClusterSpec:
    name: str = "cluster"
    nodes: int = 1
    gpus_per_node: int = 8
    device: DeviceSpec = field(default_factory=DeviceSpec)
    intra_node: LinkSpec = field(default_factory=lambda: LinkSpec(360.0, 6.0))
    inter_node: LinkSpec = field(default_factory=LinkSpec)
    host: HostSpec = field(default_factory=HostSpec)
    gpus: int = 0  # devices in all, the last node partly used (0: every device of every node)

    @property
    def world_size(self) -> int:
        return self.gpus or self.nodes * self.gpus_per_node

    def gpus_errors(self) -> list[str]:
        whole = self.nodes * self.gpus_per_node
        if self.gpus and not whole - self.gpus_per_node < self.gpus <= whole:
            return [f"gpus={self.gpus} does not fill the last of nodes={self.nodes} of gpus_per_node={self.gpus_per_node}: "
                    f"give {whole - self.gpus_per_node + 1} to {whole}, or set nodes={-(-self.gpus // self.gpus_per_node)}"]
        return []

    def link(self, span: int) -> LinkSpec:
        """The slowest link a group of ``span`` consecutive ranks crosses."""
        return self.intra_node if span <= self.gpus_per_node else self.inter_node

    def to_yaml(self) -> str:
        return yaml.safe_dump(asdict(self), sort_keys=False)


def _section(cls, raw: object, where: str):
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
    values = {}
    for name, value in raw.items():
        default = getattr(cls(), name)
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{where}.{name}={value!r} must be a non-negative number")
            value = type(default)(value) if isinstance(default, float) else value
        values[name] = value
    return cls(**values)


def cluster_from_dict(raw: dict, source: str = "cluster") -> ClusterSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a cluster description is a mapping (nodes, gpus_per_node, device, ...)")
    top = {k: v for k, v in raw.items() if k not in ("device", "intra_node", "inter_node", "host")}
    spec = _section(ClusterSpec, top, source)
    spec.device = _section(DeviceSpec, raw.get("device"), f"{source}: device")
    spec.intra_node = _section(LinkSpec, raw.get("intra_node"), f"{source}: intra_node") if "intra_node" in raw else spec.intra_node
    spec.inter_node = _section(LinkSpec, raw.get("inter_node"), f"{source}: inter_node")
    spec.host = _section(HostSpec, raw.get("host"), f"{source}: host")
    errors = []
    for name in ("nodes", "gpus_per_node"):
        if not isinstance(getattr(spec, name), int) or getattr(spec, name) < 1:
            errors.append(f"{name}={getattr(spec, name)!r} must be a positive integer")
    errors += spec.gpus_errors()
    device = spec.device
    for name in ("memory_gib", "peak_tflops", "matmul_tflops", "memory_gb_s"):
        if getattr(device, name) <= 0:
            errors.append(f"device.{name} must be positive")
    if device.precision not in ("bf16", "fp32"):
        errors.append(f"device.precision={device.precision!r} is not one of bf16, fp32")
    if not 0 < device.usable_memory <= 1:
        errors.append(f"device.usable_memory={device.usable_memory} must be in (0, 1]")
    if spec.host.loader_workers < 1:
        errors.append(f"host.loader_workers={spec.host.loader_workers} must be at least 1 (a rank decodes its images "
                      "in at least one worker)")
    for name in ("intra_node", "inter_node"):
        if getattr(spec, name).bandwidth_gb_s <= 0:
            errors.append(f"{name}.bandwidth_gb_s must be positive")
    if errors:
        raise ConfigError(f"{source}: " + "; ".join(errors))
    return spec


def load_cluster(path: str | Path) -> ClusterSpec:
    path = Path(path)
    if not path.is_file():
        shipped = Path(__file__).resolve().parents[2] / "configs" / "cluster" / f"{path.name}.yaml"
        if not shipped.is_file():
            raise ConfigError(f"--cluster {path}: no such file (nor a shipped cluster configs/cluster/{path.name}.yaml)")
        path = shipped
    return cluster_from_dict(yaml.safe_load(path.read_text()), str(path))
