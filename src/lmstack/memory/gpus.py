"""The GPUs `lmstack plan --gpu NAME` knows: memory, compute capability and interconnect of the target.

Memory is the total a process sees (torch.cuda.get_device_properties(0).total_memory in GiB, below the
marketing GB figure: ECC and the driver's reserve); the H200's 139.8 is measured (bench/results), the
others are the vendors' MiB figures over 1024, rounded down. Compute capability decides FP8 (sm89+:
Ada, Hopper, Blackwell). Interconnect: "nvlink" where the GPUs of one node talk over NVLink/NVSwitch
(SXM boards), "pcie" where they only share the PCIe bus; tensor parallelism needs NVLink
(memory/parallel.py), and the planner says which one it assumed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuKind:
    name: str  # the table's key, lower case
    label: str  # how the vendor names it
    memory_gib: float
    capability: tuple[int, int]
    interconnect: str  # "nvlink" | "pcie"

    @property
    def fp8(self) -> bool:
        return self.capability >= (8, 9)

    def describe(self) -> str:
        major, minor = self.capability
        return f"{self.label}: {self.memory_gib:g} GiB, sm{major}{minor}, {self.interconnect}"


GPUS = {
    g.name: g
    for g in (
        GpuKind("b200", "NVIDIA B200 (SXM)", 178.4, (10, 0), "nvlink"),
        GpuKind("h200", "NVIDIA H200 (SXM)", 139.8, (9, 0), "nvlink"),
        GpuKind("h100", "NVIDIA H100 80GB (SXM)", 79.1, (9, 0), "nvlink"),
        GpuKind("h100-pcie", "NVIDIA H100 80GB PCIe", 79.1, (9, 0), "pcie"),
        GpuKind("a100-80", "NVIDIA A100 80GB (SXM)", 79.1, (8, 0), "nvlink"),
        GpuKind("a100-40", "NVIDIA A100 40GB (SXM)", 39.3, (8, 0), "nvlink"),
        GpuKind("l40s", "NVIDIA L40S", 44.3, (8, 9), "pcie"),
        GpuKind("l4", "NVIDIA L4", 22.0, (8, 9), "pcie"),
        GpuKind("a10g", "NVIDIA A10G", 22.0, (8, 6), "pcie"),
        GpuKind("4090", "NVIDIA GeForce RTX 4090", 23.6, (8, 9), "pcie"),
        GpuKind("3090", "NVIDIA GeForce RTX 3090", 23.6, (8, 6), "pcie"),
    )
}
ALIASES = {"a100": "a100-80", "rtx4090": "4090", "rtx3090": "3090", "h100-sxm": "h100"}


def gpu_kind(name: str) -> GpuKind:
    """The table's entry for `name` (case-insensitive, a few aliases); ValueError naming the known ones."""
    key = name.strip().lower().replace("_", "-")
    key = ALIASES.get(key, key)
    if key not in GPUS:
        known = ", ".join([*GPUS, *ALIASES])
        raise ValueError(
            f"unknown GPU {name!r}; known: {known} (or give --gpu-memory GiB and --gpu-capability X.Y)"
        )
    return GPUS[key]
