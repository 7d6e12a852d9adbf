"""The per-job schedule: due times, coalescing, the concurrency bound, forgetting."""

import asyncio

from tpujob_operator.schedule import Schedule


def _recorder(delays: dict[tuple[str, str], list[float | None]], hold: float = 0.0):
    calls: list[tuple[str, str]] = []
    running = {"now": 0, "most": 0}

    async def work(key: tuple[str, str]) -> float | None:
        calls.append(key)
        running["now"] += 1
        running["most"] = max(running["most"], running["now"])
        await asyncio.sleep(hold)
        running["now"] -= 1
        queue = delays.get(key) or [None]
        return queue.pop(0) if queue else None

    return work, calls, running


def test_a_job_runs_when_due_and_at_the_delay_its_run_returns():
    async def scenario():
        work, calls, _ = _recorder({("ml", "a"): [0.1, None]})
        schedule = Schedule(work)
        schedule.request(("ml", "a"), 0.05)
        await asyncio.sleep(0.02)
        assert calls == []  # not yet due
        await asyncio.sleep(0.3)
        return calls, schedule.pending()

    calls, pending = asyncio.run(scenario())
    assert calls == [("ml", "a"), ("ml", "a")] and pending == 0  # the run's 0.1 s, then nothing due


def test_a_later_request_never_delays_an_earlier_one_and_an_earlier_one_brings_it_forward():
    async def scenario():
        work, calls, _ = _recorder({})
        schedule = Schedule(work)
        schedule.request(("ml", "a"), 0.05)
        schedule.request(("ml", "a"), 10.0)  # ignored: due sooner already
        schedule.request(("ml", "b"), 10.0)
        schedule.request(("ml", "b"), 0.05)  # brought forward
        await asyncio.sleep(0.2)
        return calls

    assert sorted(asyncio.run(scenario())) == [("ml", "a"), ("ml", "b")]


def test_requests_during_a_run_coalesce_into_one_more_run():
    async def scenario():
        work, calls, running = _recorder({}, hold=0.1)
        schedule = Schedule(work)
        schedule.request(("ml", "a"))
        await asyncio.sleep(0.02)
        for _ in range(5):  # a burst of events while it runs
            schedule.request(("ml", "a"))
            await asyncio.sleep(0)
        await asyncio.sleep(0.4)
        return calls, running["most"]

    calls, most = asyncio.run(scenario())
    assert calls == [("ml", "a")] * 2 and most == 1  # never twice at once


def test_at_most_limit_checks_and_limit_plus_news_limit_runs_at_once():
    async def scenario():
        work, calls, running = _recorder({("ml", str(i)): [0.3, None] for i in range(10)}, hold=0.05)
        schedule = Schedule(work, limit=3, news_limit=2)
        for i in range(10):
            schedule.request(("ml", str(i)))  # news: every slot
        await asyncio.sleep(0.2)  # two waves of news
        news_most = running["most"]
        running["most"] = 0
        await asyncio.sleep(0.6)  # then each job's own check (0.3 s after its run): 3 slots only
        return calls, news_most, running["most"]

    calls, news_most, checks_most = asyncio.run(scenario())
    assert len(calls) == 20 and news_most == 5 and checks_most == 3


def test_a_failing_run_is_retried_and_a_cancelled_job_is_not_run():
    async def scenario():
        calls = []

        async def work(key):
            calls.append(key)
            raise RuntimeError("apiserver down")

        schedule = Schedule(work)
        schedule.request(("ml", "a"))
        schedule.request(("ml", "b"), 0.05)
        schedule.cancel(("ml", "b"))
        await asyncio.sleep(0.1)
        return calls, set(schedule.due)

    calls, due = asyncio.run(scenario())
    assert calls == [("ml", "a")] and due == {("ml", "a")}  # retried later, b never runs


def _slow_checks(schedule_slots: list[Schedule], release: asyncio.Event):
    """Jobs "slow-*" whose first run (news) returns at once with a check due in 10 ms, and whose check
    then blocks until `release` (a storage read of a bucket that does not answer); any other job's
    run is quick. Records when each run started and which lane it was in."""
    started: list[tuple[tuple[str, str], str, float]] = []
    runs: dict[tuple[str, str], int] = {}

    async def work(key: tuple[str, str]) -> float | None:
        loop = asyncio.get_running_loop()
        lane = schedule_slots[0].lane(key) if hasattr(schedule_slots[0], "lane") else "?"
        started.append((key, lane, loop.time()))
        runs[key] = runs.get(key, 0) + 1
        if key[1].startswith("slow"):
            if runs[key] == 1:
                return 0.01
            await release.wait()
        return None

    return work, started


