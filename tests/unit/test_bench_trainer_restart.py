"""bench/trainer_restart.py's pure parts: the stages from a progress record, the cache's log lines, the order,
the summary's medians and the side-by-side figures."""

from __future__ import annotations

from datetime import UTC, datetime

from . import benches

bench = benches.load("trainer_restart")

T0 = datetime(2026, 12, 6, 12, 0, 0, tzinfo=UTC).timestamp()


def _at(seconds: float) -> str:
    return datetime.fromtimestamp(T0 + seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_a_restart_is_split_into_stages_from_its_record_and_the_spawn_time() -> None:
    record = {
        "process_started_at": _at(3.0), "storage_ready_at": _at(13.0), "restore_started_at": _at(13.5),
        "restore_finished_at": _at(14.0), "first_step_at": _at(15.5),
    }  # fmt: skip
    assert bench.stages(record, T0) == {
        "spawn_to_process": 3.0, "process_to_storage": 10.0, "storage_to_restore": 0.5, "restore": 0.5,
        "restored_to_first_step": 1.5, "total": 15.5,
    }  # fmt: skip


def test_a_cold_start_counts_its_first_step_from_storage_ready() -> None:
    record = {"process_started_at": _at(3.0), "storage_ready_at": _at(13.0), "first_step_at": _at(31.0)}
    s = bench.stages(record, T0)
    assert s["storage_to_restore"] is None and s["restore"] is None
    assert s["restored_to_first_step"] == 18.0 and s["total"] == 31.0


def test_cache_lookups_count_the_trainers_hit_and_miss_lines() -> None:
    log = "\n".join([
        "INFO [tpujob_trainer] compile cache: local /c, then shared /r/jax-cache",
        "INFO [tpujob_trainer] compile cache: miss jit_init-0123 (local)",
        "INFO [tpujob_trainer] compile cache: hit jit_step-4567 (local, 10 bytes, read in 0.01s)",
        "INFO [tpujob_trainer] compile cache: hit jit_x-89ab (local, 10 bytes, read in 0.01s)",
    ])  # fmt: skip
    assert bench.cache_lookups(log) == {"hits": 2, "misses": 1}


def test_sides_alternate_every_other_round_reversed() -> None:
    assert bench.plan(["off", "on"], 3) == [(0, "off"), (0, "on"), (1, "on"), (1, "off"), (2, "off"), (2, "on")]


def _run(total: float, first_step: float) -> dict[str, object]:
    stages = dict.fromkeys(bench.STAGES, 1.0) | {"total": total, "restored_to_first_step": first_step}
    return {"stages": stages, "cache": {"hits": 3, "misses": 0}, "retries": 0}


def test_the_summary_gives_medians_the_spread_and_on_against_off() -> None:
    off = bench.side_summary([_run(22.0, 8.0), _run(23.0, 7.8), _run(24.0, 7.9)])
    on = bench.side_summary([_run(15.0, 1.5), _run(15.5, 1.6)])
    assert off["n"] == 3 and off["median_s"]["total"] == 23.0 and off["spread"] == round(2 / 23, 3)
    assert on["median_s"]["restored_to_first_step"] == 1.55 and on["cache_hits"] == [3, 3]
    both = bench.side_by_side({"off": off, "on": on})
    assert both["stages_s"]["total"] == {"off": 23.0, "on": 15.25, "delta": -7.75}
    assert both["total_on_over_off"] == 0.663 and both["within_noise"] is False
    assert bench.side_by_side({"off": off}) == {}
