"""After a watch gap the caches tell the truth again.

kopf re-lists a resource when its watch expires (410 Gone: an apiserver restart, a long partition,
etcd compaction) and replays every object that still exists as a listing event, but it never removes
from an index an object that was deleted in the gap: no DELETED event ever comes for it. Left alone,
stale Running pods of a deleted job keep a re-created job of the same name in RemovingOrphans, a
TrainingJob deleted in the gap is reconciled (and status-written against 404) forever, and a JobSet
deleted in the gap, or one this operator created that the watch never delivered, looks alive.

So the runtime compares every index (and its overlays of own writes) with a fresh LIST and drops what
the LIST lacks, the way client-go's informers replace their store after a relist. A LIST read after an
object was indexed that does not hold its uid proves it is gone (uids are never reused; a LIST without
a resourceVersion is a consistent read), so only entries indexed before the LIST started are judged.
What triggers one: a relist (a listing event for an object already seen), a TrainingJob that answers
404 to a status write, and, as a backstop, every RESYNC_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import tpujob_contract as contract
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from . import api
from .kube import REQUEST_TIMEOUT_SECONDS, Cluster
from .memory import Memory
from .observe import Indexes
from .schedule import JobKey


class Tracked(Protocol):
    """What a resync reads and drops of the runtime (runtime.Runtime): its caches and memory of jobs."""

    indexes: Indexes
    watched: set[JobKey]
    memory: Memory

    def cluster(self) -> Cluster: ...
    def forget(self, key: JobKey) -> None: ...
    def watch(self, key: JobKey) -> None: ...
    def request(self, key: JobKey, delay: float = 0.0) -> None: ...


log = logging.getLogger("tpujob")
# The backstop: a gap no listing event reveals (every object of every kind gone) is found this late.
RESYNC_SECONDS = 600.0
# A relist replays every object within moments, and the other kinds' watches relist about then too:
# one resync for the burst, a little after its first event.
SETTLE_SECONDS = 2.0
# Resyncs at least this far apart (a TrainingJob whose status write keeps answering 404 asks each time).
MIN_INTERVAL_SECONDS = 5.0
# A resync that could not LIST every kind (the apiserver still starting: 429) is tried again this soon,
# then twice as late each time, up to MAX_RETRY_SECONDS.
RETRY_SECONDS = 3.0
MAX_RETRY_SECONDS = 300.0
PAGE = 500
# The per-object memo kopf hands every handler: set once the object's first event was handled.
SEEN = "tpujob_seen"
# Only metadata comes back (uids are all a resync compares).
METADATA_ONLY = "application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io,application/json"
# kopf's key of an indexed object: (namespace, name, uid), as kopf's OperatorIndexers.make_key builds it.
EntryKey = tuple[str | None, str | None, str | None]


@dataclass(frozen=True)
class Kind:
    """What one index holds: the resource kopf watches for it and the watch's label selector."""

    group: str
    version: str
    plural: str
    selector: str | None = None
    namespaced: bool = True

    def path(self, namespace: str | None) -> str:
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        return f"{base}/namespaces/{namespace}/{self.plural}" if namespace else f"{base}/{self.plural}"


# The runtime's index names (handlers.py) and the watches that fill them.
KINDS: dict[str, Kind] = {
    "trainingjobs": Kind(api.GROUP, api.VERSION, api.PLURAL),
    "jobsets": Kind(contract.JOBSET_GROUP, contract.JOBSET_VERSION, contract.JOBSET_PLURAL, contract.LABEL_NAME),
    "pods": Kind("", "v1", "pods", f"{contract.LABEL_NAME},{contract.LABEL_ATTEMPT}"),
    "workloads": Kind(contract.KUEUE_GROUP, contract.KUEUE_VERSION, "workloads", contract.KUEUE_JOB_UID_LABEL),
    "nodes": Kind("", "v1", "nodes", namespaced=False),
}


def entry_key(value: Mapping[str, Any]) -> EntryKey:
    meta = value.get("metadata") or {}
    return (meta.get("namespace"), meta.get("name"), meta.get("uid"))


def indexed(index: Mapping[Any, Iterable[Mapping[str, Any]]]) -> dict[EntryKey, Any]:
    """Every object an index holds (by kopf's key) and the index key it is filed under."""
    return {entry_key(value): key for key in list(index) for value in index[key]}