def test_news_runs_while_every_check_slot_is_held_by_slow_storage():
    async def scenario():
        release = asyncio.Event()
        holder: list[Schedule] = []
        work, started = _slow_checks(holder, release)
        schedule = Schedule(work, limit=2)
        holder.append(schedule)
        for name in ("slow-a", "slow-b", "slow-c"):
            schedule.request(("ml", name))
        await asyncio.sleep(0.1)  # their checks now hold both check slots (slow-c's waits for one)
        asked = asyncio.get_running_loop().time()
        schedule.request(("ml", "failed"))  # a worker pod failed
        await asyncio.sleep(0.6)
        ran = [(lane, t - asked) for key, lane, t in started if key == ("ml", "failed")]
        release.set()
        await asyncio.sleep(0.05)
        return ran

    ran = asyncio.run(scenario())
    assert len(ran) == 1 and ran[0][0] == "news" and ran[0][1] < 0.5  # at once, in the news lane


def test_news_of_a_job_whose_check_waits_for_a_slot_runs_it_at_once():
    async def scenario():
        release = asyncio.Event()
        holder: list[Schedule] = []
        work, started = _slow_checks(holder, release)
        schedule = Schedule(work, limit=1)
        holder.append(schedule)
        schedule.request(("ml", "slow-a"))
        schedule.request(("ml", "slow-b"))
        await asyncio.sleep(0.1)  # slow-a's check holds the check slot; slow-b's check waits for it
        asked = asyncio.get_running_loop().time()
        schedule.request(("ml", "slow-b"))  # its worker failed
        await asyncio.sleep(0.6)
        ran = [(lane, t - asked) for key, lane, t in started if key == ("ml", "slow-b") and t >= asked]
        release.set()
        await asyncio.sleep(0.05)
        return ran

    ran = asyncio.run(scenario())
    assert len(ran) == 1 and ran[0][0] == "news" and ran[0][1] < 0.5


def test_checks_never_take_the_slots_kept_for_news():
    async def scenario():
        release = asyncio.Event()
        holder: list[Schedule] = []
        work, started = _slow_checks(holder, release)
        schedule = Schedule(work, limit=2, news_limit=1)
        holder.append(schedule)
        for i in range(4):
            schedule.request(("ml", f"slow-{i}"))
        await asyncio.sleep(0.1)
        checks = sum(1 for _, lane, _ in started if lane == "checks")
        release.set()
        await asyncio.sleep(0.1)
        return checks, sum(1 for _, lane, _ in started if lane == "checks")

    assert asyncio.run(scenario()) == (2, 4)  # two at once while they are slow, then the other two


def test_a_due_check_keeps_nothing_of_the_context_that_asked_for_it():
    """kopf runs each handler with its event in context variables (kopf's cause_var: the raw body,
    its patch and loggers). A job's pending check and its runs must not keep that context alive:
    it held the last watch event's whole object per job (48 KB a job at 60 jobs, tracemalloc)."""
    import contextvars
    import gc
    import weakref

    class Event:  # stands for kopf's cause of the handler that asked
        pass

    cause: contextvars.ContextVar[Event] = contextvars.ContextVar("cause")

    async def scenario():
        work, calls, _ = _recorder({("ml", "b"): [60.0]})
        schedule = Schedule(work)
        event = Event()
        gone = weakref.ref(event)

        def handler(event: Event) -> None:  # as kopf calls it: in a context that holds the event
            cause.set(event)
            schedule.request(("ml", "a"), 60.0)  # due later: pending
            schedule.request(("ml", "b"))  # due now: runs, then its own next check is pending

        contextvars.copy_context().run(handler, event)
        del event
        await asyncio.sleep(0.05)
        gc.collect()
        held = gone() is not None
        for key in list(schedule.due):
            schedule.cancel(key)
        return held, calls, set(schedule.due)

    held, calls, _ = asyncio.run(scenario())
    assert calls == [("ml", "b")]
    assert not held  # neither the pending check of a nor the run of b (and its next check) keeps the event
