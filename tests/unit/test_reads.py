"""Bounded storage reads (reads.py): a reconcile never waits long for a bucket that does not answer.

The bucket that does not answer is a read blocked on an Event (the blackholed GCS of the integration
test and the bench, here without the network)."""

import threading
import time

import pytest
from tpujob_operator.checkpoints import StorageError
from tpujob_operator.reads import BoundedReads, StorageSlow


def _timed(call):
    t0 = time.monotonic()
    try:
        return call(), time.monotonic() - t0
    except StorageError as error:
        return error, time.monotonic() - t0


def test_a_bucket_that_does_not_answer_costs_one_deadline_then_news_never_waits_and_checks_probe_once():
    reads = BoundedReads(news_seconds=0.2, check_seconds=0.5)
    hang = threading.Event()
    started: list[str] = []

    def blackholed(name):
        def read():
            started.append(name)
            hang.wait(5)
            return name

        return read

    first, waited = _timed(lambda: reads.read("b", "reading a", blackholed("a"), news=False))
    assert isinstance(first, StorageSlow) and 0.45 < waited < 1.0  # the check's deadline
    assert "gs://b is not answering" in str(first)
    news, waited = _timed(lambda: reads.read("b", "reading c", blackholed("c"), news=True))
    assert isinstance(news, StorageSlow) and waited < 0.05  # known slow: a failure's decision does not wait
    check, waited = _timed(lambda: reads.read("b", "reading d", blackholed("d"), news=False))
    assert isinstance(check, StorageSlow) and waited < 0.05  # the first read is still out: no second one
    assert started == ["a"]
    other, _ = _timed(lambda: reads.read("other", "reading e", lambda: "e", news=True))
    assert other == "e"  # another bucket is not slow
    hang.set()  # the bucket answers (late) again
    time.sleep(0.05)
    assert not reads.slow("b")
    assert reads.read("b", "reading f", lambda: "f", news=True) == "f"
    reads.close()


def test_news_waits_its_own_short_deadline_for_a_bucket_not_known_slow():
    reads = BoundedReads(news_seconds=0.2, check_seconds=5.0)
    hang = threading.Event()
    late, waited = _timed(lambda: reads.read("b", "reading a", lambda: hang.wait(5), news=True))
    assert isinstance(late, StorageSlow) and 0.15 < waited < 0.6
    assert reads.slow("b")
    hang.set()
    reads.close()


def test_an_answer_or_an_error_in_time_is_returned_as_is():
    reads = BoundedReads(news_seconds=0.5, check_seconds=0.5)
    assert reads.read("b", "reading a", lambda: 7, news=True) == 7

    def refused():
        raise StorageError("listing gs://b/x failed: 503")

    with pytest.raises(StorageError, match="503"):
        reads.read("b", "reading a", refused, news=False)
    assert not reads.slow("b")  # an error is an answer
    reads.close()