def vanished(before: Mapping[EntryKey, Any], listed: set[str]) -> dict[EntryKey, Any]:
    """The entries indexed before a LIST whose uid the LIST lacks: deleted (or no longer selected)."""
    return {entry: key for entry, key in before.items() if entry[2] is not None and entry[2] not in listed}


@dataclass
class Before:
    """What the runtime held when a resync's LISTs started: only that can be judged by them."""

    indexes: dict[str, dict[EntryKey, Any]]
    watched: set[JobKey]
    created: dict[tuple[JobKey, str], str]  # (job, JobSet name) -> uid of each JobSet we created
    written: dict[JobKey, str]  # job -> uid of our last status write

    def namespaces(self) -> set[str]:
        keys = [entry for entries in self.indexes.values() for entry in entries]
        found = {str(ns) for ns, _, _ in keys if ns} | {ns for ns, _ in self.watched}
        return found | {key[0] for key, _ in self.created} | {ns for ns, _ in self.written}


@dataclass
class Listed:
    """A fresh LIST of each indexed kind: the uids, and each TrainingJob's key."""

    uids: dict[str, set[str]] = field(default_factory=dict)
    jobs: set[JobKey] = field(default_factory=set)
    failed: dict[str, str] = field(default_factory=dict)  # kinds not listed (not judged), and why


@dataclass
class Outcome:
    dropped: dict[str, int]
    forgotten: set[JobKey]
    requested: set[JobKey]
    failed: dict[str, str] = field(default_factory=dict)


def remember(runtime: Tracked) -> Before:
    jobs = list(runtime.memory.items())
    created = {
        (key, name): str(body["metadata"].get("uid"))
        for key, job in jobs
        for name, body in job.created.items()
        if body["metadata"].get("uid")
    }
    written = {key: str(job.written["metadata"].get("uid")) for key, job in jobs if job.written is not None}
    return Before(
        {name: indexed(index) for name, index in runtime.indexes.items()}, set(runtime.watched), created, written
    )


def list_uids(client: ApiClient, kinds: Mapping[str, Kind], namespaces: Iterable[str]) -> Listed:
    """The uids of what exists now, per index name (paged, metadata only; blocking: run in a thread).
    A kind that could not be listed everywhere is left out: nothing of it is judged."""
    listed = Listed({name: set() for name in kinds})
    for name, kind in kinds.items():
        try:
            for namespace in sorted(namespaces) if kind.namespaced else [None]:
                for item in _list(client, kind, namespace):
                    meta = item.get("metadata") or {}
                    listed.uids[name].add(str(meta.get("uid")))
                    if name == "trainingjobs":
                        listed.jobs.add((str(meta.get("namespace")), str(meta.get("name"))))
        except Exception as error:  # 429 while the apiserver starts, a broken connection, RBAC
            del listed.uids[name]
            listed.failed[name] = str(getattr(error, "reason", None) or error)[:200]
    return listed


