"""A fault schedule: events at times, drawn by Hypothesis (so a violation shrinks to a short one), and
the run of one schedule through the world and the operator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st
from tpujob_contract import QUEUE_LABEL
from tpujob_operator import api

from .control import Operator
from .invariants import Watch, check
from .world import ACCELERATOR, TOPOLOGY, Config, World

Kind = Literal[
    "crash",
    "evict_for_memory",
    "drain",
    "node_shutdown",
    "node_lost",
    "partition",
    "heal_partitions",
    "auto_repair",
    "hang",
    "other_tenant",
    "kueue_preempt",
    "storage_outage",
    "workers_storage_outage",
    "workers_denied",
    "suspend",
    "unsuspend",
    "suspend_briefly",
    "delete_job",
    "operator_crash",
    "wait",
]
KINDS: tuple[Kind, ...] = Kind.__args__  # type: ignore[attr-defined]
TAIL_SECONDS = 240  # after the last event: long enough for every release and restart to play out


@dataclass(frozen=True)
class Event:
    kind: Kind
    arg: int  # which pod, pool, how many seconds or API calls
    after: int  # seconds of the world between this event and the next

    def __repr__(self) -> str:
        return f"Event({self.kind!r}, {self.arg}, {self.after})"


events = st.builds(Event, st.sampled_from(KINDS), st.integers(0, 60), st.integers(0, 40))
schedules = st.lists(events, max_size=14)
configs = st.builds(
    Config,
    save_seconds=st.integers(1, 12),
    final_save_seconds=st.sampled_from([0, 0, 0, 85]),  # 85: past the 60 s hang timeout, within twice it
    backoff_seconds=st.sampled_from([0, 0, 5]),
    spare_pools=st.integers(0, 2),
    max_restarts=st.integers(0, 4),
    repair_seconds=st.sampled_from([5, 30, 300]),
    elastic=st.booleans(),
    pod_watch_lag_seconds=st.sampled_from([0, 0, 1, 3]),
    kueue=st.booleans(),
    in_place=st.sampled_from([False, False, True]),
)


def training_job(config: Config) -> dict[str, Any]:
    return {
        "apiVersion": "tpujob.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "llama",
            "namespace": "ml",
            "uid": "uid-1",
            "generation": 1,
            "labels": {QUEUE_LABEL: "team-a"} if config.kueue else {},
        },
        "spec": {
            "image": "trainer:1",
            "args": ["--steps", str(config.final_step)],
            "tpu": {"accelerator": ACCELERATOR, "topology": TOPOLOGY, "slices": config.slices},
            "checkpoint": {"directory": "gs://bucket/runs", "keep": {"latest": config.keep}},
            "restart": {
                "maxRestarts": config.max_restarts,
                "backoffSeconds": config.backoff_seconds,
                "hangTimeoutSeconds": config.hang_timeout_seconds,
                **(
                    {"strategy": "InPlace", "inPlace": {"maxRestarts": config.in_place_max_restarts}}
                    if config.in_place
                    else {}
                ),
            },
            **({"elastic": _elastic(config)} if config.elastic else {}),
        },
        "status": {},
    }


def _elastic(config: Config) -> dict[str, int]:
    spec = {"minSlices": 1, "shrinkAfterSeconds": config.shrink_after_seconds}
    if "grow_after_seconds" in api.ElasticSpec.model_fields:  # not in an operator from before issue 30
        spec["growAfterSeconds"] = config.grow_after_seconds
    return spec


def apply(world: World, operator: Operator, event: Event) -> None:
    if event.kind in ("crash", "evict_for_memory", "drain", "node_shutdown", "node_lost", "partition", "hang"):
        getattr(world, event.kind)(event.arg)
    elif event.kind in ("heal_partitions", "auto_repair", "delete_job"):
        getattr(world, event.kind)()
    elif event.kind == "other_tenant":
        world.other_tenant(event.arg % (world.config.slices + world.config.spare_pools), 10 + 5 * event.arg)
    elif event.kind == "kueue_preempt":
        world.kueue_preempt(event.arg % 10)
    elif event.kind == "storage_outage":
        world.storage_outage(5 * event.arg)
    elif event.kind == "workers_denied":
        world.workers_denied(1 + event.arg)
    elif event.kind == "workers_storage_outage":
        world.workers_storage_outage(5 * event.arg)
    elif event.kind in ("suspend", "unsuspend"):
        world.set_job_suspend(event.kind == "suspend")
    elif event.kind == "suspend_briefly":  # a user's `suspend: true`, then `false` a few seconds later
        world.set_job_suspend(True)
        world.later(event.arg % 15, lambda: world.set_job_suspend(False))
    elif event.kind == "operator_crash":
        operator.crash_after = event.arg % 4


def run(config: Config, schedule: list[Event]) -> list[str]:
    """The schedule's violations (the first second that has any), or none."""
    world = World(config, training_job(config))
    operator = Operator(world)
    watch = Watch()
    for event in [*schedule, Event("wait", 0, TAIL_SECONDS)]:
        apply(world, operator, event)
        for _ in range(event.after + 1):
            world.tick()
            operator.maybe_reconcile()
            if found := check(world, operator, watch):
                return found
    return []
