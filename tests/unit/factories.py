"""Small builders of TrainingJob objects for the pure-function tests."""

from __future__ import annotations

from typing import Any

from tpujob_operator.api import TrainingJob


def training_job(
    name: str = "llama",
    accelerator: str = "tpu-v5p-slice",
    topology: str = "2x2x2",
    slices: int = 2,
    status: dict[str, Any] | None = None,
    **spec: Any,
) -> TrainingJob:
    body: dict[str, Any] = {
        "apiVersion": "tpujob.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "ml", "uid": "0000-1111", "generation": 1},
        "spec": {
            "image": "us-docker.pkg.dev/acme/tpujob-trainer:0.1.0",
            "args": ["--model", "tiny"],
            "tpu": {"accelerator": accelerator, "topology": topology, "slices": slices},
            "checkpoint": {"directory": "gs://acme-ckpt/runs"},
            **spec,
        },
        "status": status or {},
    }
    return TrainingJob.model_validate(body)