def _list(client: ApiClient, kind: Kind, namespace: str | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        query: list[tuple[str, Any]] = [("limit", PAGE)]
        if kind.selector:
            query.append(("labelSelector", kind.selector))
        if token:
            query.append(("continue", token))
        request = client.param_serialize(
            "GET", kind.path(namespace), query_params=query, header_params={"Accept": METADATA_ONLY},
            auth_settings=["BearerToken"],
        )  # fmt: skip
        response = client.call_api(*request, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        page = json.loads(response.data or b"{}")
        items.extend(page.get("items") or [])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items


def apply(runtime: Tracked, before: Before, listed: Listed) -> Outcome:
    """Drop from the indexes and the overlays what the LIST proved gone; forget the jobs that no
    longer exist as they were; ask for a reconcile of every job that lost something (on the loop)."""
    dropped: dict[str, int] = {}
    affected: set[JobKey] = set()
    forgotten: set[JobKey] = set()
    for name, entries in before.indexes.items():
        if name not in listed.uids:
            continue
        gone = vanished(entries, listed.uids[name])
        index = runtime.indexes.get(name)
        for entry, key in gone.items():
            _discard(index, entry)
            if name == "trainingjobs":
                forgotten.add(key)  # that incarnation is gone: nothing it left in memory counts
            elif name in ("jobsets", "pods"):  # (Workloads: a live JobSet's newest one decides anyway)
                affected.add(key)
        if name == "nodes" and gone:  # the jobs with pods bound to a node that is gone
            affected |= _jobs_on(runtime, {str(entry[1]) for entry in gone})
        dropped[name] = len(gone)
    if "trainingjobs" in listed.uids:
        forgotten |= before.watched - listed.jobs  # e.g. known only from our own write
        jobsets = listed.uids.get("jobsets")
        forgotten |= {key for key, uid in before.written.items() if uid not in listed.uids["trainingjobs"]}
        for (key, name), uid in before.created.items():
            job = runtime.memory.get(key)
            if jobsets is not None and uid not in jobsets and job is not None and name in job.created:
                del job.created[name]  # created by us, deleted before the watch delivered it
                affected.add(key)
    for key in forgotten:
        runtime.forget(key)
    trainingjobs = runtime.indexes.get("trainingjobs", {})
    requested: set[JobKey] = set()
    for key in sorted(forgotten | affected):
        if key in forgotten and key in trainingjobs:
            runtime.watch(key)  # re-created in the gap (or since): a new job, as if seen ADDED
        if key in runtime.watched:
            runtime.request(key)
            requested.add(key)
    return Outcome(dropped, forgotten, requested, dict(listed.failed))


def _jobs_on(runtime: Tracked, nodes: set[str]) -> set[JobKey]:
    pods = runtime.indexes.get("pods", {})
    return {key for key in list(pods) for p in pods[key] if (p.get("spec") or {}).get("nodeName") in nodes}


def _discard(index: Any, entry: EntryKey) -> None:
    # kopf (pinned) offers no public way to drop an entry: its indexers call this on a DELETED event.
    index._discard(entry)


class Resync:
    """Runs `apply` after every relist, 404 and RESYNC_SECONDS, one at a time, on kopf's event loop."""

    def __init__(self, runtime: Tracked) -> None:
        self.runtime = runtime
        self.runs = 0  # completed resyncs (tests and logs)
        self.asked: Counter[str] = Counter()  # why resyncs were asked for: relist, 404, retry
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (once, on kopf's event loop, when the indexes are attached)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = self._loop.create_task(self._run(), name="tpujob-resync")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def request(self, why: str) -> None:
        """Resync soon; safe from any thread (a reconcile's worker thread reports a 404)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        self.asked[why] += 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the operator is stopping
            loop.call_soon_threadsafe(wake.set)

    def notice(self, type_: str | None, memo: Any) -> None:
        """An object's event: a listing event (type None) for an object already seen means its kind was
        re-listed, which is when vanished objects are left behind."""
        if memo is None:
            return
        if type_ is None and memo.get(SEEN):
            self.request("relist")
        memo[SEEN] = True

    async def _run(self) -> None:
        assert self._wake is not None
        last, failures = float("-inf"), 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), RESYNC_SECONDS)
                await asyncio.sleep(max(SETTLE_SECONDS, last + MIN_INTERVAL_SECONDS - time.monotonic()))
            except TimeoutError:
                pass
            self._wake.clear()
            last = time.monotonic()
            try:
                outcome = await self.run_once()
                problem = "; ".join(f"{k}: {e}" for k, e in outcome.failed.items()) if outcome else ""
            except Exception as error:  # the apiserver may still be coming back
                problem = str(error)[:200]
            if not problem:
                failures = 0
                continue
            delay = min(RETRY_SECONDS * 2**failures, MAX_RETRY_SECONDS)
            failures += 1
            log.warning("resync of the caches incomplete (%s); again in %.0f s", problem, delay)
            self._request_later(delay)

    def _request_later(self, delay: float) -> None:
        if self._loop is not None:
            self._loop.call_later(delay, self.request, "retry")

    async def run_once(self) -> Outcome | None:
        runtime = self.runtime
        if not runtime.indexes:
            return None
        before = remember(runtime)
        kinds = {name: KINDS[name] for name in runtime.indexes if name in KINDS}
        client = runtime.cluster().custom.api_client
        loop = asyncio.get_running_loop()
        listed = await loop.run_in_executor(None, list_uids, client, kinds, before.namespaces())
        outcome = apply(runtime, before, listed)
        self.runs += 1
        if any(outcome.dropped.values()) or outcome.forgotten:
            log.info(
                "resync: dropped %s from the caches; forgot %s",
                ", ".join(f"{n} {name}" for name, n in outcome.dropped.items() if n) or "nothing",
                ", ".join(f"{ns}/{name}" for ns, name in sorted(outcome.forgotten)) or "no job",
            )
        return outcome
