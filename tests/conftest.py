"""Session fixtures shared by the test tiers: the real control plane and the real GCS emulator."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.nodeid import NodeId
from kubernetes.config import kube_config
from tpujob_devcluster.controlplane import ControlPlane, build_binaries
from tpujob_devcluster.fakegcs import FakeGcsServer, start_fake_gcs

REPO = Path(__file__).resolve().parents[1]
TEST_BUCKET = "tpujob-tests"
TIERS = ("unit", "sim", "trainer", "integration", "e2e")
# Every trainer process of the trainer tier compiles without XLA's expensive passes: those runs are short
# and spend most of their time compiling, and a test compares runs made under the same settings. A run
# long in steps sets "0" (its steps are about half as fast without them). The e2e tier's jobs are long in
# steps and keep XLA's defaults, as do the benchmarks and `make demo`.
TEST_JAX_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test carries its tier's marker, the folder it is in (`-m "not e2e"`). The e2e tier shares one
    devcluster, so pytest-xdist hands all of it to one worker (`--dist loadgroup`)."""
    for item in items:
        tier = item.path.relative_to(REPO / "tests").parts[0]
        if tier in TIERS:
            item.add_marker(tier)
        if tier == "e2e" and config.getoption("loadgroup", default=False) and "@" not in item.nodeid:
            # pytest-xdist 3.8 groups by a suffix of the node id, which it writes where pytest 9 no longer
            # reads it (`_nodeid`): the suffix is written here, where pytest keeps the id.
            item._id = NodeId.parse(f"{item.nodeid}@devcluster")  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver + kube-controller-manager with the JobSet and TrainingJob CRDs."""
    bin_dir = build_binaries("etcd kube-apiserver kube-controller-manager")
    plane = ControlPlane(workdir=tmp_path_factory.mktemp("control-plane"), bin_dir=bin_dir).start()
    try:
        plane.apply_crd(bin_dir / "jobset-crd.yaml")
        plane.apply_crd(REPO / "crds" / "trainingjob.yaml")
        os.environ["KUBECONFIG"] = str(plane.kubeconfig)
        # The kubernetes client reads KUBECONFIG once, at import; the in-process operator needs this one.
        kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(plane.kubeconfig)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def fake_gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGcsServer]:
    server = start_fake_gcs(tmp_path_factory.mktemp("gcs") / "data")
    server.create_bucket(TEST_BUCKET)
    previous = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def unique_name() -> str:
    return f"t{uuid.uuid4().hex[:8]}"
