"""GKE TPU accelerator table: accelerator + topology -> hosts per slice and chips per host.

Users type only the GKE accelerator name and topology (as on the node pool labels
cloud.google.com/gke-tpu-accelerator and cloud.google.com/gke-tpu-topology); everything else is
derived here so it cannot disagree with what GKE schedules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AcceleratorFamily:
    """One GKE TPU accelerator type and the slice shapes GKE offers for it."""

    accelerator: str
    generation: str
    topologies: tuple[str, ...]
    # Chips on one multi-host VM; single-host shapes (<= max_single_host_chips) put every chip on one host.
    chips_per_multihost_vm: int
    max_single_host_chips: int


# The 3D shapes v4 and v5p share, and the 2D shapes of v5e and v6e (GKE's tables).
_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8")
_PLANES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

ACCELERATORS: dict[str, AcceleratorFamily] = {
    family.accelerator: family
    for family in (
        AcceleratorFamily(
            "tpu-v4-podslice", "v4", (*_CUBES, "8x8x12", "8x8x16", "8x16x16", "16x16x16"),
            chips_per_multihost_vm=4, max_single_host_chips=4,
        ),
        AcceleratorFamily(
            "tpu-v5p-slice", "v5p", (*_CUBES, "8x8x16", "8x16x16", "16x16x16", "16x16x24"),
            chips_per_multihost_vm=4, max_single_host_chips=4,
        ),
        AcceleratorFamily("tpu-v5-lite-podslice", "v5e", _PLANES, chips_per_multihost_vm=4, max_single_host_chips=8),
        AcceleratorFamily("tpu-v6e-slice", "v6e", _PLANES, chips_per_multihost_vm=4, max_single_host_chips=8),
    )
}  # fmt: skip


class UnknownTpuShape(ValueError):
    """The accelerator/topology pair is not one GKE offers."""


@dataclass(frozen=True)
class SliceShape:
    accelerator: str
    topology: str
    chips: int
    hosts: int
    chips_per_host: int


def chips_in(topology: str) -> int:
    return math.prod(int(dim) for dim in topology.split("x"))


def slice_shape(accelerator: str, topology: str) -> SliceShape:
    family = ACCELERATORS.get(accelerator)
    if family is None:
        raise UnknownTpuShape(f"unknown TPU accelerator {accelerator!r}; known: {sorted(ACCELERATORS)}")
    if topology not in family.topologies:
        raise UnknownTpuShape(
            f"topology {topology!r} is not offered for {accelerator}; valid: {', '.join(family.topologies)}"
        )
    chips = chips_in(topology)
    per_host = chips if chips <= family.max_single_host_chips else family.chips_per_multihost_vm
    return SliceShape(accelerator, topology, chips, chips // per_host, per_host)
