"""spec.elastic: its admission rules, the shrink and grow decisions, the ledger, the JobSet, the metrics."""

import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import tpujob_contract as contract
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from tpujob_operator import api, elastic
from tpujob_operator.facts import JobSetFacts, JobSetState, Observed, PodFacts
from tpujob_operator.jobset import build_jobset, jobset_facts
from tpujob_operator.metrics import OperatorMetrics
from tpujob_operator.nodes import slim_node
from tpujob_operator.observe import snapshot
from tpujob_operator.reconcile import reconcile
from tpujob_operator.status import rfc3339

from .factories import progress_record, training_job

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
UID = "0000-1111"
ELASTIC = {"minSlices": 1, "shrinkAfterSeconds": 300}
UNSCHEDULABLE = "0/6 nodes are available: 2 node(s) were unschedulable"


def _pod(slice_: int, host: int, scheduled: bool) -> PodFacts:
    name = f"llama-a1-slice-{slice_}-{host}"
    if scheduled:
        return PodFacts(name, slice_, "Pending", scheduled_at=T0, node=f"gke-pool-{slice_}-{host}")
    return PodFacts(name, slice_, "Pending", unschedulable_message=UNSCHEDULABLE)


def _jobset(attempt: int, slices: int, pods: tuple[PodFacts, ...], state: JobSetState = "Active") -> JobSetFacts:
    return JobSetFacts(
        f"llama-a{attempt}", attempt, None, T0, state, pods=pods, uid=UID, expected_pods=2 * slices, slices=slices
    )


def _reason(status: api.TrainingJobStatus) -> str | None:
    return next(c.reason for c in status.conditions if c.type == status.phase and c.status == "True")


# -- admission ----------------------------------------------------------------------------------------


def test_the_sizes_are_the_divisors_of_the_full_size_from_the_minimum_up():
    assert api.elastic_sizes(4, 1) == (4, 2, 1)
    assert api.elastic_sizes(6, 2) == (6, 3, 2)
    assert api.elastic_sizes(3, 2) == (3,)


@pytest.mark.parametrize(
    ("slices", "minimum", "message"),
    [
        (2, 2, api.ELASTIC_BELOW_FULL_MESSAGE),
        (1, 1, api.ELASTIC_BELOW_FULL_MESSAGE),
        (3, 2, api.ELASTIC_DIVISOR_MESSAGE),
    ],
)
def test_an_elastic_spec_without_a_smaller_size_is_refused_naming_the_field(slices, minimum, message):
    with pytest.raises(ValidationError) as refused:
        training_job(slices=slices, elastic={"minSlices": minimum})
    assert message in str(refused.value) and "spec.elastic.minSlices" in message


def test_maxtext_refuses_elastic():
    with pytest.raises(ValidationError, match=r"spec\.elastic is not supported with spec\.framework maxtext"):
        training_job(framework="maxtext", elastic=ELASTIC)


# -- shrinking ----------------------------------------------------------------------------------------


def _waiting(now: datetime, slices_placed: int = 1, **spec):
    """Attempt 1 of a 2-slice job (2 hosts a slice) after a failure: slice 0 placed, slice 1 not."""
    tj = training_job(
        status={"phase": "Restarting", "attempt": 1, "restarts": 1, "countedRestarts": 0, "stage": "Scheduling"},
        **{"elastic": ELASTIC, **spec},
    )
    pods = tuple(_pod(s, h, s < slices_placed) for s in range(2) for h in range(2))
    return reconcile(tj, Observed(now=now, jobsets=(_jobset(1, 2, pods),), latest_committed_step=100))


