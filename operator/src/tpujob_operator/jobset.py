"""The JobSet wire format, both ways. Pure builder: TrainingJob (+ attempt, + resume step) -> JobSet
manifest (jobset.x-k8s.io/v1alpha2); pure decoder: the JobSets, pods and Kueue Workloads the API
returns -> facts.py (the labels, annotations and conditions the builder and the controllers wrote).

Shaped like XPK's multislice JobSets: one replicated job "slice" with one Job per TPU slice, an
Indexed Job of `hosts` pods per slice, exclusive node-pool placement and DNS hostnames so that pods
find the JAX coordinator at <jobset>-slice-0-0.<jobset>.
"""

from __future__ import annotations

import copy
import shlex
from datetime import UTC, datetime
from typing import Any, Literal, get_args

import tpujob_contract as contract
from tpujob_contract import (
    ACCELERATOR_LABEL,
    ANNOTATION_RESUME_STEP,
    ANNOTATION_SUSPENDED,
    JOB_INDEX_ANNOTATION,
    JOBSET_GROUP,
    JOBSET_VERSION,
    LABEL_ATTEMPT,
    LABEL_NAME,
    LABEL_UID,
    NODE_POOL_LABEL,
    PRIORITY_CLASS_LABEL,
    QUEUE_LABEL,
    TOPOLOGY_LABEL,
    TPU_RESOURCE,
)

from . import frameworks
from .api import GROUP, IN_PLACE, KIND, VERSION, LocalCheckpointSpec, RestartSpec, TrainingJob
from .cadence import job_mtbf
from .facts import JobSetFacts, JobSetState, PodFacts
from .restarts import NOT_RESTARTED_EXIT_CODES
from .status import parse_time
from .tpu import slice_shape

REPLICATED_JOB = "slice"
# What the Job controller labels its pods with: their Job's name and uid.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
JOB_UID_LABEL = "batch.kubernetes.io/controller-uid"
CONTAINER = "trainer"
COORDINATOR_PORT = 8476

EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# Time a worker gets after SIGTERM to finish the in-flight save and write the current step.
TERMINATION_GRACE_SECONDS = 120
# Pod Security "restricted": the worker runs as the image's non-root (numeric) USER, cannot gain
# privileges, holds no capabilities and runs under the runtime's default seccomp profile. TPU chips
# reach the container through the device plugin, without privileges.
POD_SECURITY_CONTEXT: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}

# spec.restart.strategy InPlace: JobSet's InPlaceRestart (KEP-467, JobSet v0.11 and later). Its agent wraps the
# worker (v0.12's "main container mode"): it waits at the JobSet's barrier, runs WORKER_COMMAND with $SHELL -c,
# and exits with the worker's code, or with IN_PLACE_RESTART_EXIT_CODE when another pod's failure asks every
# worker to restart. The kubelet then restarts the container on its node (container restartPolicyRules,
# Kubernetes' ContainerRestartRules).
IN_PLACE_AGENT = "in-place-restart-agent"  # on the trainer image's PATH (docs/concepts/restart-ladder.md)
# The container's PID 1 in front of the agent (trainer_image/init): the agent ends its worker at once on
# SIGTERM; under tpujob-init the worker gets the SIGTERM instead, makes its save, and the agent exits with
# the worker's code.
WORKER_INIT = "tpujob-init"
IN_PLACE_RESTART_EXIT_CODE = 86  # no trainer exit code (contract.ExitCode) and no 128+signal
# The shell the agent runs WORKER_COMMAND with: v0.11 ran /bin/sh; v0.12 runs $SHELL, else bash, and exits
# at once where an image has no bash. WORKER_COMMAND is POSIX sh.
WORKER_SHELL = "/bin/sh"
JOBSET_NAME_ANNOTATION = "jobset.sigs.k8s.io/jobset-name"  # the JobSet controller sets it on every pod
IN_PLACE_RESTART_ATTEMPT_ANNOTATION = "jobset.sigs.k8s.io/in-place-restart-attempt"  # the agent sets it on its pod
IN_PLACE_STRATEGY = "InPlaceRestart"  # JobSet's failurePolicy.restartStrategy
# The container restart rule's action (the operator's --in-place-restart-action): Restart (Kubernetes 1.35,
# ContainerRestartRules, beta) goes through the kubelet's crash-loop back-off at every restart, the
# agents' included (a second round within 10 minutes waits 10 s, a third 20 s); RestartAllContainers
# (1.35 alpha: RestartAllContainersOnContainerExits, NodeDeclaredFeatures) starts the pod's containers
# afresh, without it.
InPlaceRestartAction = Literal["Restart", "RestartAllContainers"]
IN_PLACE_RESTART_ACTIONS: tuple[InPlaceRestartAction, ...] = get_args(InPlaceRestartAction)
JOB_BACKOFF_LIMIT_MAX = 2**31 - 1  # JobSet's InPlaceRestart requires it: a failed pod never fails its Job


