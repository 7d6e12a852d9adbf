"""Small builders of TrainingJob objects and progress records for the pure-function tests."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import tpujob_contract as contract
from tpujob_operator.api import TrainingJob


def progress_record(**fields: Any) -> contract.ProgressRecord:
    """The trainer's record, its times given as the tests' datetimes (the record holds RFC 3339 strings)."""
    times = {name: contract.format_time(value) for name, value in fields.items() if isinstance(value, datetime)}
    return contract.ProgressRecord(**{**fields, **times})


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
