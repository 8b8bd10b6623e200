"""Dense bf16 tensor-core peaks (for MFU) and HBM bandwidths of NVIDIA data-center GPUs, per GPU, from
NVIDIA's datasheets.

Datasheets quote bf16 "with sparsity" (2:4 structured); the dense peak is half of that figure:
- A100 (SXM4 and PCIe): 312 TFLOP/s (datasheet: 624 with sparsity);
- H100 SXM: 989 (1,979 with sparsity); H100 PCIe: 756 (1,513); H100 NVL: 835 (1,671);
- H200 SXM: 989 (1,979); H200 NVL: 835 (1,671);
- B200 (HGX, 1000 W): 2,250 (HGX B200: 36 PFLOPS for 8 GPUs with sparsity).
HBM bandwidth: A100 40GB 1,555 GB/s, 80GB SXM 2,039, 80GB PCIe 1,935; H100 SXM 3,350, PCIe 2,000, NVL
3,900; H200 (SXM and NVL) 4,800; B200 8,000 (HGX B200: 64 TB/s for 8 GPUs).
Names are matched the way ``torch.cuda.get_device_name`` reports them (e.g. "NVIDIA H100 80GB HBM3").
"""

from __future__ import annotations

import torch

# Most specific first: "H100 PCIe" before "H100".
PEAKS_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("B200",), 2250.0),
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),
    (("A100",), 312.0),
)


HBM_GBS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("B200",), 8000.0),
    (("H200",), 4800.0),
    (("H100", "PCIE"), 2000.0),
    (("H100", "NVL"), 3900.0),
    (("H100",), 3350.0),
    (("A100", "80GB", "PCIE"), 1935.0),
    (("A100", "80GB"), 2039.0),
    (("A100",), 1555.0),
)


def _lookup(table: tuple[tuple[tuple[str, ...], float], ...], device_name: str) -> float | None:
    name = device_name.upper()
    return next((value for parts, value in table if all(part in name for part in parts)), None)


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``device_name``, or None for one this table lacks."""
    return _lookup(PEAKS_TFLOPS, device_name)


def hbm_bandwidth_gbs(device_name: str) -> float | None:
    """The datasheet memory bandwidth (GB/s) of the GPU called ``device_name``, or None."""
    return _lookup(HBM_GBS, device_name)


def local_device_peak_tflops() -> tuple[float | None, str]:
    """This machine's first CUDA device's dense bf16 peak and its name (None and "cpu" without CUDA)."""
    if not torch.cuda.is_available():
        return None, "cpu"
    name = torch.cuda.get_device_name(0)
    return dense_bf16_peak_tflops(name), name