def test_an_unschedulable_slice_waits_shrink_after_seconds_then_the_job_goes_on_with_fewer():
    status, actions = _waiting(T0 + timedelta(seconds=100))
    assert (status.attempt, status.slices, actions.delete) == (1, None, [])
    assert _reason(status) == "Unschedulable"
    assert actions.requeue_after == pytest.approx(60)  # the scheduling stage's recheck
    _, actions = _waiting(T0 + timedelta(seconds=280))
    assert actions.requeue_after == pytest.approx(20)  # woken when shrinking is due

    status, actions = _waiting(T0 + timedelta(seconds=301))
    assert actions.delete == ["llama-a1"] and actions.create_attempt is None
    assert (status.attempt, status.job_set_name, status.slices, status.resizes) == (2, "llama-a2", 1, 1)
    assert (status.restarts, status.counted_restarts) == (1, 0)  # a resize is no restart
    assert (status.phase, _reason(status)) == ("Restarting", "Resizing")
    resize = status.last_resize
    assert (resize.from_slices, resize.to_slices, resize.reason, resize.attempt, resize.step) == (
        2,
        1,
        "CapacityLost",
        2,
        100,
    )
    assert UNSCHEDULABLE in resize.message
    assert [(e.type, e.reason) for e in actions.events] == [("Warning", "Resized")]


def test_no_shrink_when_no_slice_is_placed_or_the_job_is_not_elastic():
    late = T0 + timedelta(hours=2)
    status, actions = _waiting(late, slices_placed=0)
    assert (status.attempt, actions.delete) == (1, [])
    tj = training_job(status={"phase": "Restarting", "attempt": 1, "stage": "Scheduling"})
    pods = tuple(_pod(s, h, s == 0) for s in range(2) for h in range(2))
    status, actions = reconcile(tj, Observed(now=late, jobsets=(_jobset(1, 2, pods),), latest_committed_step=100))
    assert (status.attempt, status.slices, actions.delete) == (1, None, [])


def test_never_below_min_slices():
    tj = training_job(
        slices=4, status={"phase": "Restarting", "attempt": 1, "stage": "Scheduling"}, elastic={"minSlices": 2}
    )
    pods = tuple(_pod(s, h, s == 0) for s in range(4) for h in range(2))  # 1 of 4 placed: 2 would not fit
    status, actions = reconcile(
        tj, Observed(now=T0 + timedelta(hours=1), jobsets=(_jobset(1, 4, pods),), latest_committed_step=100)
    )
    assert (status.attempt, actions.delete) == (1, [])


def test_the_smaller_attempt_is_created_once_the_old_pods_are_gone():
    status, _ = _waiting(T0 + timedelta(seconds=301))
    tj = training_job(status=status.model_dump(by_alias=True, exclude_none=True), elastic=ELASTIC)
    later = T0 + timedelta(seconds=303)
    waiting, actions = reconcile(tj, Observed(now=later, latest_committed_step=100, earlier_pods=2))
    assert actions.create_attempt is None and _reason(waiting) == "Resizing"
    status, actions = reconcile(tj, Observed(now=later, latest_committed_step=100))
    assert (actions.create_attempt, actions.create_slices, actions.resume_step) == (2, 1, 100)
    assert (status.phase, _reason(status)) == ("Restarting", "Resizing")


def _queued(now: datetime, admitted: bool = False, pods: tuple[PodFacts, ...] = ()):
    """Attempt 3 in stage Queued since T0; `admitted`: the status last written said Kueue admitted it."""
    tj = training_job(
        status={
            "phase": "Pending",
            "attempt": 3,
            "slices": 2,
            "stage": "Queued",
            "stageStartTime": rfc3339(T0),
            "conditions": [{"type": "Pending", "status": "True", "reason": "Queued"}],
            "queue": {"name": "tpu", "admitted": admitted},
        },
        elastic=ELASTIC,
    )
    queued = JobSetFacts(
        "llama-a3", 3, None, T0, "Suspended", uid=UID, expected_pods=4, slices=2, queue_name="tpu",
        queue_reason="quota", pods=pods,
    )  # fmt: skip
    return reconcile(tj, Observed(now=now, jobsets=(queued,), latest_committed_step=300, queue_name="tpu"))


