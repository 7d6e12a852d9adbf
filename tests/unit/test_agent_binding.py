"""The RoleBinding that gives an InPlace job's pods JobSet's in-place restart agent's rights: one per job
incarnation and account, owned by the job, and removed by label when the job ends (only an InPlace job's)."""

from __future__ import annotations

from typing import Any

from tpujob_operator.apply import Applier, agent_bindings_selector, agent_role_binding
from tpujob_operator.memory import JobMemory

from .factories import training_job

IN_PLACE = {"strategy": "InPlace"}


def test_each_job_incarnation_and_account_has_its_own_binding_owned_by_the_job():
    tj = training_job(restart=IN_PLACE)
    binding = agent_role_binding(tj, "tpujob-in-place-restart-agent")
    assert binding["metadata"]["name"].startswith("tpujob-agent-llama-")
    assert binding["metadata"]["ownerReferences"] == [
        {"apiVersion": "tpujob.dev/v1alpha1", "kind": "TrainingJob", "name": "llama", "uid": "0000-1111",
         "controller": True, "blockOwnerDeletion": True}
    ]  # fmt: skip
    assert binding["metadata"]["labels"]["tpujob.dev/uid"] == "0000-1111"
    assert binding["roleRef"]["name"] == "tpujob-in-place-restart-agent"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "default", "namespace": "ml"}]
    successor = training_job(restart=IN_PLACE)
    successor.metadata["uid"] = "2222-3333"
    other_account = training_job(restart=IN_PLACE, serviceAccountName="trainer")
    names = {agent_role_binding(t, "r")["metadata"]["name"] for t in (tj, successor, other_account)}
    assert len(names) == 3
    assert agent_bindings_selector("0000-1111") == "app.kubernetes.io/managed-by=tpujob,tpujob.dev/uid=0000-1111"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def ensure_role_binding(self, namespace: str, binding: dict[str, Any]) -> None:
        self.calls.append(("bind", namespace, binding["metadata"]["name"]))

    def delete_role_bindings(self, namespace: str, selector: str) -> None:
        self.calls.append(("unbind", namespace, selector))


def test_an_ended_in_place_job_loses_its_bindings_and_a_recreate_job_costs_no_call():
    kube = Recorder()
    applier = Applier(lambda: kube, on_gone=lambda: None)  # type: ignore[arg-type,return-value]
    applier.unbind_agent(training_job())
    assert kube.calls == []
    applier.unbind_agent(training_job(restart=IN_PLACE))
    assert kube.calls == [("unbind", "ml", agent_bindings_selector("0000-1111"))]
    assert applier._agent_may_run(JobMemory(), training_job(restart=IN_PLACE))
    assert kube.calls[-1][0] == "bind"
