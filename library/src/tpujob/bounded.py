"""A storage call with a deadline: GCS clients retry an unreachable or hung endpoint for minutes,
and the trainer must neither hang before its first step nor stall a compile on one."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class StorageTimeout(OSError):
    """A storage call did not answer in time."""


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """fn() in a daemon thread; raises its error, or StorageTimeout after timeout_s (the thread is
    abandoned: a hung storage call must not hold the caller, nor the process's exit)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=target, name="tpujob-storage-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StorageTimeout(f"{what} did not answer within {timeout_s:g}s")
    if errors:
        raise errors[0]
    return result[0]
