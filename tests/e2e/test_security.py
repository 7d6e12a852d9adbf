"""Worker pods under the `restricted` Pod Security standard.

Every e2e namespace enforces `restricted` (conftest.make_namespace), so the demo-style job of
test_loop.py (2 slices x 2 hosts, a SIGKILLed worker, its restart) and every fault-matrix scenario
run under it. This test shows the enforcement is real (a pod without the security context is
refused) and what the worker pods carry.

The check of the pod spec is the apiserver's PodSecurity admission (on by default in kube-apiserver):
the Job controller's pod creations would be refused otherwise. The pod runner does not apply the
securityContext to its processes (they run as the runner's user); it does honour
automountServiceAccountToken: no token is mounted.
"""

from __future__ import annotations

import json

import pytest
from kubernetes import client

V5E = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x2", "slices": 1}


def test_workers_pass_restricted_pod_security_and_get_no_token(e2e):
    namespace = e2e.core.read_namespace(e2e.namespace)
    assert namespace.metadata.labels["pod-security.kubernetes.io/enforce"] == "restricted"
    bare = client.V1Pod(
        metadata=client.V1ObjectMeta(name="bare"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="c", image="tpujob-trainer:dev")]),
    )
    with pytest.raises(client.ApiException) as refused:
        e2e.core.create_namespaced_pod(e2e.namespace, bare, dry_run="All")
    message = json.loads(refused.value.body)["message"]
    assert refused.value.status == 403 and 'violates PodSecurity "restricted:latest"' in message

    e2e.apply("secure", 200, **V5E)
    status = e2e.wait("secure", lambda s: s.get("phase") == "Succeeded", 300, "Succeeded")
    assert status["restarts"] == 0, status
    [pod] = e2e.pods("tpujob.dev/name=secure")
    assert pod.spec.automount_service_account_token is False
    assert pod.spec.security_context.run_as_non_root is True
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    [container] = pod.spec.containers
    assert container.security_context.allow_privilege_escalation is False
    assert container.security_context.capabilities.drop == ["ALL"]
    assert not [d for d in e2e.pod_dirs("secure") if (d / "serviceaccount").exists()]  # no token mounted
    refusals = e2e.core.list_namespaced_event(e2e.namespace, field_selector="reason=FailedCreate").items
    assert not [e.message for e in refusals if "PodSecurity" in (e.message or "")]