def jobset_name(name: str, attempt: int) -> str:
    """One JobSet per attempt: a restart never waits for the old pods' hostnames to be released."""
    return f"{name}-a{attempt}"


def slice_job_name(js_name: str, index: int) -> str:
    """The name JobSet gives slice `index`'s Job (its placement.GenJobName)."""
    return f"{js_name}-{REPLICATED_JOB}-{index}"


def coordinator_host(js_name: str) -> str:
    return f"{slice_job_name(js_name, 0)}-0.{js_name}"


def _env(name: str, value: str | int | float | bool) -> dict[str, str]:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return {"name": name, "value": text}


def _slice_index_env(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_ANNOTATION}']"}},
    }


def trainer_env(
    tj: TrainingJob, attempt: int, resume_step: int | None, js_name: str, slices: int | None = None
) -> list[dict[str, Any]]:
    """The operator <-> trainer contract (trainer_image/README.md). Operator keys come after the
    user's env so a user entry cannot silently break the contract (the last duplicate wins).
    `slices`: the attempt's (spec.elastic may run it on fewer than spec.tpu.slices)."""
    slices = slices or tj.spec.tpu.slices
    shape = slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology)
    ckpt = tj.spec.checkpoint
    coordinator = coordinator_host(js_name)
    env = contract.Env
    resume = contract.LATEST if resume_step is None else contract.Resume.at(resume_step)
    return [
        *[e.model_dump(by_alias=True, exclude_none=True) for e in tj.spec.env or []],
        _env(env.NAME, tj.name),
        _env(env.NAMESPACE, tj.namespace),
        _env(env.UID, tj.metadata["uid"]),
        _env(env.ATTEMPT, attempt),
        _env(env.RESUME, resume.encode()),
        _env(env.RUN_DIR, tj.run_dir),
        _env(env.NUM_SLICES, slices),
        _env(env.FULL_SLICES, tj.spec.tpu.slices),
        _env(env.HOSTS_PER_SLICE, shape.hosts),
        _slice_index_env(env.SLICE_ID),
        _env(env.COORDINATOR_ADDRESS, f"{coordinator}:{COORDINATOR_PORT}"),
        _env(env.MEGASCALE_COORDINATOR_ADDRESS, coordinator),
        _env(env.MEGASCALE_NUM_SLICES, slices),
        _slice_index_env(env.MEGASCALE_SLICE_ID),
        _env(env.CHECKPOINT_POLICY, ckpt.policy),
        _env(env.CHECKPOINT_MIN_INTERVAL_SECONDS, ckpt.min_interval_seconds),
        _env(env.CHECKPOINT_INTERVAL_STEPS, ckpt.interval_steps or 0),
        _env(env.CHECKPOINT_ASYNC, ckpt.async_),
        _env(env.CHECKPOINT_KEEP_LATEST, ckpt.keep.latest),
        _env(env.CHECKPOINT_KEEP_EVERY_STEPS, ckpt.keep.every_steps or 0),
        _env(env.CHECKPOINT_SAVE_ON_PREEMPTION, ckpt.save_on_preemption),
        _env(env.DISTRIBUTED_INIT_TIMEOUT_SECONDS, distributed_init_timeout(tj.spec.restart)),
        _env(env.HANG_TIMEOUT_SECONDS, tj.spec.restart.hang_timeout_seconds),
        *_adaptive_env(tj),
    ]


