"""Pure builder: TrainingJob (+ attempt, + resume step) -> JobSet manifest (jobset.x-k8s.io/v1alpha2).

Shaped like XPK's multislice JobSets: one replicated job "slice" with one Job per TPU slice, an
Indexed Job of `hosts` pods per slice, exclusive node-pool placement and DNS hostnames so that pods
find the JAX coordinator at <jobset>-slice-0-0.<jobset>.
"""

from __future__ import annotations

from typing import Any

import tpujob_contract as contract

from .api import GROUP, KIND, VERSION, TrainingJob
from .tpu import slice_shape

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
REPLICATED_JOB = "slice"
CONTAINER = "trainer"
COORDINATOR_PORT = 8476

LABEL_NAME = f"{GROUP}/name"
LABEL_ATTEMPT = f"{GROUP}/attempt"
LABEL_UID = f"{GROUP}/uid"  # the TrainingJob incarnation: a same-name successor never adopts what it labels
ANNOTATION_RESUME_STEP = f"{GROUP}/resume-step"
# "true" while the operator holds the JobSet suspended for spec.suspend; a suspension without it is
# someone else's (a queueing system's), which the operator never lifts.
ANNOTATION_SUSPENDED = f"{GROUP}/suspended"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
# Time a worker gets after SIGTERM to finish the in-flight save and write the current step.
TERMINATION_GRACE_SECONDS = 120


def jobset_name(name: str, attempt: int) -> str:
    """One JobSet per attempt: a restart never waits for the old pods' hostnames to be released."""
    return f"{name}-a{attempt}"


def coordinator_host(js_name: str) -> str:
    return f"{js_name}-{REPLICATED_JOB}-0-0.{js_name}"


def _env(name: str, value: str | int | float | bool) -> dict[str, str]:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return {"name": name, "value": text}


def _slice_index_env(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{JOB_INDEX_ANNOTATION}']"}},
    }


def trainer_env(tj: TrainingJob, attempt: int, resume_step: int | None, js_name: str) -> list[dict[str, Any]]:
    """The operator <-> trainer contract (trainer_image/README.md). Operator keys come after the
    user's env so a user entry cannot silently break the contract (the last duplicate wins)."""
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
        _env(env.NUM_SLICES, tj.spec.tpu.slices),
        _env(env.HOSTS_PER_SLICE, shape.hosts),
        _slice_index_env(env.SLICE_ID),
        _env(env.COORDINATOR_ADDRESS, f"{coordinator}:{COORDINATOR_PORT}"),
        _env(env.MEGASCALE_COORDINATOR_ADDRESS, coordinator),
        _env(env.MEGASCALE_NUM_SLICES, tj.spec.tpu.slices),
        _slice_index_env(env.MEGASCALE_SLICE_ID),
        _env(env.CHECKPOINT_POLICY, ckpt.policy),
        _env(env.CHECKPOINT_MIN_INTERVAL_SECONDS, ckpt.min_interval_seconds),
        _env(env.CHECKPOINT_INTERVAL_STEPS, ckpt.interval_steps or 0),
        _env(env.CHECKPOINT_ASYNC, ckpt.async_),
        _env(env.CHECKPOINT_KEEP_LATEST, ckpt.keep.latest),
        _env(env.CHECKPOINT_KEEP_EVERY_STEPS, ckpt.keep.every_steps or 0),
        _env(env.CHECKPOINT_SAVE_ON_PREEMPTION, ckpt.save_on_preemption),
    ]


def _resources(tj: TrainingJob, chips_per_host: int) -> dict[str, dict[str, int | str]]:
    user = tj.spec.resources
    requests = dict(user.requests or {}) if user else {}
    limits = dict(user.limits or {}) if user else {}
    requests[TPU_RESOURCE] = chips_per_host
    limits[TPU_RESOURCE] = chips_per_host
    return {"requests": requests, "limits": limits}


def owner_reference(tj: TrainingJob) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": tj.name,
        "uid": tj.metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def build_jobset(tj: TrainingJob, attempt: int, resume_step: int | None) -> dict[str, Any]:
    shape = slice_shape(tj.spec.tpu.accelerator, tj.spec.tpu.topology)
    name = jobset_name(tj.name, attempt)
    labels = {
        LABEL_NAME: tj.name,
        LABEL_ATTEMPT: str(attempt),
        LABEL_UID: str(tj.metadata["uid"]),
        "app.kubernetes.io/managed-by": "tpujob",
    }
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": tj.spec.image,
        "env": trainer_env(tj, attempt, resume_step, name),
        "ports": [{"name": "coordinator", "containerPort": COORDINATOR_PORT}],
        "resources": _resources(tj, shape.chips_per_host),
    }
    if tj.spec.command:
        container["command"] = list(tj.spec.command)
    if tj.spec.args:
        container["args"] = list(tj.spec.args)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "nodeSelector": {ACCELERATOR_LABEL: shape.accelerator, TOPOLOGY_LABEL: shape.topology},
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
    }
    if tj.spec.service_account_name:
        pod_spec["serviceAccountName"] = tj.spec.service_account_name
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": tj.namespace,
            "labels": labels,
            "annotations": {
                EXCLUSIVE_TOPOLOGY: NODE_POOL_LABEL,
                ANNOTATION_RESUME_STEP: str(-1 if resume_step is None else resume_step),
                ANNOTATION_SUSPENDED: str(tj.spec.suspend).lower(),
            },
            "ownerReferences": [owner_reference(tj)],
        },
        "spec": {
            # The operator, not JobSet, restarts: a restart must pin the latest committed step
            # (found in GCS) into the workers' env and be classified and accounted for in status.
            "failurePolicy": {"maxRestarts": 0},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "suspend": tj.spec.suspend,
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": tj.spec.tpu.slices,
                    "template": {
                        "metadata": {"labels": dict(labels)},
                        "spec": {
                            "parallelism": shape.hosts,
                            "completions": shape.hosts,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                        },
                    },
                }
            ],
        },
    }
