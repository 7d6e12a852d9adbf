"""Worker pods under the `restricted` Pod Security standard: the demo-style job (2 slices x 2 hosts)
trains, loses a worker, restarts and succeeds in a namespace that enforces it.

The check of the pod spec is the apiserver's PodSecurity admission (on by default in kube-apiserver):
the Job controller's pod creations would be refused otherwise. The pod runner does not apply the
securityContext to its processes (they run as the runner's user); it does honour
automountServiceAccountToken: no token is mounted.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import pytest
from kubernetes import client
from tpujob_devcluster.cluster import DevCluster

from .conftest import E2E

RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


@pytest.fixture
def restricted(devcluster: DevCluster, unique_name: str) -> Iterator[E2E]:
    view = E2E(devcluster, unique_name)
    view.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=unique_name, labels=RESTRICTED)))
    deadline = time.monotonic() + 30
    while not view.core.list_namespaced_service_account(unique_name).items and time.monotonic() < deadline:
        time.sleep(0.2)
    yield view
    view.core.delete_namespace(unique_name)


def test_demo_job_trains_fails_restarts_and_succeeds_in_a_restricted_namespace(restricted):
    e2e = restricted
    # The namespace really enforces `restricted`: a pod without the security context is refused.
    bare = client.V1Pod(
        metadata=client.V1ObjectMeta(name="bare"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="tpujob-trainer:dev")]),
    )
    with pytest.raises(client.ApiException) as refused:
        e2e.core.create_namespaced_pod(e2e.namespace, bare, dry_run="All")
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 403 and 'violates PodSecurity "restricted:latest"' in message

    e2e.apply("demo", 1500)  # 2 slices x 2 hosts (v5p 2x2x2), as examples/demo.yaml
    e2e.wait("demo", lambda s: s.get("latestCheckpoint") and (s.get("step") or 0) > 0, 300, "a checkpoint")
    pods = e2e.pods("tpujob.dev/name=demo")
    assert len(pods) == 4
    for pod in pods:
        assert pod.spec.automount_service_account_token is False
        assert pod.spec.security_context.run_as_non_root is True
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        [container] = pod.spec.containers
        assert container.security_context.allow_privilege_escalation is False
        assert container.security_context.capabilities.drop == ["ALL"]
    assert not [d for d in e2e.pod_dirs("demo") if (d / "serviceaccount").exists()]  # no token mounted

    e2e.signal_pod(e2e.running_pod("demo-a0-slice-1-0"), signal.SIGKILL)
    status = e2e.wait("demo", lambda s: s.get("phase") == "Succeeded", 420, "Succeeded")
    assert status["restarts"] == 1 and status["lastFailure"]["reason"] == "ExitCode137"
    assert status["resumedFromStep"] >= 1 and status["step"] == 1500
    # No pod of either attempt was refused by PodSecurity admission. (JobSet's exclusive-placement
    # webhook refusing a follower pod until its leader is scheduled is normal, and retried.)
    assert "JobSetRefused" not in e2e.events("demo")
    refusals = e2e.core.list_namespaced_event(e2e.namespace, field_selector="reason=FailedCreate").items
    assert not [e.message for e in refusals if "PodSecurity" in (e.message or "")]
