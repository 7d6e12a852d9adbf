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


def test_at_most_limit_jobs_run_at_once():
    async def scenario():
        work, calls, running = _recorder({}, hold=0.05)
        schedule = Schedule(work, limit=3)
        for i in range(10):
            schedule.request(("ml", str(i)))
        await asyncio.sleep(0.5)
        return calls, running["most"]

    calls, most = asyncio.run(scenario())
    assert len(calls) == 10 and most == 3


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
