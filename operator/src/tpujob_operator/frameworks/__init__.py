"""The trainers a TrainingJob can run (spec.framework), as adapters: what differs between them, and
nothing else. The contract's env, the JobSet, restarts, goodput and status are the same for every one.

A Framework says
- its image's entrypoint, the worker container's args, and the env it adds after the contract's (jobset.build_jobset);
- the step a run that trained to the end has committed last (reconcile: a completion is success);
- how its progress is read: the project's trainer writes a progress record, fetched with the run's
  other storage reads; MaxText writes none, its progress is derived from the checkpoint listing and
  what it leaves beside it (`progress_from_listing`, `read_progress`: the observation);
- what it refuses at admission: CEL rules in the CRD schema and their mirror for specs that reach
  the operator without the apiserver (declared in admission.py, which api.py imports).

Adapters: tpujob.py (the default) and maxtext.py. They take the spec types by TYPE_CHECKING import
only: api.py imports admission.py, which runs this package first (no import circle, even at run time).
A new framework: its adapter here, its name in api.TrainingJobSpec.framework, its rules in admission.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import tpujob_contract as contract
from pydantic import JsonValue

from . import maxtext, tpujob

if TYPE_CHECKING:
    from google.cloud import storage

    from ..api import TrainingJob
    from ..facts import JobSetFacts


class Framework(Protocol):
    name: str  # spec.framework
    # True: it writes no progress record, read_progress derives one (the run's storage reads fetch the
    # listing instead of the record); False: its record comes with those reads, read_progress adds nothing.
    progress_from_listing: bool
    slice_index_env: tuple[str, ...]  # env names the JobSet builder sets to the worker's slice index
    # Its image's ENTRYPOINT: what a wrapper (JobSet's in-place restart agent) runs when spec.command is unset.
    entrypoint: tuple[str, ...]
    cel_rules: Sequence[JsonValue]  # on spec; each tests spec.framework itself

    def refusals(self, spec: Any) -> list[str]:
        """cel_rules, for a spec of this framework that reaches the operator without the apiserver."""
        ...

    def args(self, tj: TrainingJob) -> list[str]:
        """The worker container's args ([]: the image's)."""
        ...

    def env(self, tj: TrainingJob, coordinator: str, hosts_per_slice: int) -> list[dict[str, Any]]:
        """What the worker's env adds after the contract's (coordinator: the host of process 0)."""
        ...

    def final_step(self, tj: TrainingJob) -> int | None:
        """The step a run that trained to the end commits last; None when the spec does not say."""
        ...

    def read_progress(
        self, client: storage.Client, tj: TrainingJob, latest: int | None, jobsets: Sequence[JobSetFacts]
    ) -> contract.ProgressRecord | None:
        """The current attempt's progress beyond the record (latest: the latest committed step).
        Raises checkpoints.StorageError."""
        ...


_ALL: tuple[Framework, ...] = (tpujob.ADAPTER, maxtext.ADAPTER)
ADAPTERS: Mapping[str, Framework] = MappingProxyType({a.name: a for a in _ALL})


def adapter(name: str) -> Framework:
    found = ADAPTERS.get(name)
    if found is None:
        raise ValueError(f"unknown framework {name!r} (known: {', '.join(ADAPTERS)})")
    return found


def for_job(tj: TrainingJob) -> Framework:
    return adapter(tj.spec.framework)
