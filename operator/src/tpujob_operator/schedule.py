"""Per-job due times: each live job is re-examined when something happens to it or when its own next
check is due, never twice at once. Replaces a sweep over every job.

Two lanes. News (a watch event: a pod failed, a JobSet changed, a spec edit; any `request` from
outside) may use every slot; the job's own next checks (the delay a run returns: mostly progress
checks that read storage) only `limit` of them. The `news_limit` slots beyond are kept for news and
news is taken first, so a failure is never queued behind checks waiting for a slow bucket. A
job's run tells which lane it is in (`lane`), so that its storage reads wait accordingly.

`work(key)` returns the delay of the job's next check (None: nothing is due, e.g. the job ended).
A request for a job that is running is remembered and run right after it (coalescing a burst of
events into one more run); a request never delays a check that is due sooner.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Literal

log = logging.getLogger("tpujob")
JobKey = tuple[str, str]  # (namespace, name)
Lane = Literal["news", "checks"]
# A run that raised is retried after this long (the API or storage may be back by then).
RETRY_SECONDS = 10.0
# Slots only news may take (beyond `limit`, which checks and news share).
NEWS_SLOTS = 4


class Schedule:
    def __init__(
        self, work: Callable[[JobKey], Awaitable[float | None]], limit: int = 8, news_limit: int = NEWS_SLOTS
    ) -> None:
        self.work = work
        self.limit = limit  # runs at once of the jobs' own checks
        self.news_limit = news_limit  # more slots for news only
        self.due: dict[JobKey, asyncio.TimerHandle] = {}
        self.news: set[JobKey] = set()  # its next run is for news (taken first, may use every slot)
        self.running: dict[JobKey, Lane] = {}  # the lane of each job's run in progress
        self.again: set[JobKey] = set()
        self._ready: dict[Lane, deque[JobKey]] = {"news": deque(), "checks": deque()}
        self._waiting: dict[JobKey, asyncio.Future[Lane]] = {}  # due, waiting for a slot
        self._busy = 0  # slots taken (runs in progress)
        self._busy_checks = 0  # of which by checks
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    @property
    def slots(self) -> int:
        """Runs at most at once (the threads a runtime needs for them)."""
        return self.limit + self.news_limit

    def lane(self, key: JobKey) -> Lane:
        """The lane of the job's run in progress (read by the run itself, from its thread)."""
        return self.running.get(key, "checks")

    def request(self, key: JobKey, delay: float = 0.0) -> None:
        """News of `key`: run it in `delay` seconds (unless it is already due sooner), in the news lane."""
        checks = self._ready["checks"]
        if delay <= 0 and key in self._waiting and key in checks:  # a check waiting for a slot: it is news now
            checks.remove(key)
            self._ready["news"].append(key)
            self._dispatch()
            return
        self.news.add(key)
        self._due(key, delay)

    def _due(self, key: JobKey, delay: float) -> None:
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay)
        pending = self.due.get(key)
        if pending is not None:
            if pending.when() <= when:
                return
            pending.cancel()
        # In an empty context, not the caller's: a kopf handler's holds its event (kopf's cause_var: the
        # whole object, its patch and loggers), which the pending check and every run after it kept alive.
        self.due[key] = loop.call_at(when, self._fire, key, context=contextvars.Context())

    def cancel(self, key: JobKey) -> None:
        """Nothing more is due for `key` (a run in progress finishes)."""
        pending = self.due.pop(key, None)
        if pending is not None:
            pending.cancel()
        self.again.discard(key)
        self.news.discard(key)

    def pending(self) -> int:
        return len(self.due) + len(self.running)

    def _fire(self, key: JobKey) -> None:
        self.due.pop(key, None)
        if key in self.running:
            self.again.add(key)
            return
        self.running[key] = "checks"
        task = asyncio.ensure_future(self._run(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _slot(self, key: JobKey) -> Lane:
        """Wait for a slot: news first, into any slot; checks only into the first `limit`."""
        lane: Lane = "news" if key in self.news else "checks"
        self.news.discard(key)
        waiter: asyncio.Future[Lane] = asyncio.get_running_loop().create_future()
        self._waiting[key] = waiter
        self._ready[lane].append(key)
        self._dispatch()
        try:
            return await waiter
        finally:
            self._waiting.pop(key, None)

    def _dispatch(self) -> None:
        news, checks = self._ready["news"], self._ready["checks"]
        while self._busy < self.slots and news:
            self._start(news.popleft(), "news")
        while self._busy < self.slots and self._busy_checks < self.limit and checks:
            self._start(checks.popleft(), "checks")

    def _start(self, key: JobKey, lane: Lane) -> None:
        waiter = self._waiting.get(key)
        if waiter is None or waiter.done():  # its task was cancelled while it waited
            return
        self._busy += 1
        self._busy_checks += lane == "checks"
        waiter.set_result(lane)

    def _free(self, lane: Lane) -> None:
        self._busy -= 1
        self._busy_checks -= lane == "checks"
        self._dispatch()

    async def _run(self, key: JobKey) -> None:
        try:
            while True:
                self.again.discard(key)
                lane = self.running[key] = await self._slot(key)
                try:
                    delay = await self.work(key)
                except Exception:  # one job's trouble must not stop the others
                    log.exception("reconcile of %s/%s failed; retrying in %.0f s", *key, RETRY_SECONDS)
                    delay = RETRY_SECONDS
                finally:
                    self._free(lane)
                if delay is not None:
                    self._due(key, delay)  # the job's own next check
                if key not in self.again:
                    return
        finally:
            self.running.pop(key, None)
