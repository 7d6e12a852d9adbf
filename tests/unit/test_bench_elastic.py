"""bench/elastic.py's pure parts: each job's own shape, and the loss window read off its goodput ledger."""

import pytest
from tpujob_operator import api

from . import benches

bench = benches.load("elastic")


def test_the_two_jobs_have_shapes_of_their_own_and_only_one_is_elastic():
    manifests = {job: bench._manifest(job, 100, 30) for job in bench.SHAPES}
    tpus = {job: (m["spec"]["tpu"]["accelerator"], m["spec"]["tpu"]["topology"]) for job, m in manifests.items()}
    assert len(set(tpus.values())) == 2
    assert manifests["elastic"]["spec"]["elastic"] == {"minSlices": 1, "shrinkAfterSeconds": 30, "growAfterSeconds": 30}
    assert "elastic" not in manifests["waiting"]["spec"]
    for manifest in manifests.values():  # what the apiserver would admit
        api.TrainingJob.model_validate(manifest)


def test_the_window_is_the_ledgers_difference_between_the_two_reads():
    before = {"step": 60, "goodput": {"productiveSeconds": 40.0, "wallSeconds": 100.0}}
    after = {"step": 2000, "slices": 1, "goodput": {"productiveSeconds": 115.0, "wallSeconds": 400.0}}
    window = bench._window(before, after)
    assert (window["productive_seconds"], window["wall_seconds"], window["steps"]) == (75.0, 300.0, 1940)
    assert window["goodput_ratio"] == pytest.approx(0.25) and window["slices_at_return"] == 1
    assert bench._window({}, {})["goodput_ratio"] is None
