"""The failure-rate estimate the operator hands to adaptive checkpointing (Young/Daly's MTBF)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tpujob_operator.api import TrainingJobStatus
from tpujob_operator.cadence import PRIOR_MTBF_SECONDS, exposure_seconds, job_mtbf, mtbf_estimate


def test_a_young_job_gets_the_prior():
    assert mtbf_estimate(failures=0, exposure=0) == PRIOR_MTBF_SECONDS
    assert job_mtbf(TrainingJobStatus()) == PRIOR_MTBF_SECONDS


def test_many_failures_converge_on_the_observed_rate():
    # 50 failures in 100 hours: the observed MTBF is 2 h; the prior's one failure moves it a little.
    hours = 3600.0
    estimate = mtbf_estimate(failures=50, exposure=100 * hours)
    assert estimate == pytest.approx((100 + 6) * hours / 51)
    assert abs(estimate - 2 * hours) / (2 * hours) < 0.05


@given(st.integers(0, 1000), st.floats(0, 1e8), st.floats(1, 1e6))
def test_more_failures_shorten_it_and_more_quiet_time_lengthens_it(failures: int, exposure: float, more: float):
    estimate = mtbf_estimate(failures, exposure)
    assert mtbf_estimate(failures + 1, exposure) < estimate
    assert mtbf_estimate(failures, exposure + more) > estimate


def test_exposure_is_time_on_nodes_not_waiting_for_them():
    status = TrainingJobStatus.model_validate(
        {
            "restarts": 2,
            "goodput": {
                "wallSeconds": 5000,
                "productiveSeconds": 3000,
                "badput": {
                    "schedulingSeconds": 1200,
                    "suspendedSeconds": 400,
                    "queuedSeconds": 100,
                    "startupSeconds": 300,
                },
            },
        }
    )
    assert exposure_seconds(status) == 5000 - 1200 - 400 - 100
    assert job_mtbf(status) == pytest.approx((3300 + PRIOR_MTBF_SECONDS) / 3)