# Beyond the operator's own clocks, so that they decide a slow start, never JAX.
DISTRIBUTED_INIT_MARGIN_SECONDS = 300


def distributed_init_timeout(policy: RestartSpec) -> int:
    """How long a worker waits in JAX's start-up for every peer: a slice placed early waits for the
    others through the whole scheduling stage, then the start-up stage (spec.restart). 0 (for ever)
    when either clock never ends; JAX's own 300 s would end a wait the job allows (issue 17, item 14)."""
    if policy.scheduling_timeout_seconds == 0 or policy.startup_timeout_seconds == 0:
        return 0
    return policy.scheduling_timeout_seconds + policy.startup_timeout_seconds + DISTRIBUTED_INIT_MARGIN_SECONDS


def _adaptive_env(tj: TrainingJob) -> list[dict[str, str]]:
    """The adaptive policy's budget and bounds, and the failure rate it weighs saves against."""
    ckpt = tj.spec.checkpoint
    if ckpt.policy != "adaptive":
        return []
    env = contract.Env
    budget = ckpt.overhead_budget_percent or contract.DEFAULT_OVERHEAD_BUDGET_PERCENT
    return [
        _env(env.CHECKPOINT_OVERHEAD_BUDGET_PERCENT, budget),
        *([_env(env.CHECKPOINT_MAX_INTERVAL_SECONDS, ckpt.max_interval_seconds)] if ckpt.max_interval_seconds else []),
        _env(env.MTBF_SECONDS, round(job_mtbf(tj.status), 1)),
    ]


def _resources(tj: TrainingJob, chips_per_host: int) -> dict[str, dict[str, int | str]]:
    user = tj.spec.resources
    requests = dict(user.requests or {}) if user else {}
    limits = dict(user.limits or {}) if user else {}
    requests[TPU_RESOURCE] = chips_per_host
    limits[TPU_RESOURCE] = chips_per_host
    return {"requests": requests, "limits": limits}


def workload_priority_class(tj: TrainingJob) -> str | None:
    """The Kueue WorkloadPriorityClass the job's label names: what a queued JobSet carries, and what the
    policy checks (policy.violations)."""
    return (tj.metadata.get("labels") or {}).get(PRIORITY_CLASS_LABEL) or None


def _kueue_labels(tj: TrainingJob, queue: str | None) -> dict[str, str]:
    if not queue:
        return {}
    priority = workload_priority_class(tj)
    return {QUEUE_LABEL: queue, **({PRIORITY_CLASS_LABEL: priority} if priority else {})}


