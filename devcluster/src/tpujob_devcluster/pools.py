"""TPU node pools as GKE presents them: the devcluster's pools (pools.yaml) and their Node objects.

kueue.py sizes its ClusterQueues from them and cluster.py creates their nodes (kwok keeps them alive).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from tpujob_contract import ACCELERATOR_LABEL, NODE_POOL_LABEL, TOPOLOGY_LABEL, TPU_RESOURCE
from tpujob_operator.tpu import SliceShape, slice_shape

from .controlplane import REPO_ROOT
from .podrunner import NODE_LABEL

POOLS_FILE = REPO_ROOT / "devcluster" / "pools.yaml"


@dataclass(frozen=True)
class Pool:
    name: str
    accelerator: str
    topology: str

    @property
    def shape(self) -> SliceShape:
        """Hosts and chips per host from the operator's own TPU table, so the two never disagree."""
        return slice_shape(self.accelerator, self.topology)


def load_pools(path: Path = POOLS_FILE) -> tuple[list[Pool], int]:
    raw = yaml.safe_load(path.read_text())
    return [Pool(p["name"], p["accelerator"], p["topology"]) for p in raw["pools"]], int(raw.get("system_nodes", 1))


def node_manifests(pools: list[Pool], system_nodes: int) -> list[dict[str, Any]]:
    """Node objects as GKE TPU node pools present them: one node per TPU host."""
    nodes = []
    for pool in pools:
        for index in range(pool.shape.hosts):
            nodes.append(
                _node(
                    f"gke-{pool.name}-{index}",
                    {
                        NODE_POOL_LABEL: pool.name,
                        ACCELERATOR_LABEL: pool.accelerator,
                        TOPOLOGY_LABEL: pool.topology,
                    },
                    {TPU_RESOURCE: str(pool.shape.chips_per_host)},
                    [{"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}],
                )
            )
    for index in range(system_nodes):
        nodes.append(_node(f"gke-system-{index}", {NODE_POOL_LABEL: "system"}, {}, []))
    return nodes


def _node(name: str, labels: dict[str, str], extra: dict[str, str], taints: list[dict[str, str]]) -> dict[str, Any]:
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", **extra}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                NODE_LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "type": "kwok",
                **labels,
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": taints},
        "status": {"capacity": capacity, "allocatable": capacity},
    }
