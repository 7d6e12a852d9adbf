"""The job's mean time between failures, as the adaptive checkpoint policy's Young/Daly bound needs it (pure).

The estimate is the posterior mean of a Gamma-Poisson model: failures arrive at an unknown rate, and
the prior is worth one failure per PRIOR_MTBF_SECONDS of exposure. So a young job gets the prior,
and each observed failure and each hour of running moves the estimate towards the observed rate:

    MTBF = (exposure + PRIOR_MTBF_SECONDS) / (failures + 1)

Six hours is the prior because interruptions of large accelerator jobs are reported every few hours
(hardware, maintenance, preemption) and of small ones far less often; a prior that is too long only
makes a young job's interval longer, which the overhead budget still bounds from below, and a few
failures outweigh it. Exposure is the time the job's pods held their nodes (the ledger's wall time
without scheduling and suspension): failures come from running hardware, not from waiting for it (or in a queue).
"""

from __future__ import annotations

from .api import TrainingJobStatus

PRIOR_MTBF_SECONDS = 6 * 3600.0


def exposure_seconds(status: TrainingJobStatus) -> float:
    """Seconds the job's pods held nodes so far (goodput ledger: wall - scheduling - queued - suspended)."""
    ledger = status.goodput
    if ledger is None:
        return 0.0
    badput = ledger.badput
    waiting = badput.scheduling_seconds + badput.queued_seconds + badput.suspended_seconds
    return max(0.0, ledger.wall_seconds - waiting)


def mtbf_estimate(failures: int, exposure: float, prior_seconds: float = PRIOR_MTBF_SECONDS) -> float:
    """Posterior mean time between failures: (exposure + prior) / (failures + 1)."""
    return (max(0.0, exposure) + prior_seconds) / (max(0, failures) + 1)


def job_mtbf(status: TrainingJobStatus) -> float:
    """The estimate handed to the job's next attempt: every restart was an interruption."""
    return mtbf_estimate(status.restarts, exposure_seconds(status))
