"""Adaptive checkpoint cadence: how often to save, from the save cost the trainer measures itself.

Pure arithmetic and an online estimator (no JAX, no clock): the training loop feeds it step times
and save blocking times, and reads back the interval between save starts to keep.

- **Save cost** C: the time the loop is blocked in save(), plus how much the steps that ran while
  the save was in flight in the background were slower than steps with no save in flight.
- **Overhead**: extra time / productive time. Over an interval T between save starts that holds
  one save, C / (T - C) <= b  <=>  T >= C (1 + b) / b: the budget interval.
- **Young/Daly**: with a mean time between failures M, sqrt(2 C M) minimises the expected waste
  (saves plus the work lost to a failure); saving more often wastes more than it protects.
- The interval in force is the larger of the two, clamped to the user's [min, max] bounds.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Literal

Bound = Literal["budget", "young_daly", "min", "max"]

# Steps with no save in flight needed for a baseline step time; saves wait for it (see Cadence).
MIN_IDLE_STEPS = 20
IDLE_WINDOW_STEPS = 100  # the baseline follows the last this many idle steps (step time drifts)
COST_WINDOW_SAVES = 5  # the cost estimate is the median of the last this many saves
# The cadence plans for this share of the budget: the promise is the measured overhead, and what
# the next save will cost is only known after it (on a loaded host one save can cost twice another).
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class Interval:
    """The interval between save starts in force, and which bound set it."""

    seconds: float
    bound: Bound


def budget_interval(cost_s: float, budget: float) -> float:
    """The shortest interval between save starts at which saves cost at most `budget` (a fraction,
    0.05 = 5%) of the productive time: C / (T - C) <= b."""
    if budget <= 0:
        raise ValueError(f"the overhead budget is > 0, got {budget}")
    return cost_s * (1 + budget) / budget


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's first-order optimum sqrt(2 C M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def choose_interval(
    cost_s: float,
    budget: float,
    mtbf_s: float | None,
    min_s: float = 0.0,
    max_s: float | None = None,
    debt_s: float = 0.0,
) -> Interval:
    """max(budget interval + debt, Young/Daly), clamped to [min_s, max_s] (the user's bounds win).

    debt_s stretches the budget interval by the productive time it takes to pay back overhead
    already spent beyond the budget (see SaveCostMeter.debt_s). No MTBF: the budget bound alone.
    """
    chosen = Interval(budget_interval(cost_s, budget) + debt_s, "budget")
    if mtbf_s is not None and (young_daly := young_daly_interval(cost_s, mtbf_s)) > chosen.seconds:
        chosen = Interval(young_daly, "young_daly")
    if max_s is not None and chosen.seconds > max_s:
        return Interval(max_s, "max")
    if chosen.seconds < min_s:
        return Interval(min_s, "min")
    return chosen


@dataclasses.dataclass
class _Save:
    """A save started but not yet settled: its blocking time and the steps that ran alongside it."""

    blocking_s: float
    steps_s: list[float] = dataclasses.field(default_factory=list)


class SaveCostMeter:
    """Online estimate of one save's cost, and the attempt's cumulative overhead.

    The loop reports every step's time (excluding the blocking save, compilation) with whether a
    save is still in flight at its end, and every save it started with the time it was blocked.
    A step counts against the open save if that save was in flight when it started; the save is
    settled at the first step that ends with it finished. Its cost is its blocking time plus how
    much longer its n steps took than n baseline steps (a save's work comes in bursts, so every
    step beside it counts). The baseline is the median of the recent idle steps and the cost
    estimate the median of the last few saves, so that one slow step or one slow save (a GC, a
    noisy neighbour, a stalled write) does not swing the interval; what one costly save spent
    beyond the estimate is paid back once (debt_s).
    """

    def __init__(
        self,
        min_idle_steps: int = MIN_IDLE_STEPS,
        idle_window: int = IDLE_WINDOW_STEPS,
        cost_window: int = COST_WINDOW_SAVES,
    ):
        self._min_idle = min_idle_steps
        self._idle: collections.deque[float] = collections.deque(maxlen=idle_window)
        self._costs: collections.deque[float] = collections.deque(maxlen=cost_window)
        self._open: _Save | None = None
        self.extra_s = 0.0  # blocking + slowdown of the settled saves
        self.productive_s = 0.0  # step time of settled steps, less their slowdown
        self._at_settle = (0.0, 0.0)  # (extra_s, productive_s) when the last save settled

    @property
    def baseline_s(self) -> float | None:
        """Median step time with no save in flight; None until min_idle_steps were seen."""
        return statistics.median(self._idle) if len(self._idle) >= self._min_idle else None

    @property
    def cost_s(self) -> float | None:
        """Median cost of the last settled saves; None before the first one settled."""
        return statistics.median(self._costs) if self._costs else None

    @property
    def overhead(self) -> float | None:
        """Cumulative extra / productive time (a fraction); None before any productive time."""
        return self.extra_s / self.productive_s if self.productive_s > 0 else None

    def debt_s(self, budget: float) -> float:
        """Productive time it would have taken, when the last save settled, to bring the cumulative
        overhead back to the budget: the first save, taken as soon as a baseline exists to measure
        the cost, spends its C over very little productive time, and a save far costlier than the
        median is not in the estimate. Frozen at the settle: the interval that follows already
        counts its own productive time. Never negative: a cheap past buys no burst of saves."""
        extra, productive = self._at_settle
        return max(0.0, extra - budget * productive) / budget

    def saved(self, blocking_s: float) -> None:
        """A save started; the loop was blocked in it for blocking_s."""
        if self._open is not None:  # a save is never started while one is in flight; settle defensively
            self._settle()
        self._open = _Save(blocking_s)

    def step(self, seconds: float, saving: bool) -> None:
        """One step took `seconds`; `saving`: a save is still in flight at its end."""
        if self._open is None:
            self._idle.append(seconds)
            self.productive_s += seconds
            return
        self._open.steps_s.append(seconds)
        if not saving:
            self._settle()

    def _settle(self) -> None:
        assert self._open is not None
        save, self._open = self._open, None
        baseline = self.baseline_s
        # Without a baseline (a save forced before one existed: preemption) only the blocking is known.
        slowdown = 0.0 if baseline is None else max(0.0, sum(save.steps_s) - len(save.steps_s) * baseline)
        cost = save.blocking_s + slowdown
        self._costs.append(cost)
        self.extra_s += cost
        self.productive_s += sum(save.steps_s) - slowdown
        self._at_settle = (self.extra_s, self.productive_s)


class Cadence:
    """The adaptive policy's decision: the interval between save starts, from the meter's estimates.

    It plans for HEADROOM of the budget, and pays back overspending (the meter's debt).
    Before a baseline exists (MIN_IDLE_STEPS idle steps after compilation) nothing is saved, even
    past max_s: a save before it could not be priced. Once it exists and no save has been measured
    yet, the next save is due at once (after min_s): the first save measures the cost, and its
    early overhead is then paid back by a longer interval (the meter's debt).
    """

    def __init__(
        self,
        budget: float,
        mtbf_s: float | None,
        min_s: float = 0.0,
        max_s: float | None = None,
        meter: SaveCostMeter | None = None,
    ):
        if budget <= 0:
            raise ValueError(f"the overhead budget is > 0, got {budget}")
        self.budget, self.mtbf_s, self.min_s, self.max_s = budget, mtbf_s, min_s, max_s
        self.meter = meter or SaveCostMeter()

    def interval(self) -> Interval | None:
        """The interval in force; None while the first save is not yet priced (held, then due at once)."""
        cost = self.meter.cost_s
        if cost is None:
            return None
        plan = self.budget * HEADROOM
        return choose_interval(cost, plan, self.mtbf_s, self.min_s, self.max_s, self.meter.debt_s(plan))

    def due_after_s(self) -> float | None:
        """Seconds between save starts to wait now; None: hold (no baseline yet)."""
        if self.meter.baseline_s is None:
            return None
        chosen = self.interval()
        return self.min_s if chosen is None else chosen.seconds


def changed_materially(before: Interval | None, after: Interval | None, tolerance: float = 0.2) -> bool:
    """Worth a log line: another bound, or the interval moved by more than `tolerance` (relative)."""
    if before is None or after is None:
        return before is not after
    if before.bound != after.bound:
        return True
    return abs(after.seconds - before.seconds) > tolerance * max(before.seconds, 1e-9)
