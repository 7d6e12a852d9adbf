"""Fixtures for the trainer tests: one real fake-gcs-server per session, and real trainer processes.

The emulator's environment is passed to the trainer subprocesses only; this test process never
talks to gs:// itself except through the server's small HTTP helpers (list/upload/download).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from tpujob_devcluster.fakegcs import FakeGcsServer, start_fake_gcs

from tests.conftest import TEST_JAX_ENV
from tests.trainer.faults import FaultProxy, RestartableGcs
from tests.trainer.procs import BUCKET, NAMESPACE, Job


@pytest.fixture(scope="session")
def gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcsServer]:
    server = start_fake_gcs(tmp_path_factory.mktemp("trainer-gcs") / "data")
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def trainer_env(gcs: FakeGcsServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment of every trainer process: CPU JAX, the emulator, a shared compilation cache."""
    cache = tmp_path_factory.mktemp("jax-cache")
    return {
        **os.environ,
        **gcs.env(),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        # Every test starts fresh processes; the persistent cache saves recompiling the same step.
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "PYTHONUNBUFFERED": "1",
        "TPUJOB_PROGRESS_INTERVAL_SECONDS": "0.5",
        "TPUJOB_STORAGE_TIMEOUT_SECONDS": "10",
        "TPUJOB_STORAGE_WAIT_SECONDS": "120",  # tests that need storage to fail set less
        "TPUJOB_LOG_EVERY": "1",
        **TEST_JAX_ENV,
    }


@pytest.fixture(autouse=True)
def _forget_runs(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test's runs leave the session's emulator once it ends (FakeGcsServer.forget): its listings walk
    the whole bucket, so runs left behind made every later test's saves and listings dearer."""
    yield
    if "gcs" in request.fixturenames:
        server: FakeGcsServer = request.getfixturevalue("gcs")
        server.forget(BUCKET, NAMESPACE)


@pytest.fixture
def run_name() -> str:
    return f"job-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def job(gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str) -> Iterator[Job]:
    """A fresh run directory gs://BUCKET/tests/<name>; processes still running at teardown are killed."""
    job = Job(gcs=gcs, base_env=trainer_env, log_dir=tmp_path, name=run_name)
    try:
        yield job
    finally:
        job.kill_all()


@pytest.fixture
def faulty_gcs(tmp_path: Path) -> Iterator[RestartableGcs]:
    """An emulator of this test's own, to stop, restart and hang without disturbing the others."""
    server = RestartableGcs.launch(tmp_path / "gcs-data")
    try:
        server.create_bucket(BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def faulty_job(faulty_gcs: RestartableGcs, trainer_env: dict[str, str], tmp_path: Path, run_name: str) -> Iterator[Job]:
    """Like `job`, on the faulty_gcs emulator."""
    job = Job(gcs=faulty_gcs, base_env={**trainer_env, **faulty_gcs.env()}, log_dir=tmp_path, name=run_name)
    try:
        yield job
    finally:
        job.kill_all()


@pytest.fixture
def proxy(gcs: FakeGcsServer) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the session's emulator (healthy until the test says otherwise)."""
    server = FaultProxy(gcs)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def proxied_job(proxy: FaultProxy, trainer_env: dict[str, str], tmp_path: Path, run_name: str) -> Iterator[Job]:
    """Like `job`, the trainer reaching storage through `proxy` (the test reads the emulator directly)."""
    job = Job(gcs=proxy.upstream, base_env={**trainer_env, **proxy.env()}, log_dir=tmp_path, name=run_name)
    try:
        yield job
    finally:
        job.kill_all()