def owner_reference(tj: TrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": tj.name,
        "uid": tj.metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def queue_name(tj: TrainingJob, default: str | None) -> str | None:
    """The Kueue LocalQueue of the job: its own label, else the operator's default (None: no Kueue)."""
    labelled = (tj.metadata.get("labels") or {}).get(QUEUE_LABEL)
    return labelled or default or None


def build_jobset(
    tj: TrainingJob,
    attempt: int,
    resume_step: int | None,
    queue: str | None = None,
    restart_action: InPlaceRestartAction = "Restart",
    slices: int | None = None,
) -> dict[str, Any]:
    """With a queue, Kueue decides when the JobSet runs: it is created suspended, and its workers
    resume from the latest committed step (not a pinned one), since Kueue may preempt and resume
    the same JobSet after its pods saved a newer step on SIGTERM. `slices`: the attempt's slice count
    (spec.tpu.slices unless spec.elastic runs it on fewer)."""
    slices = slices or tj.spec.tpu.slices
    shape = slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology)
    name = jobset_name(tj.name, attempt)
    labels = {
        LABEL_NAME: tj.name,
        LABEL_ATTEMPT: str(attempt),
        LABEL_UID: str(tj.metadata["uid"]),
        "app.kubernetes.io/managed-by": "tpujob",
    }
    if queue:
        resume_step = None
    jobset_labels = {**labels, **_kueue_labels(tj, queue)}
    framework = frameworks.for_job(tj)  # its env after the contract's, its args
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": tj.spec.image,
        "env": [
            *trainer_env(tj, attempt, resume_step, name, slices),
            *framework.env(tj, coordinator_host(name), shape.hosts),
            *[_slice_index_env(env_name) for env_name in framework.slice_index_env],
        ],
        "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}],
        # A worker that dies without writing its termination-log (an abort in JAX's distributed runtime,
        # exit 134) leaves its last log lines there instead: restarts.classify_pod reads them.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": _resources(tj, shape.chips_per_host),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
    }
    if tj.spec.command:
        container["command"] = list(tj.spec.command)
    args = framework.args(tj)
    if args:
        container["args"] = args
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "nodeSelector": {ACCELERATOR_LABEL: shape.accelerator, TOPOLOGY_LABEL: shape.topology},
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        # The trainer needs no Kubernetes credentials unless the spec asks for them.
        "automountServiceAccountToken": tj.spec.automount_service_account_token,
    }
    if tj.spec.service_account_name:
        pod_spec["serviceAccountName"] = tj.spec.service_account_name
    if tj.spec.priority_class_name:
        pod_spec["priorityClassName"] = tj.spec.priority_class_name
    if ckpt_local := tj.spec.checkpoint.local:
        _with_local_tier(ckpt_local, container, pod_spec)
    job_spec: dict[str, Any] = {
        "parallelism": shape.hosts,
        "completions": shape.hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        # A worker is replaced (after a queue's suspension and resumption) only once the old one has ended:
        # by default the Job controller starts the new pod while the old one still runs its SIGTERM save,
        # and two trainers of one attempt would write its run directory at once.
        "podReplacementPolicy": "Failed",
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
    }
    # The operator, not JobSet, restarts a Recreate: a restart must pin the latest committed step
    # (found in GCS) into the workers' env and be classified and accounted for in status.
    failure_policy: dict[str, Any] = {"maxRestarts": 0}
    if tj.spec.restart.strategy == IN_PLACE:
        failure_policy = _in_place(tj, container, pod_spec, job_spec, framework.entrypoint, restart_action)
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": tj.namespace,
            "labels": jobset_labels,
            "annotations": {
                EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL,
                ANNOTATION_RESUME_STEP: str(-1 if resume_step is None else resume_step),
                ANNOTATION_SUSPENDED: str(tj.spec.suspend).lower(),
            },
            "ownerReferences": [owner_reference(tj)],
        },
        "spec": {
            "failurePolicy": failure_policy,
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "suspend": tj.spec.suspend or queue is not None,
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": slices,
                    "template": {
                        "metadata": {"labels": dict(labels)},
                        "spec": job_spec,
                    },
                }
            ],
        },
    }


LOCAL_TIER_VOLUME = "local-checkpoints"


