"""bench/trainer_versions.py's pure parts: which progress lines count, the summary's figures, the order."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import benches

bench = benches.load("trainer_versions")


def test_a_runs_rate_is_the_median_of_its_progress_lines_past_the_warmup() -> None:
    output = "\n".join(
        f"step {s}/300 loss 1.0000 steps/s {r} last_committed {s - 1}"
        for s, r in ((100, 1.0), (150, 40.0), (200, 50.0), (250, 60.0), (300, 55.0))
    )
    assert bench.run_rate(output, warmup=100) == 52.5
    with pytest.raises(ValueError, match="past step 300"):
        bench.run_rate(output, warmup=300)


def test_the_summary_gives_medians_the_ratio_and_the_noise() -> None:
    result = bench.summary({"before": [50.0, 48.0, 52.0], "after": [51.0, 49.0, 50.0]})
    assert result["sides"]["before"]["median_steps_per_s"] == 50.0
    assert result["after_over_before"] == 1.0
    assert result["noise"] == 0.08 and result["within_noise"] is True
    slower = bench.summary({"before": [50.0, 50.5], "after": [40.0, 40.2]})
    assert slower["after_over_before"] == 0.798 and slower["within_noise"] is False


def test_sides_alternate_every_other_round_reversed() -> None:
    before, after = bench.Side("before", "x", "c1", Path("/a")), bench.Side("after", "y", "c2", Path("/b"))
    keys = [(r, s.key) for r, s in bench.plan([before, after], 3)]
    assert keys == [(0, "before"), (0, "after"), (1, "after"), (1, "before"), (2, "before"), (2, "after")]