def test_an_attempt_kueue_does_not_admit_goes_one_size_down_after_shrink_after_seconds():
    status, actions = _queued(T0 + timedelta(seconds=290))
    assert (status.attempt, status.phase, actions.delete, actions.stop) == (3, "Pending", [], [])
    assert actions.requeue_after == pytest.approx(10)
    status, actions = _queued(T0 + timedelta(seconds=300))
    assert (actions.delete, actions.stop) == ([], ["llama-a3"]) and (status.attempt, status.slices) == (4, 1)
    assert (status.last_resize.reason, _reason(status)) == ("CapacityLost", "Resizing")
    assert "not admitted by Kueue queue tpu for 300s" in status.last_resize.message


def test_a_preempted_attempt_waits_shrink_after_seconds_from_the_preemption_and_its_workers_keep_their_save_grace():
    # Stage Queued since T0 (an outage kept the stage while Kueue admitted the JobSet), preempted now:
    # the wait for admission starts at the preemption, not at T0.
    saving = tuple(PodFacts(f"llama-a3-slice-{i}-0", i, "Running", scheduled_at=T0, node=f"n{i}") for i in (0, 1))
    preempted_at = T0 + timedelta(seconds=400)
    status, actions = _queued(preempted_at, admitted=True, pods=saving)
    assert (status.attempt, actions.delete, actions.stop) == (3, [], [])
    assert status.stage_start_time == rfc3339(preempted_at)
    assert actions.requeue_after is not None and actions.requeue_after <= 300  # woken by the time it is due
    # Not admitted for shrinkAfterSeconds since: one size down, the workers stopped with their save grace.
    later = training_job(status=status.model_dump(by_alias=True, exclude_none=True), elastic=ELASTIC)
    queued = JobSetFacts(
        "llama-a3", 3, None, T0, "Suspended", uid=UID, expected_pods=4, slices=2, queue_name="tpu",
        queue_reason="quota", pods=saving,
    )  # fmt: skip
    observed = Observed(now=preempted_at + timedelta(seconds=300), jobsets=(queued,), latest_committed_step=300)
    status, actions = reconcile(later, dataclasses.replace(observed, queue_name="tpu"))
    assert (actions.delete, actions.stop, status.attempt, status.slices) == ([], ["llama-a3"], 4, 1)


# -- growing -----------------------------------------------------------------------------------------


def _training_small(spare: int | None):
    tj = training_job(
        status={"phase": "Running", "attempt": 2, "slices": 1, "resizes": 1, "step": 150, "stage": "Training"},
        elastic=ELASTIC,
    )
    pods = tuple(PodFacts(f"p{h}", 0, "Running", scheduled_at=T0, node=f"gke-pool-0-{h}") for h in range(2))
    progress = progress_record(uid=UID, attempt=2, step=150, updated_at=T0 + timedelta(seconds=60))
    observed = Observed(
        now=T0 + timedelta(seconds=60),
        jobsets=(_jobset(2, 1, pods),),
        latest_committed_step=140,
        progress=progress,
        spare_pools=spare,
    )
    return tj, reconcile(tj, observed)


def test_a_ready_pool_grows_the_job_back_its_workers_stopped_to_save():
    _, (status, actions) = _training_small(spare=0)
    assert (status.phase, status.attempt, actions.stop) == ("Running", 2, [])
    _, (status, actions) = _training_small(spare=1)
    assert actions.stop == ["llama-a2"] and actions.delete == [] and actions.create_attempt is None
    assert (status.attempt, status.slices, status.resizes, status.restarts) == (3, 2, 2, 0)
    assert (status.last_resize.reason, status.last_resize.from_slices, status.last_resize.to_slices) == (
        "CapacityReturned",
        1,
        2,
    )
    assert [(e.type, e.reason) for e in actions.events] == [("Normal", "Resized")]

    # Next decision: the old JobSet (still there, if the operator died before deleting it) is stopped,
    # not killed, and the grown attempt waits for its pods to end.
    tj = training_job(status=status.model_dump(by_alias=True, exclude_none=True), elastic=ELASTIC)
    old = _jobset(2, 1, ())
    _, actions = reconcile(tj, Observed(now=T0 + timedelta(seconds=62), jobsets=(old,), earlier_pods=2))
    assert (actions.stop, actions.delete, actions.create_attempt) == (["llama-a2"], [], None)
    _, actions = reconcile(tj, Observed(now=T0 + timedelta(seconds=90), latest_committed_step=152))
    assert (actions.create_attempt, actions.create_slices, actions.resume_step) == (3, 2, 152)


