"""The adaptive cadence's arithmetic and estimator (pure: no JAX, no clock, no processes).

The truths: the budget interval is where C / (T - C) equals the budget; Young/Daly's interval is
where the expected waste C/T + T/(2M) is smallest; the estimator is fed steps whose costs are
known by construction.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tpujob.cadence import (
    HEADROOM,
    MIN_IDLE_STEPS,
    Cadence,
    Interval,
    SaveCostMeter,
    budget_interval,
    changed_materially,
    choose_interval,
    young_daly_interval,
)

costs = st.floats(min_value=1e-3, max_value=1e3)
budgets = st.floats(min_value=1e-3, max_value=1.0)
mtbfs = st.floats(min_value=1.0, max_value=1e7)


@given(costs, budgets)
def test_the_budget_interval_spends_exactly_the_budget(cost: float, budget: float) -> None:
    interval = budget_interval(cost, budget)
    assert cost / (interval - cost) == pytest.approx(budget, rel=1e-9)


def test_budget_interval_examples() -> None:
    assert budget_interval(1.0, 0.05) == pytest.approx(21.0)  # 1 s of saving per 20 s of training
    assert budget_interval(2.0, 0.10) == pytest.approx(22.0)
    with pytest.raises(ValueError):
        budget_interval(1.0, 0.0)


@given(costs, mtbfs)
def test_young_daly_minimises_the_expected_waste(cost: float, mtbf: float) -> None:
    def waste(t: float) -> float:  # saving cost per second + work lost per second of failures
        return cost / t + t / (2 * mtbf)

    best = young_daly_interval(cost, mtbf)
    assert best == pytest.approx(math.sqrt(2 * cost * mtbf))
    assert waste(best) <= waste(best * 0.9) and waste(best) <= waste(best * 1.1)


def test_the_larger_of_budget_and_young_daly_is_in_force() -> None:
    # C = 1 s, 5%: budget 21 s. MTBF 50 s: Young/Daly 10 s -> budget; MTBF 1 h: 84.9 s -> Young/Daly.
    assert choose_interval(1.0, 0.05, 50.0) == Interval(pytest.approx(21.0), "budget")  # type: ignore[arg-type]
    chosen = choose_interval(1.0, 0.05, 3600.0)
    assert chosen.bound == "young_daly" and chosen.seconds == pytest.approx(math.sqrt(7200))


def test_no_mtbf_means_the_budget_bound_alone() -> None:
    assert choose_interval(1.0, 0.05, None) == choose_interval(1.0, 0.05, 1e-9)
    assert choose_interval(1.0, 0.05, None).bound == "budget"


@given(costs, budgets, st.none() | mtbfs, st.floats(0, 1e4), st.none() | st.floats(1e-3, 1e5))
def test_the_users_bounds_always_win(
    cost: float, budget: float, mtbf: float | None, low: float, high: float | None
) -> None:
    if high is not None and high < low:
        low, high = high, low
    chosen = choose_interval(cost, budget, mtbf, low, high)
    assert chosen.seconds >= low or chosen.bound == "max"
    assert high is None or chosen.seconds <= high
    free = choose_interval(cost, budget, mtbf)
    if low <= free.seconds and (high is None or free.seconds <= high):
        assert chosen == free
    elif free.seconds < low:
        assert chosen == Interval(low, "min")
    else:
        assert chosen == Interval(high, "max")  # type: ignore[arg-type]


def test_min_and_max_examples() -> None:
    assert choose_interval(1.0, 0.05, None, min_s=30.0) == Interval(30.0, "min")
    assert choose_interval(1.0, 0.05, 3600.0, max_s=60.0) == Interval(60.0, "max")
    assert choose_interval(1.0, 0.05, None, min_s=5.0, max_s=60.0).bound == "budget"


def test_debt_lengthens_only_the_budget_bound() -> None:
    assert choose_interval(1.0, 0.05, None, debt_s=10.0).seconds == pytest.approx(31.0)
    # Young/Daly at 3600 s is 84.9 s: a debt that keeps the budget interval below it changes nothing.
    assert choose_interval(1.0, 0.05, 3600.0, debt_s=10.0).bound == "young_daly"


def _meter_with_baseline(step_s: float = 0.1) -> SaveCostMeter:
    meter = SaveCostMeter()
    for _ in range(MIN_IDLE_STEPS):
        meter.step(step_s, saving=False)
    return meter


def _save(meter: SaveCostMeter, blocking_s: float, in_flight_steps: list[float]) -> None:
    meter.saved(blocking_s)
    for i, seconds in enumerate(in_flight_steps):
        meter.step(seconds, saving=i < len(in_flight_steps) - 1)


def test_a_save_costs_its_blocking_plus_the_slowdown_of_the_steps_beside_it() -> None:
    meter = _meter_with_baseline(0.1)
    _save(meter, 0.3, [0.15, 0.1, 0.25, 0.1])  # 0.05 + 0 + 0.15 + 0 slower than 0.1
    assert meter.cost_s == pytest.approx(0.3 + 0.2)
    assert meter.extra_s == pytest.approx(0.5)
    assert meter.productive_s == pytest.approx(MIN_IDLE_STEPS * 0.1 + 4 * 0.1)
    assert meter.overhead == pytest.approx(0.5 / meter.productive_s)


def test_no_baseline_no_cost_and_no_interval() -> None:
    cadence = Cadence(budget=0.05, mtbf_s=None)
    for _ in range(MIN_IDLE_STEPS - 1):
        cadence.meter.step(0.1, saving=False)
    assert cadence.meter.baseline_s is None and cadence.due_after_s() is None  # held: nothing can be priced
    cadence.meter.step(0.1, saving=False)
    assert cadence.interval() is None and cadence.due_after_s() == 0.0  # priced by the first save, at once
    assert Cadence(budget=0.05, mtbf_s=None, min_s=7.0, meter=cadence.meter).due_after_s() == 7.0


def test_the_first_save_is_paid_back_then_the_budget_interval_holds() -> None:
    cadence = Cadence(budget=0.10, mtbf_s=None, meter=_meter_with_baseline(0.1))
    plan = 0.10 * HEADROOM  # what the cadence aims at, below the budget it promises
    productive = MIN_IDLE_STEPS * 0.1 + 0.1
    _save(cadence.meter, 0.5, [0.1])  # C = 0.5 s after 2 s of training: far over budget
    first = cadence.interval()
    assert first is not None and first.bound == "budget"
    steady = budget_interval(0.5, plan)
    debt = (0.5 - plan * productive) / plan  # the productive time that brings 0.5 s of extra back to plan
    assert first.seconds == pytest.approx(steady + debt)
    # Train for the interval (less the save itself), save again at the same cost: no debt left.
    for _ in range(round((first.seconds - 0.5 - 0.1) / 0.1)):
        cadence.meter.step(0.1, saving=False)
    _save(cadence.meter, 0.5, [0.1])
    assert cadence.meter.overhead == pytest.approx(plan, abs=0.005)
    second = cadence.interval()
    assert second is not None and second.seconds == pytest.approx(steady, rel=0.05)


def test_steady_saves_at_the_interval_spend_the_planned_share_of_the_budget() -> None:
    cadence = Cadence(budget=0.05, mtbf_s=None, meter=_meter_with_baseline(0.1))
    for _ in range(30):  # each save: blocked 0.2 s, then one step 0.1 s slower than the baseline
        _save(cadence.meter, 0.2, [0.2])
        chosen = cadence.interval()
        assert chosen is not None
        for _ in range(round((chosen.seconds - 0.3) / 0.1)):
            cadence.meter.step(0.1, saving=False)
    assert cadence.meter.cost_s == pytest.approx(0.3)
    overhead = cadence.meter.overhead
    assert overhead is not None and overhead == pytest.approx(0.05 * HEADROOM, rel=0.05) and overhead <= 0.05


def test_one_noisy_save_does_not_move_the_estimate() -> None:
    meter = _meter_with_baseline(0.1)
    for blocking in (0.2, 0.2, 3.0, 0.2, 0.2):  # one save blocked by a stalled write
        _save(meter, blocking, [0.1, 0.1])
        for _ in range(100):
            meter.step(0.1, saving=False)
    assert meter.cost_s == pytest.approx(0.2)


def test_one_slow_step_does_not_move_the_baseline() -> None:
    meter = _meter_with_baseline(0.1)
    meter.step(5.0, saving=False)  # a GC pause, a noisy neighbour
    meter.step(0.1, saving=False)
    assert meter.baseline_s == pytest.approx(0.1)


def test_the_estimate_follows_a_lasting_change() -> None:
    meter = _meter_with_baseline(0.1)
    for blocking in [0.2] * 5 + [1.0] * 3:  # the checkpoint grew
        _save(meter, blocking, [0.1])
    assert meter.cost_s == pytest.approx(1.0)


def test_a_save_before_any_baseline_costs_its_blocking() -> None:
    meter = SaveCostMeter()
    _save(meter, 0.4, [0.3, 0.3])  # a preemption save, say
    assert meter.cost_s == pytest.approx(0.4) and meter.productive_s == pytest.approx(0.6)


@given(st.lists(st.floats(0.0, 2.0), min_size=1, max_size=30), st.floats(0.01, 1.0))
def test_overhead_is_extra_over_productive_time(blockings: list[float], step_s: float) -> None:
    meter = _meter_with_baseline(step_s)
    for blocking in blockings:
        _save(meter, blocking, [step_s * 1.5, step_s])
    extra = sum(blockings) + len(blockings) * 0.5 * step_s
    productive = (MIN_IDLE_STEPS + 2 * len(blockings)) * step_s
    assert meter.overhead == pytest.approx(extra / productive)


def test_material_changes() -> None:
    a = Interval(10.0, "budget")
    assert not changed_materially(a, Interval(11.0, "budget"))
    assert changed_materially(a, Interval(13.0, "budget"))
    assert changed_materially(a, Interval(10.0, "young_daly"))
    assert changed_materially(None, a) and not changed_materially(None, None)