def _with_local_tier(local: LocalCheckpointSpec, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """The trainer's local tier: a memory-backed emptyDir, which lives as long as the pod (through
    in-place restarts), and the env that points the trainer at it."""
    memory = {"medium": "Memory", "sizeLimit": local.size_limit}
    _with_empty_dir(container, pod_spec, LOCAL_TIER_VOLUME, memory, contract.LOCAL_CHECKPOINT_MOUNT)
    container["env"] = [
        *container["env"],
        _env(contract.Env.LOCAL_CHECKPOINT_DIR, contract.LOCAL_CHECKPOINT_MOUNT),
        _env(contract.Env.LOCAL_CHECKPOINT_INTERVAL_STEPS, local.interval_steps),
        _env(contract.Env.LOCAL_CHECKPOINT_OVERHEAD_BUDGET_PERCENT, local.overhead_budget_percent),
        _env(contract.Env.LOCAL_CHECKPOINT_BUDDY_COPIES, local.buddy_copies),
    ]


COMPILE_CACHE_VOLUME = "compile-cache"


def _with_empty_dir(
    container: dict[str, Any], pod_spec: dict[str, Any], name: str, source: dict[str, Any], mount_path: str
) -> None:
    """An emptyDir volume of the pod (it outlives an in-place restart, not the pod), mounted in `container`."""
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), {"name": name, "emptyDir": source}]
    container["volumeMounts"] = [*container.get("volumeMounts", []), {"name": name, "mountPath": mount_path}]


def _with_own_compile_cache(container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """InPlace workers: each process's own compilation cache on an emptyDir (the node's disk), which
    outlives a restart in place, so the restarted process reads its executables instead of compiling
    (the trainer reads it before the shared cache in the run directory). A new pod starts it empty."""
    _with_empty_dir(container, pod_spec, COMPILE_CACHE_VOLUME, {}, contract.LOCAL_COMPILATION_CACHE_MOUNT)
    container["env"] = [
        *container["env"],
        _env(contract.Env.LOCAL_COMPILATION_CACHE_DIR, contract.LOCAL_COMPILATION_CACHE_MOUNT),
    ]


def worker_command(argv: list[str]) -> str:
    """The agent's WORKER_COMMAND (run with `sh -c`, WORKER_SHELL). Not a simple command, which the shell would exec:
    the agent reports a worker killed by a signal as exit 255, the shell (waiting for it) as 128+N,
    what a container runtime reports and restarts.py classifies. The shell traps SIGTERM and SIGINT
    (tpujob-init sends them to every process but the agent), so it waits for the worker's save and
    exits with its code; the worker itself gets the signals' default handling (a trap with a command
    is not inherited)."""
    return f"trap : TERM INT; {shlex.join(argv)}; exit $?"


def _in_place(
    tj: TrainingJob,
    container: dict[str, Any],
    pod_spec: dict[str, Any],
    job_spec: dict[str, Any],
    entrypoint: tuple[str, ...],
    restart_action: InPlaceRestartAction,
) -> dict[str, Any]:
    """Make the attempt's pods restart in place (mutates the three dicts the builder made); the JobSet's
    failurePolicy. JobSet fails the attempt when one in-place restart more than inPlace.maxRestarts is
    needed, and the operator then recreates it: the ladder's climb is JobSet's own count."""
    worker = [*(tj.spec.command or entrypoint), *container.pop("args", [])]
    container["command"] = [WORKER_INIT, IN_PLACE_AGENT]
    container["env"] = [
        *container["env"],
        {
            "name": "JOBSET_NAME",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOBSET_NAME_ANNOTATION}']"}},
        },
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        _env("IN_PLACE_RESTART_EXIT_CODE", IN_PLACE_RESTART_EXIT_CODE),
        _env("WORKER_COMMAND", worker_command(worker)),
        _env("SHELL", WORKER_SHELL),
    ]
    _with_own_compile_cache(container, pod_spec)
    container["restartPolicy"] = "Never"
    container["restartPolicyRules"] = [
        {"action": restart_action, "exitCodes": {"operator": "NotIn", "values": list(NOT_RESTARTED_EXIT_CODES)}}
    ]
    pod_spec["automountServiceAccountToken"] = True  # the agent reads its JobSet and annotates its pod
    job_spec["backoffLimit"] = JOB_BACKOFF_LIMIT_MAX
    return {"restartStrategy": IN_PLACE_STRATEGY, "maxRestarts": tj.spec.restart.in_place.max_restarts}


# Decoding: what the API returns (plain dicts in its camelCase) -> facts.py. Reads back the labels and
# annotations build_jobset wrote, and what the apiserver, the JobSet and Job controllers and Kueue added.


