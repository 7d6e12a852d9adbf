"""Storage reads that a reconcile waits for only so long.

A GCS brownout makes a read take 10-30 s (the client's own timeouts and retries, checkpoints.py); a
reconcile that waited for it would hold one of the few reconcile slots (schedule.py) all that time,
and a failure's reconcile would queue behind them. Each read runs in a thread of its own; the
reconcile waits at most its deadline, then goes on with storage unknown (`StorageSlow`, a
StorageError: reconcile decides without storage, as in an outage). A bucket whose read timed out is
known slow until one of its reads answers again: meanwhile news (a failure to react to) never waits
for it, and progress checks probe it one read at a time (the others do not wait either), so an outage
costs a slot no more than one read at a time. A read that timed out finishes in its thread; its answer
is not used (the next reconcile reads again), but it tells whether the bucket answers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

from .checkpoints import StorageError

T = TypeVar("T")
# How long a reconcile waits for a read: news (a failure to react to) briefly, a progress check longer.
NEWS_READ_SECONDS = 1.0
CHECK_READ_SECONDS = 5.0
# Reads in flight at once; beyond, a read waits for a thread (within its deadline).
READ_THREADS = 16


class StorageSlow(StorageError):
    """Storage did not answer within the reconcile's deadline (or is known not to answer)."""


class BoundedReads:
    def __init__(
        self,
        threads: int = READ_THREADS,
        news_seconds: float = NEWS_READ_SECONDS,
        check_seconds: float = CHECK_READ_SECONDS,
    ) -> None:
        self._threads = threads
        self.news_seconds, self.check_seconds = news_seconds, check_seconds
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._slow: dict[str, Future[object]] = {}  # per bucket: its last read that timed out

    def read(self, bucket: str, what: str, fn: Callable[[], T], *, news: bool) -> T:
        """`fn()`, a read in `bucket`, or StorageSlow; raises what `fn` raises. `what` names the read."""
        slow = StorageSlow(f"{what}: gs://{bucket} is not answering (no answer within {self.check_seconds:g} s)")
        with self._lock:
            probing = not self._answers(bucket)
            if probing and (news or not self._slow[bucket].done()):
                raise slow  # news never waits for a slow bucket; checks probe it one read at a time
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="storage")
            future: Future[object] = self._pool.submit(fn)
            if probing:
                self._slow[bucket] = future  # the probe: no other read of the bucket until it answers
        try:
            result = future.result(timeout=self.news_seconds if news else self.check_seconds)
        except FutureTimeout:
            future.cancel()  # not started yet (every thread busy): it never will
            with self._lock:
                self._slow[bucket] = future
            raise slow from None
        except BaseException:
            self._answered(bucket)  # an error, but an answer
            raise
        self._answered(bucket)
        return result  # type: ignore[return-value]  # the future of fn()

    def slow(self, bucket: str) -> bool:
        with self._lock:
            return not self._answers(bucket)

    def _answers(self, bucket: str) -> bool:
        """Whether the bucket is not known slow: no read timed out, or the last one that did answered
        late (without an error of its own). Called with the lock held."""
        last = self._slow.get(bucket)
        if last is None:
            return True
        if last.done() and not last.cancelled() and last.exception() is None:
            del self._slow[bucket]
            return True
        return False

    def _answered(self, bucket: str) -> None:
        with self._lock:
            self._slow.pop(bucket, None)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
