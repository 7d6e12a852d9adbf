"""The project's trainer (spec.framework: tpujob, the default), as a Framework (frameworks/__init__.py).

It needs nothing beyond the contract: the contract's env, which every worker gets whatever its
framework (jobset.trainer_env), and the user's args as they are. It writes the progress record
(contract.ProgressRecord), which the storage reads fetch with the checkpoint listing
(checkpoints.refresh_progress): there is nothing more to read. It honours every spec the schema admits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tpujob_contract as contract
from pydantic import JsonValue
from tpujob_contract import DEFAULT_STEPS, STEPS_ENV

if TYPE_CHECKING:  # api.py imports this package (admission.py): its types only
    from google.cloud import storage

    from ..api import TrainingJob
    from ..facts import JobSetFacts

NAME = "tpujob"
_STEPS_FLAG = "--steps"


def final_step(tj: TrainingJob) -> int | None:
    """The trainer's --steps (argparse: the last one wins, `--steps N` or `--steps=N`, an unambiguous
    prefix too), else TPUJOB_STEPS in spec.env, else its default. None when the spec does not say."""
    args, value = list(tj.spec.args or []), None
    env = {e.name: e for e in tj.spec.env or []}
    if STEPS_ENV in env:
        value = env[STEPS_ENV].value  # None: from a source the operator cannot read
        if value is None:
            return None
    for i, arg in enumerate(args):
        flag, equals, inline = arg.partition("=")
        if len(flag) >= 4 and _STEPS_FLAG.startswith(flag):
            value = inline if equals else (args[i + 1] if i + 1 < len(args) else None)
    try:
        return int(value) if value is not None else DEFAULT_STEPS
    except ValueError:
        return None


class Tpujob:
    name = NAME
    progress_from_listing = False  # it writes a progress record
    slice_index_env: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ("tpujob-train",)  # trainer_image/Dockerfile
    cel_rules: Sequence[JsonValue] = ()

    def refusals(self, spec: Any) -> list[str]:
        return []

    def args(self, tj: TrainingJob) -> list[str]:
        return list(tj.spec.args or [])

    def env(self, tj: TrainingJob, coordinator: str, hosts_per_slice: int) -> list[dict[str, Any]]:
        return []

    def final_step(self, tj: TrainingJob) -> int | None:
        return final_step(tj)

    def read_progress(
        self, client: storage.Client, tj: TrainingJob, latest: int | None, jobsets: Sequence[JobSetFacts]
    ) -> contract.ProgressRecord | None:
        return None  # its record came with the storage reads


ADAPTER = Tpujob()