def _condition(conditions: list[dict[str, Any]] | None, type_: str, status: str = "True") -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_ and c.get("status") == status), None)


def pod_facts(pod: dict[str, Any]) -> PodFacts:
    meta, status = pod["metadata"], pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    labels = meta.get("labels") or {}
    slice_text = annotations.get(JOB_INDEX_ANNOTATION) or labels.get(JOB_INDEX_ANNOTATION)
    container: dict[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == CONTAINER), {}
    )
    terminated = (container.get("state") or {}).get("terminated") or {}
    waiting = (container.get("state") or {}).get("waiting") or {}
    last = (container.get("lastState") or {}).get("terminated") or {}
    if last.get("exitCode") == IN_PLACE_RESTART_EXIT_CODE:  # the agent ended it: another pod's failure
        last = {}
    attempt_text = str(annotations.get(IN_PLACE_RESTART_ATTEMPT_ANNOTATION, ""))
    disruption = _condition(status.get("conditions"), "DisruptionTarget")
    scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
    unschedulable = scheduled.get("message") if scheduled and scheduled.get("reason") == "Unschedulable" else None
    scheduled_at = None
    if scheduled is not None and scheduled.get("status") == "True":
        scheduled_at = parse_time(scheduled.get("lastTransitionTime")) or parse_time(meta.get("creationTimestamp"))
    return PodFacts(
        name=meta["name"],
        slice=int(slice_text) if slice_text and slice_text.isdigit() else None,
        phase=status.get("phase", "Pending"),
        exit_code=terminated.get("exitCode"),
        reason=terminated.get("reason") or status.get("reason"),
        pod_reason=status.get("reason"),
        pod_message=status.get("message"),
        disruption_reason=disruption.get("reason") if disruption else None,
        disruption_since=parse_time(disruption.get("lastTransitionTime")) if disruption else None,
        finished_at=parse_time(terminated.get("finishedAt")),
        unschedulable_message=unschedulable,
        created=parse_time(meta.get("creationTimestamp")),
        scheduled_at=scheduled_at,
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        termination_message=terminated.get("message"),
        node=(pod.get("spec") or {}).get("nodeName"),
        restart_count=int(container.get("restartCount") or 0),
        last_exit_code=last.get("exitCode"),
        last_reason=last.get("reason"),
        last_finished_at=parse_time(last.get("finishedAt")),
        last_termination_message=last.get("message"),
        in_place_attempt=int(attempt_text) if attempt_text.isdigit() else None,
        deleting=bool(meta.get("deletionTimestamp")),
        job=labels.get(JOB_NAME_LABEL),
        job_uid=labels.get(JOB_UID_LABEL),
    )


def jobset_state(jobset: dict[str, Any]) -> tuple[JobSetState, dict[str, Any] | None]:
    conditions = (jobset.get("status") or {}).get("conditions")
    for type_, state in (("Completed", "Completed"), ("Failed", "Failed")):
        found = _condition(conditions, type_)
        if found:
            return state, found  # type: ignore[return-value]
    # spec.suspend is the decision (whoever made it: the operator or a queueing system).
    if (jobset.get("spec") or {}).get("suspend"):
        return "Suspended", None
    return "Active", None


def incarnation_uid(obj: dict[str, Any]) -> str | None:
    """The TrainingJob uid an object belongs to: its label, else its controller owner reference
    (JobSets created before the label existed)."""
    meta = obj["metadata"]
    labelled = (meta.get("labels") or {}).get(LABEL_UID)
    if labelled:
        return str(labelled)
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == KIND), None)
    return str(owner["uid"]) if owner else None


def expected_pods(jobset: dict[str, Any]) -> int:
    return sum(
        int(rj.get("replicas", 1)) * int(((rj.get("template") or {}).get("spec") or {}).get("parallelism", 1))
        for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []
    )