def _node(name: str, pool: str, topology: str = "2x2x2", **spec: object) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": {
                contract.NODE_POOL_LABEL: pool,
                contract.ACCELERATOR_LABEL: "tpu-v5p-slice",
                contract.TOPOLOGY_LABEL: topology,
            },
        },
        "spec": spec,
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_spare_pools_are_ready_pools_of_the_jobs_shape_without_its_pods():
    tj = training_job(elastic=ELASTIC)
    nodes = [
        _node("a-0", "a"),
        _node("a-1", "a"),  # ready: spare
        _node("b-0", "b"),
        _node("b-1", "b", unschedulable=True),  # cordoned
        _node("c-0", "c"),
        _node("c-1", "c"),  # holds the job's pod
        _node("d-0", "d", topology="2x2x4"),
        _node("d-1", "d", topology="2x2x4"),  # another shape
        _node("e-0", "e"),  # one host of two
        _node("f-0", "f", taints=[{"key": contract.TPU_RESOURCE, "effect": "NoSchedule"}]),
        _node("f-1", "f", taints=[{"key": contract.TPU_RESOURCE, "effect": "NoSchedule"}]),  # TPU taint: tolerated
    ]
    pools = elastic.spare_pool_nodes(tj, nodes, 2, busy_nodes=["c-1"])
    assert pools == [["a-0", "a-1"], ["f-0", "f-1"]] and elastic.spare_pools(pools, occupied_nodes=()) == 2
    # Another tenant's TPU pod on one node of a pool: a slice cannot schedule there now.
    assert elastic.spare_pools(pools, occupied_nodes=["f-1"]) == 1
    nodes[0]["status"]["conditions"][0]["status"] = "False"
    assert elastic.spare_pools(elastic.spare_pool_nodes(tj, nodes, 2, busy_nodes=["c-1"]), ()) == 1


def test_a_grow_waits_out_the_cooldown_after_the_last_resize():
    shrunk = api.ResizeRecord(time=rfc3339(T0), from_slices=2, to_slices=1, reason="CapacityLost", attempt=2)
    tj = training_job(
        status={"phase": "Running", "attempt": 2, "slices": 1, "stage": "Training",
                "lastResize": shrunk.model_dump(by_alias=True, exclude_none=True)},
        elastic=ELASTIC,
    )  # fmt: skip
    pods = tuple(PodFacts(f"p{h}", 0, "Running", scheduled_at=T0, node=f"gke-pool-0-{h}") for h in range(2))
    cooldown = elastic.grow_cooldown_seconds(tj)
    assert cooldown == 600  # growAfterSeconds' default

    def decide(seconds: float):
        now = T0 + timedelta(seconds=seconds)
        progress = progress_record(uid=UID, attempt=2, step=150, updated_at=now)
        return reconcile(tj, Observed(now=now, jobsets=(_jobset(2, 1, pods),), progress=progress, spare_pools=1))

    status, actions = decide(cooldown - 10)
    assert (status.attempt, actions.stop) == (2, []) and actions.requeue_after == 10.5
    status, actions = decide(cooldown + 1)
    assert (status.attempt, status.slices, actions.stop) == (3, 2, ["llama-a2"])


