"""The pod runner stands in for kubelet: the parts of kubelet's behaviour it copies, checked."""

from tpujob_devcluster.podrunner import expand_var_refs


def test_var_refs_in_args_expand_like_kubelet():
    env = {"POD_IP": "127.0.0.7", "PORT": "8080"}
    argv = ["--liveness=http://$(POD_IP):$(PORT)/healthz", "$(UNSET)", "$$(POD_IP)", "cost: $5"]
    assert expand_var_refs(argv, env) == [
        "--liveness=http://127.0.0.7:8080/healthz",
        "$(UNSET)",
        "$(POD_IP)",
        "cost: $5",
    ]
