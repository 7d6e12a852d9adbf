"""The benchmarks' bandwidth cap: a token bucket that makes a sender wait for what it takes beyond its savings."""

import pytest
from tpujob_devcluster.throttle import BURST_SECONDS, TokenBucket


def test_bucket_makes_a_sender_wait_for_what_it_takes_beyond_its_savings() -> None:
    bucket = TokenBucket(rate=1000.0, stamp=0.0)
    assert bucket.reserve(500, now=0.0) == pytest.approx(0.5)  # nothing saved: 500 B at 1000 B/s
    assert bucket.reserve(500, now=0.0) == pytest.approx(1.0)  # queued behind the first
    # An idle hour saves no more than the burst: the next send waits for all but that.
    assert bucket.reserve(1000, now=3600.0) == pytest.approx(1.0 - BURST_SECONDS)
