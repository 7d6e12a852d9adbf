"""GCS facts for one run: the latest *committed* checkpoint step and the trainer's progress record.

Only ever reads under the job's own run directory (<directory>/<namespace>/<name>/), so one job's
mistakes cannot touch another job's checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import requests
import tpujob_contract as contract
from google.api_core import exceptions as gcs_errors
from google.api_core.retry import Retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

# A step directory without the commit marker is partial (a save cut short) and is skipped.
COMMIT_MARKER = contract.COMMIT_MARKER
PROGRESS_FILE = contract.PROGRESS_FILE
# A reconcile must not block for minutes on an unreachable bucket: short per-call timeout and a
# bounded retry; failures become StorageError, reported in status, and the next poll tries again.
_TIMEOUT_SECONDS = 10
_RETRY = Retry(timeout=20)
_STORAGE_FAILURES = (gcs_errors.GoogleAPICallError, gcs_errors.RetryError, requests.RequestException)


class StorageError(RuntimeError):
    """GCS could not be read; the message says where and why."""


class StoragePermissionError(StorageError):
    """GCS refused the operator's own identity (401/403): a grant to fix, not an outage to wait out."""


_DENIED = (gcs_errors.Unauthorized, gcs_errors.Forbidden)


def storage_error(what: str, run_dir: str, error: Exception) -> StorageError:
    """The StorageError for a failed read: a refusal names the bucket and the grant it needs."""
    if isinstance(error, _DENIED):
        bucket, _ = split_gs_path(run_dir)
        return StoragePermissionError(
            f"{what}: permission denied ({error.code}): the operator's identity may not read gs://{bucket}; "
            f"grant its GCP service account roles/storage.objectViewer on gs://{bucket}"
        )
    return StorageError(f"{what} failed: {error}")


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
    """Step numbers of the directories directly under checkpoints/, newest first."""
    relative = (p[len(checkpoints_prefix) :] for p in prefixes if p.startswith(checkpoints_prefix))
    steps = (contract.step_of(r) for r in relative if r.count("/") == 1 and r.endswith("/"))
    return sorted((s for s in steps if s is not None), reverse=True)


def latest_committed_step(client: storage.Client, run_dir: str) -> int | None:
    bucket_name, prefix = split_gs_path(run_dir)
    checkpoints = f"{contract.checkpoints_dir(prefix)}/" if prefix else f"{contract.CHECKPOINTS_DIR}/"
    try:
        bucket = client.bucket(bucket_name)
        listing = client.list_blobs(bucket, prefix=checkpoints, delimiter="/", timeout=_TIMEOUT_SECONDS, retry=_RETRY)
        for _ in listing.pages:  # the prefixes are filled in while pages are consumed
            pass
        for step in step_candidates(checkpoints, list(listing.prefixes)):
            if bucket.blob(f"{checkpoints}{step}/{COMMIT_MARKER}").exists(timeout=_TIMEOUT_SECONDS, retry=_RETRY):
                return step
    except _STORAGE_FAILURES as error:
        raise storage_error(f"listing {contract.checkpoints_dir(run_dir)}", run_dir, error) from error
    return None


def read_progress(client: storage.Client, run_dir: str) -> contract.ProgressRecord | None:
    bucket_name, prefix = split_gs_path(run_dir)
    blob = client.bucket(bucket_name).blob(f"{prefix}/{PROGRESS_FILE}" if prefix else PROGRESS_FILE)
    try:
        return contract.from_json(blob.download_as_bytes(timeout=_TIMEOUT_SECONDS, retry=_RETRY))
    except gcs_errors.NotFound:
        return None
    except _STORAGE_FAILURES as error:
        raise storage_error(f"reading {run_dir}/{PROGRESS_FILE}", run_dir, error) from error
    except (ValueError, KeyError) as error:
        raise StorageError(f"{run_dir}/{PROGRESS_FILE} is malformed: {error}") from error


@dataclass(frozen=True)
class RunView:
    """What the operator last read of one run directory, kept between reconciles so that a read
    happens only when the work says something may have changed (see `handlers`)."""

    latest_committed_step: int | None = None
    listed: bool = False  # latest_committed_step comes from a listing (False: never listed yet)
    progress: contract.ProgressRecord | None = None
    progress_generation: int | None = None  # GCS generation of the record `progress` was parsed from
    error: str | None = None  # the last read failed: reported until a read succeeds
    denied: bool = False  # that failure was a refusal of the operator's identity (401/403)


def refresh_progress(client: storage.Client, run_dir: str, view: RunView) -> RunView:
    """Re-read the progress record if it changed: one conditional download (ifGenerationNotMatch: GCS
    answers 304 with no body when the generation is the one already parsed). Raises StorageError."""
    bucket_name, prefix = split_gs_path(run_dir)
    blob = client.bucket(bucket_name).blob(f"{prefix}/{PROGRESS_FILE}" if prefix else PROGRESS_FILE)
    known = view.progress_generation
    try:
        raw = blob.download_as_bytes(if_generation_not_match=known, timeout=_TIMEOUT_SECONDS, retry=_RETRY)
    except gcs_errors.NotModified:
        return replace(view, error=None)
    except gcs_errors.NotFound:
        return replace(view, progress=None, progress_generation=None, error=None)
    except _STORAGE_FAILURES as error:
        raise storage_error(f"reading {run_dir}/{PROGRESS_FILE}", run_dir, error) from error
    if known is not None and blob.generation == known:  # a server that ignores the condition
        return replace(view, error=None)
    try:
        return replace(view, progress=contract.from_json(raw), progress_generation=blob.generation, error=None)
    except (ValueError, KeyError) as error:
        raise StorageError(f"{run_dir}/{PROGRESS_FILE} is malformed: {error}") from error


def with_reported_commit(view: RunView, uid: str | None, attempt: int, listed_now: bool) -> RunView:
    """The trainer reports a step in `last_committed_step` only once it saw the step's commit marker:
    between listings, a newer one than the view's is shown as the latest committed step without
    listing the checkpoints. Only a record of this job (its uid) and of its current attempt counts, and
    never against a listing just made (`listed_now`): a decision lists, and its listing alone says
    which steps exist, so a stale or foreign record never pins a step."""
    progress = view.progress
    if listed_now or progress is None or progress.uid != (uid or "") or progress.attempt != attempt:
        return view
    reported = progress.last_committed_step
    if reported is None or (view.latest_committed_step is not None and reported <= view.latest_committed_step):
        return view
    return replace(view, latest_committed_step=reported)


def refresh_latest(client: storage.Client, run_dir: str, view: RunView) -> RunView:
    """List the checkpoints (one listing, one commit-marker check per step tried). Raises StorageError."""
    return replace(view, latest_committed_step=latest_committed_step(client, run_dir), listed=True, error=None)
