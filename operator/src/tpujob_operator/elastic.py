"""spec.elastic (pure): the slice count a job goes on with when a slice cannot be placed, and when it
grows back.

A reduced size divides spec.tpu.slices (api.elastic_sizes): the trainer then accumulates gradients
over tpu.slices / size microbatches, each of the full-size run's per-device shape, so that every step
is the full-size step. Shrinking happens while an attempt waits to be scheduled (a slice's pods stay
unschedulable for shrinkAfterSeconds); growing while it trains, once enough TPU node pools of the
job's shape are ready and no pod holding TPU chips (the job's or another tenant's) is on them, and
no sooner than growAfterSeconds after the last resize.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import tpujob_contract as contract

from .api import TrainingJob, TrainingJobStatus, elastic_sizes
from .facts import JobSetFacts, NodeFacts
from .nodes import node_facts, node_signals
from .status import parse_time

CAPACITY_LOST = "CapacityLost"
CAPACITY_RETURNED = "CapacityReturned"
RESIZING = "Resizing"  # the phase reason from a resize's decision until its attempt exists
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def slices_in_force(tj: TrainingJob, status: TrainingJobStatus, current: JobSetFacts | None = None) -> int:
    """The current attempt's slice count: its JobSet's, else what status decided, else the spec's."""
    return (current.slices if current is not None else 0) or status.slices or tj.spec.tpu.slices


def placed_slices(current: JobSetFacts, hosts_per_slice: int) -> int:
    """Slices of the attempt whose every worker pod is scheduled."""
    per_slice = Counter(p.slice for p in current.pods if p.scheduled_at is not None and p.slice is not None)
    return sum(1 for placed in per_slice.values() if placed >= hosts_per_slice)


def shrink_to(tj: TrainingJob, current_slices: int, placed: int) -> int | None:
    """The largest allowed size below `current_slices` that the placed slices fill (None: none)."""
    elastic = tj.spec.elastic
    if elastic is None:
        return None
    fits = [d for d in elastic_sizes(tj.spec.tpu.slices, elastic.min_slices) if d < current_slices and d <= placed]
    return fits[0] if fits else None


def grow_to(tj: TrainingJob, current_slices: int, spare_pools: int | None) -> int | None:
    """The largest allowed size above `current_slices` that the spare ready pools make room for."""
    elastic = tj.spec.elastic
    if elastic is None or spare_pools is None:
        return None
    room = current_slices + spare_pools
    fits = [d for d in elastic_sizes(tj.spec.tpu.slices, elastic.min_slices) if current_slices < d <= room]
    return fits[0] if fits else None


def wants_pools(body: Mapping[str, Any]) -> bool:
    """Whether a TrainingJob's decision needs the count of spare pools (elastic, below its full size),
    from its cached body: asked on the event loop, before the body is parsed."""
    spec = body.get("spec") or {}
    full = int((spec.get("tpu") or {}).get("slices") or 1)
    return spec.get("elastic") is not None and int((body.get("status") or {}).get("slices") or full) < full


def _schedulable(node: NodeFacts) -> bool:
    blocking = [t for t in node.taints if t.effect in _BLOCKING_EFFECTS and t.key != contract.TPU_RESOURCE]
    return node.ready == "True" and not node.unschedulable and not blocking and not node_signals(node)


def spare_pool_nodes(
    tj: TrainingJob, nodes: Iterable[Mapping[str, Any]], hosts_per_slice: int, busy_nodes: Iterable[str]
) -> list[list[str]]:
    """The nodes, pool by pool, of the TPU node pools of the job's accelerator and topology with
    `hosts_per_slice` schedulable nodes and none of `busy_nodes` (where the job's pods are)."""
    wanted = {contract.ACCELERATOR_LABEL: tj.spec.tpu.accelerator, contract.TOPOLOGY_LABEL: tj.spec.tpu.topology}
    busy = set(busy_nodes)
    members: dict[str, list[Mapping[str, Any]]] = {}
    for body in nodes:
        labels = (body.get("metadata") or {}).get("labels") or {}
        pool = labels.get(contract.NODE_POOL_LABEL)
        if pool and all(labels.get(k) == v for k, v in wanted.items()):
            members.setdefault(str(pool), []).append(body)
    spare = []
    for bodies in members.values():
        facts = [node_facts(b) for b in bodies]
        if len(facts) >= hosts_per_slice and all(_schedulable(f) for f in facts) and not busy & {f.name for f in facts}:
            spare.append(sorted(f.name for f in facts))
    return spare


def spare_pools(pools: Iterable[Iterable[str]], occupied_nodes: Iterable[str]) -> int:
    """Of the spare pools' nodes (spare_pool_nodes), the pools none of whose nodes runs a pod that holds
    TPU chips (another tenant's, or this job's earlier attempt's): only those can take a slice now."""
    occupied = set(occupied_nodes)
    return sum(1 for names in pools if not occupied & set(names))


def grow_wait(tj: TrainingJob, status: TrainingJobStatus, now: datetime) -> float:
    """Seconds before spec.elastic may grow again (0: it may now). A grow restarts the job, and a grow
    into capacity that goes again is followed by a shrink after shrinkAfterSeconds: waiting
    growAfterSeconds after every resize bounds the resizes in any window to two per
    shrinkAfterSeconds + growAfterSeconds, however the capacity comes and goes."""
    resize = status.last_resize
    since = parse_time(resize.time) if resize is not None else None
    if tj.spec.elastic is None or since is None:
        return 0.0
    return max(0.0, grow_cooldown_seconds(tj) - (now - since).total_seconds())


def grow_cooldown_seconds(tj: TrainingJob) -> int:
    return tj.spec.elastic.grow_after_seconds if tj.spec.elastic is not None else 0
