"""A decision due before the next poll (a short backoff) is re-examined when it is due."""

import asyncio

import pytest
from tpujob_operator import handlers
from tpujob_operator.reconcile import POLL_SECONDS


@pytest.fixture
def woken(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    handlers.reset_clients()
    calls: list[tuple[str, str]] = []

    async def record(namespace: str, name: str) -> float | None:
        calls.append((namespace, name))
        return None

    monkeypatch.setattr(handlers, "reconcile_job", record)
    return calls


def test_a_short_requeue_wakes_the_job_once_when_due(woken):
    async def scenario() -> None:
        handlers.RUNTIME.watched.add(("ml", "llama"))
        handlers._schedule("ml", "llama", 0.2)
        handlers._schedule("ml", "llama", 0.05)  # replaces the pending wake-up
        handlers._schedule("ml", "other", 0.05)  # not a live job: nothing
        handlers._schedule("ml", "llama-slow", POLL_SECONDS)  # the poller's business
        await asyncio.sleep(0.4)

    asyncio.run(scenario())
    assert woken == [("ml", "llama")]


def test_a_wake_up_of_a_forgotten_job_does_nothing(woken):
    async def scenario() -> None:
        handlers.RUNTIME.watched.add(("ml", "llama"))
        handlers._schedule("ml", "llama", 0.05)
        handlers.RUNTIME.forget(("ml", "llama"))
        await asyncio.sleep(0.2)

    asyncio.run(scenario())
    assert woken == [] and handlers.RUNTIME.remembered(("ml", "llama")) == 0
