"""Operator scale benchmark on the devcluster: what the operator costs, and how fast it still reacts,
with 10, 100, 1,000 TrainingJobs.

Workload: every job is as small as a job gets, 1 slice of v5e 2x2 (one host: one worker pod), backoff 0,
running the stub trainer (devcluster/stub_trainer.sh, image `tpujob-stub-trainer`: a sh loop that
writes the progress record every --progress-seconds and a committed step every --commit-seconds,
straight to the GCS emulator). Exclusive placement puts one job on one node pool, so the bench adds
one kwok pool (one node) per job, plus spares for the replacements of killed workers.

One devcluster for the whole run, stepped up: at each size the jobs (and pools) are added up to the
size, the bench waits (bounded) until every job is Running, then measures an idle window (nothing
created or killed, the stubs keep writing) and then the reaction under that load. Stepping up one
cluster rather than a fresh one per size saves a cluster start and an operator install per size,
and it is how an operator meets load: its process has run the smaller sizes before.

Per size:
  operator    its process, from /proc (the pod runner runs it as a local process): RSS (VmRSS) at the
              end of the window and its max over samples, CPU seconds (utime+stime) per minute
  apiserver   requests per second by verb (and by verb and resource) made by the operator's
              ServiceAccount, counted from the apiserver's own audit log over the idle window (watch:
              one per watch started; list: every LIST in the window is a periodic LIST, since watches
              that run do not list); per_job_reconcile_interval_s = jobs x window / GETs of
              TrainingJobs (how often each job is actually re-read: the operator keeping up or not)
  gcs         the operator's GCS requests over the idle window, counted by a proxy in this process
              between the operator and the emulator (only the operator's STORAGE_EMULATOR_HOST points
              at it), by kind, and per job-hour
  staleness   right after the window: how far each Running job's status.step is behind its trainer's
              latest progress record, in seconds of training (p50/p99/max)
  reaction    K times, one at a time: SIGKILL the worker of a random Running job; reaction = the
              kill -> the replacement JobSet (attempt + 1) seen ADDED by this bench's watch
              (milliseconds; creationTimestamp has whole seconds). p50/p99/max/n and timeouts; split
              at the pod's phase Failed seen by the bench's pod watch into `node` (the pod runner
              noticing the death and reporting it: the kubelet's share, which here serves the whole
              fleet on 2 cores) and `operator` (the API showing the failure -> the replacement)
  reaction_gcs_blackholed  with --blackhole-kills N: the same, N kills, while the proxy holds every
              GCS request of the operator unanswered (a brownout; after --blackhole-settle seconds of
              it, so that every job's progress check has met it), then lifted. The stub trainers
              write straight to the emulator: only the operator's storage is gone
  cluster     CPU seconds per minute of the other devcluster processes in the window (context: they
              share the 2 cores with the operator), and the load average
  tracemalloc with --tracemalloc FRAMES, right after the window: what the operator holds, by holder
              (kopf's indexes and per-object memories, the operator's records and its runtime's
              attributes, tasks, the event loop: deep sizes, each object counted once), and from the
              second size on tracemalloc's allocations still held by where they were made (the
              allocating line, the first frame outside the standard library, its package), each with
              bytes per job added since the size before. bench/tracemalloc_hook/sitecustomize.py, put
              first on the operator's PYTHONPATH, answers the bench's requests; tracing starts at the
              first size's snapshot and slows the operator and inflates its RSS: read RSS from a run
              without it
Every wait has a timeout: a size whose jobs are not all Running in time is measured as it stands.
`keeping_up` is false, with the reasons, when jobs were not all Running in time, a replacement JobSet
was not seen within --reaction-timeout, or the status staleness p99 exceeds --keep-up-staleness.

Prints one JSON document on stdout (progress on stderr).
Run: `.venv/bin/python bench/operator_scale.py --sizes 10,100` (`--operator-rev REV` runs that
revision's operator and chart, from a git worktree, instead of the working tree's).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import sys
import sysconfig
import tempfile
import threading
import time
import tracemalloc
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import tpujob_contract as contract
import yaml
from kubernetes import client, config, watch
from tpujob_contract import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, LABEL_ATTEMPT, LABEL_NAME
from tpujob_devcluster.cluster import BUCKET, DevCluster
from tpujob_devcluster.controlplane import REPO_ROOT
from tpujob_devcluster.harness import (
    OPERATOR_NAMESPACE,
    cpu_seconds,
    ensure_namespace,
    git,
    helm_install_operator,
    pod_pids,
    quantiles,
    signal_pod,
    worktree,
)
from tpujob_devcluster.pools import Pool

GROUP, VERSION, PLURAL = contract.TRAININGJOB_GROUP, contract.TRAININGJOB_VERSION, contract.TRAININGJOB_PLURAL
NAMESPACE = "scale"
RELEASE = "tpujob"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{RELEASE}"
ACCELERATOR, TOPOLOGY = "tpu-v5-lite-podslice", "2x2"  # one host of 4 chips: one worker pod per job
SOURCES = ("operator/src", "contract/src")  # what --operator-rev puts first on the operator's PYTHONPATH
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # ResponseStarted is logged for watches only (when the watch starts); ResponseComplete for every request.
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": [f"system:serviceaccounts:{OPERATOR_NAMESPACE}"]},
        {"level": "None"},
    ],
}
BLACKHOLE_HOLD = 120.0  # a blackholed request is held this long at most (the client gives up sooner)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- GCS: a counting proxy in front of the emulator, for the operator only ---------------------------


def gcs_kind(method: str, path: str) -> str:
    """What a JSON-API request does: list, metadata (exists/reload), read (media), bucket (its metadata),
    write, delete."""
    parsed = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(parsed.query)
    if method == "DELETE":
        return "delete"
    if method in ("POST", "PUT", "PATCH"):
        return "write"
    if method == "GET":
        if parsed.path.startswith("/download/") or query.get("alt") == ["media"]:
            return "read"
        if parsed.path.rstrip("/").endswith("/o"):
            return "list"
        if "/o/" in parsed.path:
            return "metadata"
        if parsed.path.startswith("/storage/v1/b/"):
            return "bucket"
    return "other"


class CountingProxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        # Set: requests are accepted and never answered (a GCS brownout as the client sees it: its
        # per-call timeout, then retries); each is held until the blackhole is lifted or BLACKHOLE_HOLD.
        self.blackhole = threading.Event()
        self.lifted = threading.Event()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)

    def blackhole_on(self) -> None:
        self.lifted.clear()
        self.blackhole.set()

    def blackhole_off(self) -> None:
        self.blackhole.clear()
        self.lifted.set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # the operator went away mid-connection
            super().handle_error(request, client_address)

    def snapshot(self) -> Counter[str]:
        with self.lock:
            return Counter(self.counts)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the GCS client's session expects
    server: CountingProxy

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        blackholed = self.server.blackhole.is_set()
        with self.server.lock:
            self.server.counts[f"{self.command} {gcs_kind(self.command, self.path)}{' (blackholed)' * blackholed}"] += 1
        if blackholed:
            self.server.lifted.wait(BLACKHOLE_HOLD)
            self.close_connection = True  # no answer at all: the client has timed out by now
            return
        upstream: http.client.HTTPConnection | None = getattr(self, "_upstream", None)
        if upstream is None:
            upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=30)
            self._upstream: http.client.HTTPConnection | None = upstream
        skip = {"host", "connection", "keep-alive", "proxy-connection", "transfer-encoding"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            upstream.close()
            self._upstream = None
            self.send_error(502)
            return
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in skip and key.lower() != "content-length":
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward


# --- the operator's process and the other components, from /proc -----------------------------------


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# --- the apiserver's audit log ----------------------------------------------------------------------


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def audit_counts(path: Path, offset: int, start: float, end: float) -> dict[str, Any]:
    """The operator's requests received in [start, end), from the audit log past `offset`. A LIST
    that a watch of the same resource and namespace follows within 5 s is that watch's (re)list
    (kopf lists before each watch, also when one ends after its server timeout); every other LIST
    is a periodic one."""
    by_verb: Counter[str] = Counter()
    by_verb_resource: Counter[str] = Counter()
    lists: list[tuple[float, str, str, str]] = []  # received, resource, namespace, label
    watches: list[tuple[float, str, str]] = []
    with path.open("rb") as handle:
        handle.seek(offset)
        for line in handle:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            verb = event.get("verb", "")
            if (event.get("user") or {}).get("username") != OPERATOR_USER:
                continue
            if event.get("stage") != ("ResponseStarted" if verb == "watch" else "ResponseComplete"):
                continue
            received = _stamp(event["requestReceivedTimestamp"])
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            namespace = ref.get("namespace", "")
            if verb == "watch":
                watches.append((received, resource, namespace))
            if not start <= received < end:
                continue
            by_verb[verb] += 1
            by_verb_resource[f"{verb} {resource}"] += 1
            if verb == "list":
                query = urllib.parse.urlsplit(event.get("requestURI", "")).query
                selector = "selector" if "labelSelector" in query or "fieldSelector" in query else "no selector"
                label = f"{resource} ({'namespaced' if namespace else 'cluster'}, {selector})"
                lists.append((received, resource, namespace, label))
    periodic: Counter[str] = Counter()
    relists: Counter[str] = Counter()
    for received, resource, namespace, label in lists:
        followed = any(r == resource and n == namespace and 0 <= t - received < 5 for t, r, n in watches)
        (relists if followed else periodic)[label] += 1
    return {"by_verb": by_verb, "by_verb_resource": by_verb_resource, "periodic": periodic, "relists": relists}


def audit_size(path: Path | None) -> int:
    return path.stat().st_size if path is not None and path.exists() else 0


# --- tracemalloc: where the operator's memory goes, per job ------------------------------------------

TRACEMALLOC_HOOK = Path(__file__).resolve().parent / "tracemalloc_hook"  # its sitecustomize.py
STDLIB = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
Groups = dict[str, Counter[str]]


def _short(filename: str) -> str:
    """A frame's file as a package path: .../site-packages/kopf/x.py -> kopf/x.py, stdlib -> json/decoder.py."""
    for marker in ("/site-packages/", "/src/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    for root in (*STDLIB, str(REPO_ROOT)):
        if filename.startswith(root + "/"):
            return filename[len(root) + 1 :]
    return filename


def _is_stdlib(filename: str) -> bool:
    return filename.startswith("<") or (filename.startswith(STDLIB) and "/site-packages/" not in filename)


def allocation_groups(snapshot: tracemalloc.Snapshot) -> Groups:
    """Bytes traced, grouped three ways: `line` the allocating line (tracemalloc's 'lineno'); `site`
    the most recent frame outside the standard library (json.loads under kopf's watcher is kopf's
    watcher: who asked for the memory, not the decoder that made it); `module` that site's package."""
    groups: Groups = {"line": Counter(), "site": Counter(), "module": Counter(), "blocks": Counter()}
    cache: dict[Any, tuple[str, str, str]] = {}
    raw = snapshot.traces._traces  # type: ignore[attr-defined]  # (domain, size, frames newest first, ...)
    for _domain, size, frames, *_ in raw:
        keys = cache.get(frames)
        if keys is None:
            top = f"{_short(frames[0][0])}:{frames[0][1]}" if frames else "?"
            own = next((f for f in frames if not _is_stdlib(f[0])), frames[0] if frames else ("?", 0))
            site = _short(own[0])
            keys = cache[frames] = (top, f"{site}:{own[1]}", site.split("/", 1)[0].removesuffix(".py"))
        groups["line"][keys[0]] += size
        groups["site"][keys[1]] += size
        groups["module"][keys[2]] += size
        groups["blocks"][keys[1]] += 1
    return groups


def per_job_table(groups: Groups, jobs: int, previous: tuple[int, Groups] | None, top: int = 25) -> dict[str, Any]:
    """Each group's top entries: bytes, and bytes per job: the growth since the previous size over
    the jobs added when there is one (what a job costs, the fixed part cancelled), else bytes / jobs."""
    base_jobs, base = previous if previous is not None else (0, {k: Counter() for k in groups})
    added = jobs - base_jobs
    table: dict[str, Any] = {}
    for kind in ("module", "site", "line"):
        grown = Counter(groups[kind])
        grown.subtract(base[kind])
        table[kind] = [
            {
                "where": key,
                "bytes": groups[kind][key],
                "bytes_per_job": round(delta / added) if added else None,
                **({"blocks": groups["blocks"][key]} if kind == "site" else {}),
            }
            for key, delta in grown.most_common(top)
        ]
    total, base_total = sum(groups["module"].values()), sum(base["module"].values())
    return {
        "traced_mb": round(total / 2**20, 1),
        "traced_bytes_per_job": round((total - base_total) / added) if added else None,
        "per_job_from": (
            f"traced since tracing began at {base_jobs} jobs (what was allocated since, not only what jobs added)"
            if previous is not None and not base_total
            else f"growth from {base_jobs} to {jobs} jobs"
        ),
        **table,
    }


class TracemallocProbe:
    """Asks the operator's hook (bench/tracemalloc_hook/sitecustomize.py) to start tracing (after the
    first size) and then for a snapshot and its holders per size, each size's groups kept to subtract
    from the next size's: what the jobs added in between cost, whatever was allocated before tracing."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.previous: tuple[int, Groups] | None = None
        self.previous_holders: dict[str, dict[str, int]] = {}

    def measure(self, jobs: int, timeout: float = 600.0) -> dict[str, Any]:
        label = f"jobs-{jobs}"
        (self.directory / f"{label}.request").write_text("")
        holders_file = self.directory / f"{label}.holders.json"
        deadline = time.monotonic() + timeout
        while not holders_file.exists():
            if time.monotonic() > deadline:
                return {"error": f"no answer from the operator's tracemalloc hook in {timeout:.0f} s"}
            time.sleep(1.0)
        document = json.loads(holders_file.read_text())
        if "error" in document:
            return {"error": f"the operator's tracemalloc hook: {document['error']}"}
        base_jobs = self.previous[0] if self.previous else 0
        holders = {
            name: {
                **row,
                "bytes_per_job": round(
                    (row["bytes"] - self.previous_holders.get(name, {}).get("bytes", 0)) / (jobs - base_jobs)
                ),
            }
            for name, row in sorted(document["holders"].items(), key=lambda item: -item[1]["bytes"])
        }
        result: dict[str, Any] = {
            "measure": "holders: deep size in the operator (sys.getsizeof over gc.get_referents, each object "
            "counted once, to the first holder that reaches it), bytes_per_job over the jobs added since the "
            "size before; then tracemalloc's allocations still held, by where they were made",
            "holders": holders,
        }
        snapshot_file = self.directory / f"{label}.snapshot"
        if not snapshot_file.exists():  # tracing starts now
            groups: Groups = {kind: Counter() for kind in ("line", "site", "module", "blocks")}
            result["tracemalloc"] = "started: traced from here on (the next size reports)"
        else:
            groups = allocation_groups(tracemalloc.Snapshot.load(str(snapshot_file)))
            snapshot_file.unlink()
            result.update(
                traced_peak_mb=round(document["traced_peak_bytes"] / 2**20, 1),
                tracemalloc_overhead_mb=round(document["tracemalloc_overhead_bytes"] / 2**20, 1),
                **per_job_table(groups, jobs, self.previous),
            )
        result["hook_seconds"] = document["seconds"]
        self.previous, self.previous_holders = (jobs, groups), document["holders"]
        return result


# --- the bench ----------------------------------------------------------------------------------------


def manifest(name: str, progress_seconds: int, commit_seconds: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "image": "tpujob-stub-trainer:dev",
            "env": [
                {"name": "STUB_PROGRESS_SECONDS", "value": str(progress_seconds)},
                {"name": "STUB_COMMIT_SECONDS", "value": str(commit_seconds)},
            ],
            "tpu": {"accelerator": ACCELERATOR, "topology": TOPOLOGY, "slices": 1},
            "checkpoint": {"directory": f"gs://{BUCKET}/scale", "policy": "continuous"},
            "restart": {"maxRestarts": 100, "backoffSeconds": 0},
        },
    }


def pools(start: int, stop: int) -> list[Pool]:
    return [Pool(f"scale-{i:04d}", ACCELERATOR, TOPOLOGY) for i in range(start, stop)]


class FirstSeen:
    """Arrival time (this machine's clock) of the first watch event of the bench's namespace whose
    object `key` maps to a key (None: not yet), one watch thread per instance."""

    def __init__(self, list_call: Any, key: Any, *args: str) -> None:
        self.list_call, self.key, self.args = list_call, key, args
        self.seen: dict[Any, float] = {}
        self.changed = threading.Condition()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        version: str | None = None
        while not self.stopping.is_set():
            w = watch.Watch()
            try:
                kwargs: dict[str, Any] = {"label_selector": LABEL_NAME, "timeout_seconds": 120}
                if version:
                    kwargs["resource_version"] = version
                # JSON only: the client's models would cost this process (the operator's GCS proxy) CPU
                for event in w.stream(self.list_call, *self.args, deserialize=False, **kwargs):
                    now = time.time()
                    if event["type"] == "ERROR":
                        version = None
                        break
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion") or version
                    key = self.key(obj)
                    with self.changed:
                        if key is not None and key not in self.seen:
                            self.seen[key] = now
                            self.changed.notify_all()
            except Exception:  # 410 Gone among them (unparsed, the client's own 410 handling fails): list again
                version = None
                time.sleep(0.2)
            finally:
                w.stop()

    def wait_for(self, key: Any, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        with self.changed:
            while key not in self.seen:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)
            return self.seen[key]


def jobset_key(obj: dict[str, Any]) -> tuple[str, int]:
    labels = obj["metadata"].get("labels") or {}
    return labels.get(LABEL_NAME, ""), int(labels.get(LABEL_ATTEMPT, -1))


def failed_pod_key(obj: dict[str, Any]) -> str | None:
    """A pod's name once the API says it failed: what the operator can first act on."""
    return str(obj["metadata"]["name"]) if (obj.get("status") or {}).get("phase") == "Failed" else None


class Bench:
    def __init__(
        self, cluster: DevCluster, proxy: CountingProxy, args: argparse.Namespace, memory: TracemallocProbe | None
    ) -> None:
        self.cluster, self.proxy, self.args, self.memory = cluster, proxy, args, memory
        self.kube = config.new_client_from_config(str(cluster.kubeconfig))
        self.custom = client.CustomObjectsApi(self.kube)
        self.core = client.CoreV1Api(self.kube)
        jobsets = (JOBSET_GROUP, JOBSET_VERSION, NAMESPACE, JOBSET_PLURAL)
        self.jobsets = FirstSeen(self.custom.list_namespaced_custom_object, jobset_key, *jobsets)
        self.failed_pods = FirstSeen(self.core.list_namespaced_pod, failed_pod_key, NAMESPACE)
        self.jobs: list[str] = []
        self.pools = 0
        self.rng = random.Random(args.seed)

    def wait(self, probe: Any, timeout: float, interval: float = 1.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value or time.monotonic() > deadline:
                return value
            time.sleep(interval)

    def ensure_namespace(self) -> None:
        ensure_namespace(self.core, NAMESPACE)

    def operator_pids(self) -> list[int]:
        pods: Any = self.core.list_namespaced_pod(
            OPERATOR_NAMESPACE, label_selector=f"app.kubernetes.io/name={RELEASE}"
        )
        names = [p.metadata.name for p in pods.items if p.status.phase == "Running"]
        if len(names) != 1:
            raise RuntimeError(f"expected one running operator pod, found {names}")
        return list(pod_pids(self.cluster.state_dir, OPERATOR_NAMESPACE, names[0]))

    def phases(self) -> Counter[str]:
        listing: Any = self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        return Counter(str((tj.get("status") or {}).get("phase") or "None") for tj in listing["items"])

    # -- one size --------------------------------------------------------------------------------------
    def step_up(self, size: int) -> dict[str, Any]:
        args = self.args
        result: dict[str, Any] = {"jobs": size}
        want_pools = size + args.kills + args.blackhole_kills + args.spare_pools
        t0 = time.monotonic()
        if want_pools > self.pools:
            log(f"size {size}: adding {want_pools - self.pools} node pools")
            self.cluster.add_pools(pools(self.pools, want_pools), timeout=args.ready_timeout)
            self.pools = want_pools
        result["pools"] = self.pools
        result["add_pools_seconds"] = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        new = [f"job-{i:04d}" for i in range(len(self.jobs), size)]
        log(f"size {size}: creating {len(new)} TrainingJobs")

        def create(name: str) -> None:
            body = manifest(name, args.progress_seconds, args.commit_seconds)
            self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(create, new))
        self.jobs += new
        result["create_seconds"] = round(time.monotonic() - t0, 1)
        timeout = args.ready_timeout + args.ready_seconds_per_job * len(new)
        phases: Counter[str] = Counter()

        def all_running() -> bool:
            nonlocal phases
            phases = self.phases()
            return phases.get("Running", 0) >= size

        running = self.wait(all_running, timeout, interval=2.0)
        result["ready_seconds"] = round(time.monotonic() - t0, 1) if running else None
        result["ready_timeout_seconds"] = round(timeout, 1)
        result["phases_at_ready"] = dict(phases)
        log(
            f"size {size}: {phases.get('Running', 0)}/{size} Running after {time.monotonic() - t0:.0f} s {dict(phases)}"
        )
        if args.settle_seconds:
            time.sleep(args.settle_seconds)  # the stubs' writes spread out; start-up work drains
        result["idle"] = self.idle_window(size)
        result["status_staleness"] = self.staleness()
        if self.memory is not None:  # before the kills: the idle fleet's memory
            log(f"size {size}: tracemalloc snapshot of the operator")
            result["tracemalloc"] = memory = self.memory.measure(size)
            # The largest per job, logged as they come (a long run may not get to print its document).
            holders = sorted((memory.get("holders") or {}).items(), key=lambda item: -item[1]["bytes_per_job"])
            sites = [(row["where"], row) for row in memory.get("site") or []]
            for kind, rows in (("holder", holders), ("site", sites)):
                for where, row in rows[:12]:
                    log(f"  {kind} {where}: {row['bytes_per_job']} B/job ({row['bytes']} B)")
        result["reaction"] = self.reactions(args.kills)
        if args.blackhole_kills:
            result["reaction_gcs_blackholed"] = self.blackholed_reactions(size)
        result["phases_after"] = dict(self.phases())
        problems = []
        if not running:
            problems.append(f"{size - phases.get('Running', 0)} of {size} jobs not Running after {timeout:.0f} s")
        if result["reaction"]["timeouts"]:
            problems.append(
                f"{result['reaction']['timeouts']} replacement JobSets not seen in {args.reaction_timeout} s"
            )
        stale = result["status_staleness"]["p99"]
        if stale is None or stale > args.keep_up_staleness:
            problems.append(f"status.step p99 {stale} s behind the trainers' records (> {args.keep_up_staleness} s)")
        result["keeping_up"] = not problems
        result["not_keeping_up"] = problems
        result["load_average"] = [round(x, 2) for x in os.getloadavg()]
        return result

    def idle_window(self, size: int) -> dict[str, Any]:
        seconds = self.args.idle_seconds
        pids = self.operator_pids()
        components = {c.name: c.process.pid for c in self.cluster.plane.components if c.process is not None}
        if self.cluster.gcs is not None:
            components["fake-gcs-server"] = self.cluster.gcs.pid
        audit = self.cluster.plane.audit_log
        offset = audit_size(audit)
        log(f"size {size}: idle window of {seconds} s")
        gcs0, cpu0 = self.proxy.snapshot(), sum(cpu_seconds(p) for p in pids)
        other0 = {name: cpu_seconds(pid) for name, pid in components.items()}
        bench0 = time.process_time()
        start, t0 = time.time(), time.monotonic()
        rss: list[float] = []
        while time.monotonic() - t0 < seconds:
            rss.append(sum(_rss_mb(p) for p in pids))
            time.sleep(min(5.0, max(0.0, seconds - (time.monotonic() - t0))))
        elapsed, end = time.monotonic() - t0, time.time()
        cpu1, gcs1 = sum(cpu_seconds(p) for p in pids), self.proxy.snapshot()
        rss.append(sum(_rss_mb(p) for p in pids))
        minutes = elapsed / 60
        time.sleep(2.0)  # the audit log is written as requests complete
        counted = audit_counts(audit, offset, start, end) if audit is not None else None
        gcs = gcs1 - gcs0
        job_hours = size * elapsed / 3600
        apiserver: dict[str, Any] = {"source": "kube-apiserver audit log", "user": OPERATOR_USER}
        if counted is not None:
            total = sum(counted["by_verb"].values())
            gets = counted["by_verb_resource"].get("get trainingjobs", 0)
            apiserver.update(
                requests_per_second=round(total / elapsed, 2),
                rps_by_verb={v: round(n / elapsed, 3) for v, n in sorted(counted["by_verb"].items())},
                requests_by_verb_resource=dict(sorted(counted["by_verb_resource"].items())),
                periodic_list_calls=sum(counted["periodic"].values()),
                periodic_list_calls_per_minute=round(sum(counted["periodic"].values()) / minutes, 1),
                periodic_list_calls_by_resource=dict(counted["periodic"]),
                watch_relists=dict(counted["relists"]),
                per_job_reconcile_interval_s=round(size * elapsed / gets, 1) if gets else None,
            )
        return {
            "seconds": round(elapsed, 1),
            "operator": {
                "pids": pids,
                "rss_mb": round(rss[-1], 1),
                "rss_mb_max": round(max(rss), 1),
                "cpu_seconds_per_minute": round((cpu1 - cpu0) / minutes, 2),
            },
            "apiserver": apiserver,
            "gcs": {
                "source": "counting proxy between the operator and fake-gcs-server",
                "operations": sum(gcs.values()),
                "by_kind": dict(sorted(gcs.items())),
                "operations_per_job_hour": round(sum(gcs.values()) / job_hours, 1) if job_hours else None,
            },
            "other_cpu_seconds_per_minute": {
                **{n: round((cpu_seconds(p) - other0[n]) / minutes, 2) for n, p in components.items()},
                "bench (this process)": round((time.process_time() - bench0) / minutes, 2),
            },
        }

    def staleness(self) -> dict[str, Any]:
        """How far each Running job's status.step is behind its trainer's latest progress record, in
        seconds of training (the stub trains 1 step a second): read right after the idle window, the
        status first, then the record (the bench reads GCS directly, not through the proxy)."""
        assert self.cluster.gcs is not None
        listing: Any = self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        behind: list[float] = []
        unknown = 0
        for tj in listing["items"]:
            status = tj.get("status") or {}
            if status.get("phase") != "Running":
                continue
            name = tj["metadata"]["name"]
            try:
                record = json.loads(self.cluster.gcs.download(BUCKET, f"scale/{NAMESPACE}/{name}/progress.json"))
            except (OSError, ValueError):
                unknown += 1
                continue
            if status.get("step") is None or int(record.get("attempt", -1)) != status.get("attempt"):
                unknown += 1
                continue
            behind.append(max(0, int(record["step"]) - int(status["step"])) / max(1, int(record["steps_per_second"])))
        histogram = Counter(int(b // 10 * 10) for b in behind)
        return {
            "measure": "trainer's latest progress record step - status.step, in seconds (1 step/s), Running jobs",
            **quantiles(behind, points=(50, 99)),
            "unknown": unknown,
            "histogram_10s": {f"{k}-{k + 10}": n for k, n in sorted(histogram.items())},
        }

    def running_worker(self, name: str) -> tuple[str, int] | None:
        pods: Any = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"{LABEL_NAME}={name}")
        running = [
            (p.metadata.name, int(p.metadata.labels.get(LABEL_ATTEMPT, -1)))
            for p in pods.items
            if p.status.phase == "Running" and not p.metadata.deletion_timestamp
        ]
        return max(running, key=lambda r: r[1]) if running else None

    def blackholed_reactions(self, size: int) -> dict[str, Any]:
        """The reaction while the operator's GCS accepts requests and never answers them (after
        --blackhole-settle seconds of it: every job's progress check has met it), then lifted."""
        log(f"size {size}: the operator's GCS blackholed; {self.args.blackhole_settle:.0f} s before the kills")
        gcs0 = self.proxy.snapshot()
        pids = self.operator_pids()
        cpu0, t0 = sum(cpu_seconds(p) for p in pids), time.monotonic()
        self.proxy.blackhole_on()
        try:
            time.sleep(self.args.blackhole_settle)
            reaction = self.reactions(self.args.blackhole_kills)
        finally:
            self.proxy.blackhole_off()
        cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) / ((time.monotonic() - t0) / 60)
        held = {k: n for k, n in (self.proxy.snapshot() - gcs0).items() if k.endswith("(blackholed)")}
        return {
            **reaction,
            "measure": reaction["measure"] + ", the operator's GCS requests held unanswered",
            "settle_seconds": self.args.blackhole_settle,
            "operator_cpu_seconds_per_minute": round(cpu, 2),
            "gcs_requests_held": sum(held.values()),
            "gcs_requests_held_by_kind": dict(sorted(held.items())),
        }

    def reactions(self, kills: int) -> dict[str, Any]:
        """Each kill's reaction, whole and split where the API first shows the failure: before it the
        node's share (here the pod runner, the kubelet's stand-in, serving every pod of the fleet on
        the bench's 2 cores; on GKE each node's own kubelet), after it the operator's."""
        samples: list[float] = []
        node: list[float | None] = []
        operator: list[float | None] = []
        timeouts, skipped = 0, 0
        candidates = self.rng.sample(self.jobs, len(self.jobs))
        for name in candidates:
            if len(samples) + timeouts >= kills:
                break
            worker = self.running_worker(name)
            if worker is None:
                skipped += 1
                continue
            pod, attempt = worker
            try:
                signal_pod(self.cluster.state_dir, NAMESPACE, pod, signal.SIGKILL)
            except (OSError, ValueError):
                skipped += 1
                continue
            killed = time.time()
            seen = self.jobsets.wait_for((name, attempt + 1), self.args.reaction_timeout)
            failed = self.failed_pods.wait_for(pod, 0 if seen is None else 5)
            if seen is None:
                timeouts += 1
                log(f"  {name}: no JobSet for attempt {attempt + 1} after {self.args.reaction_timeout} s")
            else:
                samples.append(seen - killed)
                node.append(None if failed is None else failed - killed)
                operator.append(None if failed is None else seen - failed)
                shares = "" if failed is None else f" (pod Failed in the API after {failed - killed:.3f} s)"
                log(f"  {name}: attempt {attempt + 1} JobSet after {seen - killed:.3f} s{shares}")
            time.sleep(self.rng.uniform(1.0, 3.0))
        return {
            "measure": "SIGKILL of the worker -> replacement JobSet seen ADDED (bench watch)",
            **quantiles(samples, points=(50, 99)),
            "node": {
                "measure": "SIGKILL -> the pod's phase Failed seen (bench watch): the pod runner's share",
                **quantiles(node, points=(50, 99)),
            },
            "operator": {
                "measure": "the pod's phase Failed seen -> replacement JobSet seen ADDED: the operator's share",
                **quantiles(operator, points=(50, 99)),
            },
            "timeouts": timeouts,
            "skipped_not_running": skipped,
            "samples_s": [round(s, 3) for s in samples],
        }


def helm_install(kubeconfig: Path, chart: Path, gcs_endpoint: str, env: dict[str, str]) -> None:
    """The chart as a user installs it, one replica (the one measured); its GCS traffic goes to the
    counting proxy; `env` added to the operator's (PYTHONPATH for a revision's sources, tracemalloc's)."""
    helm_install_operator(
        kubeconfig, "replicaCount=1", release=RELEASE, chart=chart, env={"STORAGE_EMULATOR_HOST": gcs_endpoint, **env}
    )


@contextmanager
def operator_source(rev: str | None, parent: Path) -> Iterator[tuple[str, Path | None]]:
    """(commit, checkout): REV in a detached git worktree (removed on the way out), or the working tree."""
    if rev is None:
        dirty = " (working tree, with uncommitted changes)" if git("status", "--porcelain", "--", *SOURCES) else ""
        yield git("rev-parse", "HEAD") + dirty, None
        return
    with worktree(rev, parent) as checkout:
        yield checkout


TARGETS = {
    "operator_rss_mb": 200,
    "reaction_p99_s": 2.0,
    "reaction_gcs_blackholed_p99_s": 2.0,
    "reaction_operator_p99_s": 2.0,
    "reaction_gcs_blackholed_operator_p99_s": 2.0,
    "periodic_list_calls": 0,
    "gcs_ops_per_idle_job_hour": 60,
}


def targets(size: dict[str, Any]) -> dict[str, Any]:
    idle = size["idle"]
    got = {
        "operator_rss_mb": idle["operator"]["rss_mb_max"],
        "reaction_p99_s": size["reaction"]["p99"],
        "reaction_gcs_blackholed_p99_s": _blackholed_p99(size),
        "reaction_operator_p99_s": size["reaction"]["operator"]["p99"],
        "reaction_gcs_blackholed_operator_p99_s": _blackholed_p99(size, "operator"),
        "periodic_list_calls": idle["apiserver"].get("periodic_list_calls"),
        "gcs_ops_per_idle_job_hour": idle["gcs"]["operations_per_job_hour"],
    }
    return {
        key: {"target": limit, "got": got[key], "met": got[key] is not None and got[key] <= limit}
        for key, limit in TARGETS.items()
        if key in got and ("gcs_blackholed" not in key or "reaction_gcs_blackholed" in size)
    }


def _blackholed_p99(size: dict[str, Any], share: str | None = None) -> float | None:
    """The p99 with the operator's GCS blackholed, whole or one share of it; a kill never reacted to
    within the timeout makes it unmet (None) whatever the others."""
    reaction = size.get("reaction_gcs_blackholed")
    if reaction is None or reaction["timeouts"]:
        return None
    p99: float | None = (reaction[share] if share else reaction)["p99"]
    return p99


def run_sizes(
    args: argparse.Namespace, sizes: list[int], temp: Path, source: Path | None
) -> tuple[list[dict[str, Any]], str | None, float | None]:
    """Start the devcluster and the operator, step up through the sizes; whatever was reached."""
    results: list[dict[str, Any]] = []
    error: str | None = None
    cluster_seconds: float | None = None
    pools_file = temp / "pools.yaml"
    pools_file.write_text(yaml.safe_dump({"pools": [], "system_nodes": 1}))
    t0 = time.monotonic()
    for tries_left in (2, 1, 0):  # a port picked free can be taken by another process before it is bound
        log("starting the devcluster")
        cluster = DevCluster(
            temp / "cluster", pools_file, audit_policy=AUDIT_POLICY, pod_runner_interval=args.pod_runner_interval
        )
        try:
            cluster.start()
            break
        except Exception as failure:
            cluster.stop()
            if not tries_left:
                raise
            log(f"devcluster start failed ({type(failure).__name__}), starting again")
    proxy: CountingProxy | None = None
    try:
        assert cluster.gcs is not None
        proxy = CountingProxy(cluster.gcs.port)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        if source is not None:
            cluster.plane.apply_crd(source / "crds" / "trainingjob.yaml")
        paths = [str(source / d) for d in SOURCES] if source is not None else []
        env: dict[str, str] = {}
        if args.tracemalloc:
            (temp / "tracemalloc").mkdir()
            paths.insert(0, str(TRACEMALLOC_HOOK))
            env.update(
                TPUJOB_TRACEMALLOC_FRAMES=str(args.tracemalloc), TPUJOB_TRACEMALLOC_DIR=str(temp / "tracemalloc")
            )
        if paths:
            env["PYTHONPATH"] = ":".join(paths)
        helm_install(cluster.kubeconfig, (source or REPO_ROOT) / "charts" / "tpujob", proxy.endpoint, env)
        cluster_seconds = round(time.monotonic() - t0, 1)
        log(f"devcluster and operator ready in {cluster_seconds} s")
        bench = Bench(cluster, proxy, args, TracemallocProbe(temp / "tracemalloc") if args.tracemalloc else None)
        bench.ensure_namespace()
        for size in sizes:
            t1 = time.monotonic()
            try:
                results.append(bench.step_up(size))
            except Exception as failure:  # report what was reached
                error = f"size {size}: {type(failure).__name__}: {failure}"
                log(error)
                break
            results[-1]["wall_seconds"] = round(time.monotonic() - t1, 1)
            log(f"size {size} done in {results[-1]['wall_seconds']} s")
    finally:
        if proxy is not None:
            proxy.shutdown()
        cluster.stop()
    return results, error, cluster_seconds


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the devcluster is stopped too
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000", help="comma-separated job counts, stepped up in order")
    parser.add_argument("--idle-seconds", type=float, default=120.0, help="idle window per size")
    parser.add_argument("--kills", type=int, default=10, help="worker kills (reaction samples) per size")
    parser.add_argument("--progress-seconds", type=int, default=20, help="stub trainer: progress record interval")
    parser.add_argument("--commit-seconds", type=int, default=180, help="stub trainer: committed step interval")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="base wait for all jobs Running (s)")
    parser.add_argument("--ready-seconds-per-job", type=float, default=1.0, help="plus this per job added (s)")
    parser.add_argument("--settle-seconds", type=float, default=30.0, help="pause between Running and the window")
    parser.add_argument("--reaction-timeout", type=float, default=60.0, help="wait for one replacement JobSet (s)")
    parser.add_argument(
        "--keep-up-staleness",
        type=float,
        default=120.0,
        help="status.step behind the trainer's record by more than this (p99) is not keeping up (s)",
    )
    parser.add_argument(
        "--blackhole-kills",
        type=int,
        default=0,
        help="then, with the operator's GCS blackholed (requests held unanswered), this many more kills per size",
    )
    parser.add_argument(
        "--blackhole-settle", type=float, default=60.0, help="blackholed this long before those kills (s)"
    )
    parser.add_argument("--spare-pools", type=int, default=5, help="node pools beyond jobs + kills")
    parser.add_argument("--pod-runner-interval", type=float, default=1.0, help="the pod runner's pass interval (s)")
    parser.add_argument("--operator-rev", help="run this revision's operator and chart (git worktree)")
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="FRAMES",
        help="trace the operator's allocations (FRAMES a trace), from the end of the first size on, and report for "
        "each later size where its memory is and what a job added since the size before (e.g. --sizes 10,100,200; "
        "tracing slows the operator and inflates its RSS: measure RSS in a run without it)",
    )
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if sizes != sorted(sizes):
        parser.error("--sizes must increase (the cluster is stepped up)")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tpujob-scale-") as temp_dir:
        temp = Path(temp_dir)
        with operator_source(args.operator_rev, temp) as (commit, source):
            results, error, cluster_seconds = run_sizes(args, sizes, temp, source)
    largest = results[-1] if results else None
    document = {
        "benchmark": "operator_scale",
        "workload": f"TrainingJobs of 1 slice {ACCELERATOR} {TOPOLOGY} (1 worker pod), backoff 0, stub trainer "
        f"(progress every {args.progress_seconds} s, a committed step every {args.commit_seconds} s), "
        "one kwok node pool per job",
        "command": " ".join(["bench/operator_scale.py", *sys.argv[1:]]),
        "git_rev": git("rev-parse", "HEAD"),
        "operator": {"rev": args.operator_rev or "working tree", "commit": commit},
        "machine": {"cpus": os.cpu_count(), "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "cluster_start_seconds": cluster_seconds,
        "sizes": results,
        "curve": [
            {
                "jobs": r["jobs"],
                "operator_rss_mb": r["idle"]["operator"]["rss_mb_max"],
                "operator_cpu_seconds_per_minute": r["idle"]["operator"]["cpu_seconds_per_minute"],
                "apiserver_rps": r["idle"]["apiserver"].get("requests_per_second"),
                "apiserver_rps_by_verb": r["idle"]["apiserver"].get("rps_by_verb"),
                "periodic_list_calls_per_minute": r["idle"]["apiserver"].get("periodic_list_calls_per_minute"),
                "per_job_reconcile_interval_s": r["idle"]["apiserver"].get("per_job_reconcile_interval_s"),
                "status_staleness_p50_s": r["status_staleness"]["p50"],
                "status_staleness_p99_s": r["status_staleness"]["p99"],
                "gcs_ops_per_job_hour": r["idle"]["gcs"]["operations_per_job_hour"],
                "reaction_p50_s": r["reaction"]["p50"],
                "reaction_p99_s": r["reaction"]["p99"],
                "reaction_n": r["reaction"]["n"],
                "reaction_node_p50_s": r["reaction"]["node"]["p50"],
                "reaction_operator_p50_s": r["reaction"]["operator"]["p50"],
                "reaction_operator_p99_s": r["reaction"]["operator"]["p99"],
                **(
                    {
                        "reaction_gcs_blackholed_p50_s": r["reaction_gcs_blackholed"]["p50"],
                        "reaction_gcs_blackholed_p99_s": r["reaction_gcs_blackholed"]["p99"],
                        "reaction_gcs_blackholed_n": r["reaction_gcs_blackholed"]["n"],
                        "reaction_gcs_blackholed_operator_p50_s": r["reaction_gcs_blackholed"]["operator"]["p50"],
                        "reaction_gcs_blackholed_operator_p99_s": r["reaction_gcs_blackholed"]["operator"]["p99"],
                        "reaction_gcs_blackholed_timeouts": r["reaction_gcs_blackholed"]["timeouts"],
                    }
                    if "reaction_gcs_blackholed" in r
                    else {}
                ),
                "ready_seconds": r["ready_seconds"],
                "keeping_up": r["keeping_up"],
            }
            for r in results
        ],
        "stops_keeping_up_at": next((r["jobs"] for r in results if not r["keeping_up"]), None),
        "targets_at_largest_size": {"jobs": largest["jobs"], **targets(largest)} if largest else None,
        "error": error,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