def workload_admission(workload: dict[str, Any]) -> tuple[datetime | None, str | None]:
    """Kueue's word on a Workload: when it was admitted (None while it is not), and why it waits or
    was evicted (the message of its newest False QuotaReserved/Admitted or True Evicted condition)."""
    conditions = (workload.get("status") or {}).get("conditions") or []
    admitted = _condition(conditions, "Admitted")
    if admitted is not None:
        return parse_time(admitted.get("lastTransitionTime")), None
    telling = [
        c
        for c in conditions
        if (c.get("type") in ("QuotaReserved", "Admitted") and c.get("status") == "False")
        or (c.get("type") in ("Evicted", "Preempted") and c.get("status") == "True")
    ]
    newest = max(telling, key=lambda c: str(c.get("lastTransitionTime") or ""), default=None)
    return None, (str(newest.get("message") or newest.get("reason") or "") or None) if newest else None


def jobset_facts(
    jobset: dict[str, Any],
    pods: list[dict[str, Any]],
    pod_creation_refused: str | None = None,
    admission: tuple[datetime | None, str | None] = (None, None),
) -> JobSetFacts:
    meta = jobset["metadata"]
    state, condition = jobset_state(jobset)
    annotations = meta.get("annotations") or {}
    resume = annotations.get(ANNOTATION_RESUME_STEP, "-1")
    conditions = (jobset.get("status") or {}).get("conditions")
    resumed = _condition(conditions, "Suspended", "False")
    pod_list = tuple(pod_facts(p) for p in pods)
    in_place = ((jobset.get("spec") or {}).get("failurePolicy") or {}).get("restartStrategy") == IN_PLACE_STRATEGY
    rounds = in_place_rounds(jobset, pod_list) if in_place else (0, 0)
    return JobSetFacts(
        name=meta["name"],
        attempt=int((meta.get("labels") or {}).get(LABEL_ATTEMPT, "0")),
        resume_step=None if int(resume) < 0 else int(resume),
        created=parse_time(meta.get("creationTimestamp")) or datetime.now(UTC),
        state=state,
        condition_reason=(condition or {}).get("reason", ""),
        condition_message=(condition or {}).get("message", ""),
        ended_at=parse_time((condition or {}).get("lastTransitionTime")),
        pods=pod_list,
        deleting=bool(meta.get("deletionTimestamp")),
        uid=incarnation_uid(jobset),
        expected_pods=expected_pods(jobset),
        slices=sum(int(rj.get("replicas", 1)) for rj in (jobset.get("spec") or {}).get("replicatedJobs") or []),
        resumed_at=parse_time(resumed.get("lastTransitionTime")) if resumed else None,
        suspended_by_operator=annotations.get(ANNOTATION_SUSPENDED) == "true",
        resuming=state == "Active" and _condition(conditions, "Suspended") is not None,
        pod_creation_refused=pod_creation_refused,
        queue_name=(meta.get("labels") or {}).get(QUEUE_LABEL),
        admitted_at=admission[0],
        queue_reason=admission[1],
        in_place=in_place,
        in_place_round=rounds[0],
        pods_in_place_round=rounds[1],
    )


def in_place_rounds(jobset: dict[str, Any], pods: tuple[PodFacts, ...]) -> tuple[int, int]:
    """The highest in-place restart round begun (JobSet's current and previous attempt counters, and what
    the pods show), and the highest the pods alone show: their agents' annotations, and a failed pod's
    round + 1 (the JobSet's current round + 1 when it failed before its agent annotated it)."""
    status = jobset.get("status") or {}
    current, previous = status.get("currentInPlaceRestartAttempt"), status.get("previousInPlaceRestartAttempt")
    shown = [0]
    for pod in pods:
        at = pod.in_place_attempt
        if at is not None:
            shown.append(at + 1 if pod.phase == "Failed" else at)
        elif pod.phase == "Failed":  # failed before its agent annotated it
            shown.append(int(current or 0) + 1)
    counted = [int(current or 0), int(previous) + 1 if previous is not None else 0]
    return max(*counted, *shown), max(shown)