def test_only_an_elastic_job_below_its_full_size_asks_for_the_pools():
    body = training_job(elastic=ELASTIC).model_dump(by_alias=True, exclude_none=True)
    assert not elastic.wants_pools(body)
    assert elastic.wants_pools({**body, "status": {"slices": 1}})
    assert not elastic.wants_pools({**body, "spec": {**body["spec"], "elastic": None}, "status": {"slices": 1}})


# -- the ledger, the JobSet, the metrics ---------------------------------------------------------------


def test_training_on_half_the_slices_is_half_productive():
    tj, _ = _training_small(spare=0)
    ledger = api.Goodput(updated_at=rfc3339(T0), attempt=2)
    tj = tj.model_copy(update={"status": tj.status.model_copy(update={"goodput": ledger})})
    progress = progress_record(uid=UID, attempt=2, step=160, updated_at=T0 + timedelta(seconds=100))
    pods = tuple(PodFacts(f"p{h}", 0, "Running", scheduled_at=T0) for h in range(2))
    status, _ = reconcile(
        tj, Observed(now=T0 + timedelta(seconds=100), jobsets=(_jobset(2, 1, pods),), progress=progress)
    )
    assert status.goodput.productive_seconds == pytest.approx(50)
    assert status.goodput.badput.reduced_size_seconds == pytest.approx(50)
    assert status.goodput.ratio == pytest.approx(0.5)


def test_the_smaller_attempts_jobset_runs_fewer_slices_and_tells_the_trainer_the_full_size():
    tj = training_job(slices=4, elastic={"minSlices": 1})
    manifest = build_jobset(tj, 3, 100, slices=2)
    replicated = manifest["spec"]["replicatedJobs"][0]
    env = {
        e["name"]: e.get("value") for e in replicated["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert replicated["replicas"] == 2
    assert (env[contract.Env.NUM_SLICES], env[contract.Env.FULL_SLICES], env[contract.Env.MEGASCALE_NUM_SLICES]) == (
        "2",
        "4",
        "2",
    )
    facts = jobset_facts(manifest, [])
    assert (facts.slices, facts.expected_pods) == (2, 4)  # v5p 2x2x2: 2 hosts a slice
    full = build_jobset(tj, 0, None)
    assert full["spec"]["replicatedJobs"][0]["replicas"] == 4


def test_resizes_are_counted_by_direction_and_the_slices_in_force_are_a_gauge():
    metrics = OperatorMetrics(CollectorRegistry())
    before, _ = _waiting(T0 + timedelta(seconds=100))
    after, _ = _waiting(T0 + timedelta(seconds=301))
    spec = training_job(elastic=ELASTIC).spec
    metrics.observe_reconcile("ml", "llama", before, after, T0, spec)
    labels = {"namespace": "ml", "name": "llama"}
    assert metrics.registry.get_sample_value("tpujob_resizes_total", {**labels, "direction": "shrink"}) == 1
    assert metrics.registry.get_sample_value("tpujob_slices", labels) == 1
    assert metrics.registry.get_sample_value("tpujob_full_slices", labels) == 2


def test_the_node_cache_keeps_the_pool_labels_and_only_an_elastic_job_below_full_size_gets_every_node():
    kept = slim_node(_node("a-0", "a"))
    assert kept["metadata"]["labels"] == _node("a-0", "a")["metadata"]["labels"]
    nodes = {"a-0": [kept], "a-1": [slim_node(_node("a-1", "a"))]}
    full = training_job(elastic=ELASTIC).model_dump(by_alias=True, exclude_none=True)
    key = ("ml", "llama")
    for status, expected in (({}, None), ({"slices": 1}, ["a-0", "a-1"])):
        indexes: Any = {"trainingjobs": {key: [{**full, "status": status}]}, "nodes": nodes}
        found = snapshot(key, indexes, None)
        assert found is not None
        assert (sorted(n["metadata"]["name"] for n in found.all_nodes) if found.all_nodes else None) == expected
