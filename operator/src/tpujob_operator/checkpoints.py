"""GCS facts for one run: the latest *committed* checkpoint step and the trainer's progress record.

Only ever reads under the job's own run directory (<directory>/<namespace>/<name>/), so one job's
mistakes cannot touch another job's checkpoints.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime

import requests
from google.api_core import exceptions as gcs_errors
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from .facts import Progress, RestoreFailure

# Orbax on GCS has no atomic rename: it writes the step directory in place and marks it committed
# by writing this file last. A step directory without it is partial (a save cut short) and is skipped.
COMMIT_MARKER = "commit_success.txt"
PROGRESS_FILE = "progress.json"
_STEP_DIR = re.compile(r"^(\d+)/$")
# A reconcile must not block for minutes on an unreachable bucket: short per-call timeout and a
# bounded retry; failures become StorageError, reported in status, and the next poll tries again.
_TIMEOUT_SECONDS = 10
_RETRY = Retry(timeout=20)
_STORAGE_FAILURES = (gcs_errors.GoogleAPICallError, gcs_errors.RetryError, requests.RequestException)


class StorageError(RuntimeError):
    """GCS could not be read; the message says where and why."""


def split_gs_path(path: str) -> tuple[str, str]:
    if not path.startswith("gs://"):
        raise ValueError(f"not a gs:// path: {path!r}")
    bucket, _, prefix = path[len("gs://") :].partition("/")
    return bucket, prefix.strip("/")


def make_client() -> storage.Client:
    """Default credentials on GKE (Workload Identity); anonymous against the emulator."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return storage.Client(
            project=os.environ.get("GOOGLE_CLOUD_PROJECT", "test"), credentials=AnonymousCredentials()
        )
    return storage.Client()


def step_candidates(checkpoints_prefix: str, prefixes: list[str]) -> list[int]:
    """Step numbers of the directories directly under checkpoints/, newest first. Orbax's temporary
    directories (<step>.orbax-checkpoint-tmp-...) are not digits-only and drop out here."""
    relative = (p[len(checkpoints_prefix) :] for p in prefixes if p.startswith(checkpoints_prefix))
    return sorted((int(m.group(1)) for m in map(_STEP_DIR.match, relative) if m), reverse=True)


def latest_committed_step(client: storage.Client, run_dir: str) -> int | None:
    bucket_name, prefix = split_gs_path(run_dir)
    checkpoints = f"{prefix}/checkpoints/" if prefix else "checkpoints/"
    try:
        bucket = client.bucket(bucket_name)
        listing = client.list_blobs(bucket, prefix=checkpoints, delimiter="/", timeout=_TIMEOUT_SECONDS, retry=_RETRY)
        for _ in listing.pages:  # the prefixes are filled in while pages are consumed
            pass
        for step in step_candidates(checkpoints, list(listing.prefixes)):
            if bucket.blob(f"{checkpoints}{step}/{COMMIT_MARKER}").exists(timeout=_TIMEOUT_SECONDS, retry=_RETRY):
                return step
    except _STORAGE_FAILURES as error:
        raise StorageError(f"listing {run_dir}/checkpoints failed: {error}") from error
    return None


def parse_progress(raw: bytes) -> Progress:
    record = json.loads(raw)
    return Progress(
        step=int(record["step"]),
        attempt=int(record.get("attempt", 0)),
        updated_at=datetime.fromisoformat(str(record["updated_at"]).replace("Z", "+00:00")),
        loss=None if record.get("loss") is None else float(record["loss"]),
        steps_per_second=record.get("steps_per_second"),
        last_committed_step=record.get("last_committed_step"),
        resumed_from_step=record.get("resumed_from_step"),
        state=str(record.get("state", "running")),
        uid=record.get("uid") or None,
        restored_step=record.get("restored_step"),
        restore_failures=tuple(
            RestoreFailure(step=int(f["step"]), error=str(f.get("error", ""))[:200])
            for f in record.get("restore_failures") or []
        ),
    )


def read_progress(client: storage.Client, run_dir: str) -> Progress | None:
    bucket_name, prefix = split_gs_path(run_dir)
    blob = client.bucket(bucket_name).blob(f"{prefix}/{PROGRESS_FILE}" if prefix else PROGRESS_FILE)
    try:
        return parse_progress(blob.download_as_bytes(timeout=_TIMEOUT_SECONDS, retry=_RETRY))
    except gcs_errors.NotFound:
        return None
    except _STORAGE_FAILURES as error:
        raise StorageError(f"reading {run_dir}/{PROGRESS_FILE} failed: {error}") from error
    except (ValueError, KeyError) as error:
        raise StorageError(f"{run_dir}/{PROGRESS_FILE} is malformed: {error}") from error
