"""The resync after a watch gap (resync.py), on kopf's own index classes: what a fresh LIST lacks leaves
the indexes, the overlays of our own writes and the runtime's memory; a job re-created in the gap is
a new job. (The integration tier restarts a real apiserver: tests/integration/test_watch_gap.py.)"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from kopf._core.engines.indexing import OperatorIndexer
from tpujob_operator import resync
from tpujob_operator.nodes import slim_node
from tpujob_operator.observe import slim_jobset, slim_pod, slim_workload, without_managed_fields
from tpujob_operator.resync import Before, Listed, apply, vanished
from tpujob_operator.runtime import Runtime

NS = "ml"
GONE, AGAIN, ALIVE = (NS, "gone"), (NS, "again"), (NS, "alive")


def _obj(name: str, uid: str, **extra: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": NS, "name": name, "uid": uid, "resourceVersion": "1"}, **extra}


def _index(entries: dict[Any, list[dict[str, Any]]]) -> OperatorIndexer:
    """A kopf index filled the way kopf fills it: one entry per object, keyed (namespace, name, uid)."""
    indexer = OperatorIndexer()
    for key, values in entries.items():
        for value in values:
            indexer.replace(cast(Any, resync.entry_key(value)), {key: value})
    return indexer


def _runtime() -> tuple[Runtime, dict[str, OperatorIndexer]]:
    """Before the gap the operator knew three jobs; in the gap `gone` was deleted, `again` deleted and
    re-created (the relist brought its new incarnation in), `alive` lost its JobSet."""
    indexers = {
        "trainingjobs": _index(
            {
                GONE: [_obj("gone", "tj-gone")],
                AGAIN: [_obj("again", "tj-again-old"), _obj("again", "tj-again-new")],
                ALIVE: [_obj("alive", "tj-alive")],
            }
        ),
        "jobsets": _index({GONE: [_obj("gone-a0", "js-gone")], ALIVE: [_obj("alive-a0", "js-alive")]}),
        "pods": _index(
            {
                AGAIN: [_obj("again-a0-slice-0-0", "pod-again-old", status={"phase": "Running"})],
                ALIVE: [_obj("alive-a0-slice-0-0", "pod-alive", spec={"nodeName": "n1"})],
            }
        ),
        "nodes": _index({"n1": [{"metadata": {"name": "n1", "uid": "node-1"}}]}),
    }
    runtime = Runtime()
    runtime.indexes = {name: indexer.index for name, indexer in indexers.items()}
    runtime.watched |= {GONE, AGAIN, ALIVE}
    runtime.memory.of(AGAIN).read_at = 1.0  # memory of the old incarnation
    runtime.memory.of(ALIVE).created["alive-a1"] = _obj("alive-a1", "js-alive-a1")  # ours, never delivered by the watch
    return runtime, indexers


# What exists after the gap, as a fresh LIST tells it.
LISTED = Listed(
    uids={
        "trainingjobs": {"tj-again-new", "tj-alive"},
        "jobsets": set(),
        "pods": {"pod-alive"},
        "nodes": {"node-1"},
    },
    jobs={AGAIN, ALIVE},
)


def _apply(runtime: Runtime, listed: Listed) -> tuple[resync.Outcome, set[Any]]:
    async def run() -> tuple[resync.Outcome, set[Any]]:
        outcome = apply(runtime, resync.remember(runtime), listed)
        return outcome, set(runtime.schedule.due)

    return asyncio.run(run())


def test_only_entries_whose_uid_the_list_lacks_are_gone():
    before = {(NS, "a", "1"): "A", (NS, "b", "2"): "B", (NS, "c", None): "C"}
    assert vanished(before, {"1"}) == {(NS, "b", "2"): "B"}  # no uid: nothing to judge it by


def test_what_the_list_lacks_leaves_the_indexes_and_the_runtime():
    runtime, indexers = _runtime()
    outcome, due = _apply(runtime, LISTED)

    tjs = indexers["trainingjobs"].index
    assert GONE not in tjs and [b["metadata"]["uid"] for b in tjs[AGAIN]] == ["tj-again-new"]
    assert list(indexers["jobsets"].index) == [] and AGAIN not in indexers["pods"].index
    assert ALIVE in indexers["pods"].index and "n1" in indexers["nodes"].index  # what exists stays
    assert outcome.dropped == {"trainingjobs": 2, "jobsets": 2, "pods": 1, "nodes": 0}
    # The deleted job is forgotten; the re-created one is a new job: its old memory gone, reconciled now.
    assert outcome.forgotten == {GONE, AGAIN}
    assert runtime.remembered(GONE) == 0 and GONE not in runtime.watched
    assert AGAIN in runtime.watched and runtime.memory.get(AGAIN) is None  # the old incarnation's memory gone
    assert "alive-a1" not in runtime.memory.of(ALIVE).created  # our own creation, deleted before the watch told us
    assert due == {AGAIN, ALIVE}
    assert runtime.snapshot(ALIVE) is not None and runtime.snapshot(ALIVE).jobsets == []  # type: ignore[union-attr]


def test_an_entry_indexed_after_the_list_started_is_not_judged_by_it():
    runtime, indexers = _runtime()
    before = resync.remember(runtime)
    late = _obj("late-a0", "js-late")  # delivered by the watch while the LIST was in flight
    indexers["jobsets"].replace(cast(Any, resync.entry_key(late)), {(NS, "late"): late})

    async def run() -> None:
        apply(runtime, before, LISTED)

    asyncio.run(run())
    assert [js["metadata"]["uid"] for js in indexers["jobsets"].index[(NS, "late")]] == ["js-late"]


def test_a_job_known_only_from_our_own_write_is_forgotten_when_the_list_lacks_it():
    runtime = Runtime()
    runtime.indexes = {"trainingjobs": OperatorIndexer().index}
    runtime.watch(GONE)
    runtime.memory.of(GONE).written = _obj("gone", "tj-gone")
    outcome, due = _apply(runtime, Listed(uids={"trainingjobs": set()}, jobs=set()))
    assert outcome.forgotten == {GONE} and runtime.remembered(GONE) == 0 and due == set()


def test_a_node_gone_in_the_gap_leaves_its_index_and_its_jobs_are_reconciled():
    runtime, indexers = _runtime()
    listed = Listed(uids={**LISTED.uids, "nodes": set()}, jobs=LISTED.jobs)
    outcome, due = _apply(runtime, listed)
    assert "n1" not in indexers["nodes"].index and outcome.dropped["nodes"] == 1 and ALIVE in due


def test_a_relist_is_a_listing_event_for_an_object_already_seen():
    runtime = Runtime()
    requests: list[bool] = []
    runtime.resync.request = lambda why: requests.append(why == "relist")  # type: ignore[method-assign]
    memo: dict[str, Any] = {}
    runtime.resync.notice(None, memo)  # the initial listing
    runtime.resync.notice("MODIFIED", memo)
    assert requests == []
    runtime.resync.notice(None, memo)  # listed again: the watch expired and kopf re-listed
    assert requests == [True]
    runtime.resync.notice(None, {})  # a new object in a relist tells nothing by itself
    assert requests == [True]


def test_the_lists_ask_for_the_watched_kinds_in_their_scopes():
    assert resync.KINDS["pods"].path(NS) == f"/api/v1/namespaces/{NS}/pods"
    assert resync.KINDS["trainingjobs"].path(NS) == f"/apis/tpujob.dev/v1alpha1/namespaces/{NS}/trainingjobs"
    assert resync.KINDS["nodes"].path(None) == "/api/v1/nodes"
    # Every value an index keeps carries its uid, or the resync could not judge (nor drop) it.
    assert resync.entry_key(slim_workload(_obj("w", "wl-1"))) == (NS, "w", "wl-1")
    assert resync.entry_key(slim_node({"metadata": {"name": "n1", "uid": "node-1"}})) == (None, "n1", "node-1")
    for slim in (slim_pod, slim_jobset, without_managed_fields):
        assert resync.entry_key(slim(_obj("x", "uid-x"))) == (NS, "x", "uid-x")


def test_before_covers_every_namespace_the_runtime_knows():
    before = Before(
        indexes={"pods": {("a", "p", "1"): ("a", "j")}, "nodes": {(None, "n1", "2"): "n1"}},
        watched={("b", "j")},
        created={(("c", "j"), "j-a0"): "3"},
        written={("d", "j"): "4"},
    )
    assert before.namespaces() == {"a", "b", "c", "d"}


def test_a_kind_that_could_not_be_listed_is_not_judged():
    runtime, indexers = _runtime()
    uids = {k: v for k, v in LISTED.uids.items() if k != "pods"}
    outcome, _ = _apply(runtime, Listed(uids=uids, jobs=LISTED.jobs, failed={"pods": "Too Many Requests"}))
    assert AGAIN in indexers["pods"].index and "pods" not in outcome.dropped
    assert outcome.failed == {"pods": "Too Many Requests"}
