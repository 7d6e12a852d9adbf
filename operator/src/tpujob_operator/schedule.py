"""Per-job due times: each live job is re-examined when something happens to it or when its own next
check is due, never twice at once, at most `limit` jobs at once. Replaces a sweep over every job.

`work(key)` returns the delay of the job's next check (None: nothing is due, e.g. the job ended).
A request for a job that is running is remembered and run right after it (coalescing a burst of
events into one more run); a request never delays a check that is due sooner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger("tpujob")
JobKey = tuple[str, str]  # (namespace, name)
# A run that raised is retried after this long (the API or storage may be back by then).
RETRY_SECONDS = 10.0


class Schedule:
    def __init__(self, work: Callable[[JobKey], Awaitable[float | None]], limit: int = 8) -> None:
        self.work = work
        self.limit = limit
        self.due: dict[JobKey, asyncio.TimerHandle] = {}
        self.running: set[JobKey] = set()
        self.again: set[JobKey] = set()
        self._slots: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    def request(self, key: JobKey, delay: float = 0.0) -> None:
        """Run `key` in `delay` seconds, unless it is already due sooner."""
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay)
        pending = self.due.get(key)
        if pending is not None:
            if pending.when() <= when:
                return
            pending.cancel()
        self.due[key] = loop.call_at(when, self._fire, key)

    def cancel(self, key: JobKey) -> None:
        """Nothing more is due for `key` (a run in progress finishes)."""
        pending = self.due.pop(key, None)
        if pending is not None:
            pending.cancel()
        self.again.discard(key)

    def pending(self) -> int:
        return len(self.due) + len(self.running)

    def _fire(self, key: JobKey) -> None:
        self.due.pop(key, None)
        if key in self.running:
            self.again.add(key)
            return
        self.running.add(key)
        task = asyncio.ensure_future(self._run(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: JobKey) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        try:
            while True:
                self.again.discard(key)
                async with self._slots:
                    try:
                        delay = await self.work(key)
                    except Exception:  # one job's trouble must not stop the others
                        log.exception("reconcile of %s/%s failed; retrying in %.0f s", *key, RETRY_SECONDS)
                        delay = RETRY_SECONDS
                if delay is not None:
                    self.request(key, delay)
                if key not in self.again:
                    return
        finally:
            self.running.discard(key)
