"""The pod runner stands in for kubelet: the parts of kubelet's behaviour it copies, checked."""

from pathlib import Path

import pytest
import tpujob_contract as contract
from tpujob_devcluster.podrunner import container_env, expand_var_refs, process_compile_cache
from tpujob_operator.jobset import build_jobset
from tpujob_trainer.config import parse_config

from .factories import training_job


def test_var_refs_in_args_expand_like_kubelet():
    env = {"POD_IP": "127.0.0.7", "PORT": "8080"}
    argv = ["--liveness=http://$(POD_IP):$(PORT)/healthz", "$(UNSET)", "$$(POD_IP)", "cost: $5"]
    assert expand_var_refs(argv, env) == [
        "--liveness=http://127.0.0.7:8080/healthz",
        "$(UNSET)",
        "$(POD_IP)",
        "cost: $5",
    ]


@pytest.mark.parametrize(("slices", "restart"), [(2, "Recreate"), (1, "Recreate"), (2, "InPlace")])
def test_the_stand_in_for_a_slices_shared_compilation_cache_is_one_folder_per_jax_process(slices, restart):
    """Each pod of a several-process job gets the folder of the JAX process it is (the trainer's own
    parse of the operator's env is the truth); an InPlace job's pods keep the volume the operator gave
    them; a one-process job gets none (its shared tier works on CPU)."""
    tj = training_job(accelerator="tpu-v5-lite-podslice", topology="2x2", slices=slices, restart={"strategy": restart})
    template = build_jobset(tj, attempt=0, resume_step=None)["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"
    ]
    folders, env = {}, {}
    for slice_index in range(slices):
        annotations = {contract.JOB_INDEX_ANNOTATION: str(slice_index), "jobset.sigs.k8s.io/jobset-name": "llama-a0"}
        pod = {**template, "metadata": {**template["metadata"], "name": f"p{slice_index}", "annotations": annotations}}
        env = container_env(pod, template["spec"]["containers"][0], {"JOB_COMPLETION_INDEX": "0"})
        process = parse_config([], env).topology.process_id
        folders[process] = process_compile_cache(env, Path("/cache")).get(contract.Env.LOCAL_COMPILATION_CACHE_DIR)
    if restart == "InPlace":
        assert folders == {p: None for p in range(slices)}
        assert env[contract.Env.LOCAL_COMPILATION_CACHE_DIR] == contract.LOCAL_COMPILATION_CACHE_MOUNT
    elif slices == 1:
        assert folders == {0: None}
    else:
        assert folders == {0: "/cache/process0", 1: "/cache/process1"}
