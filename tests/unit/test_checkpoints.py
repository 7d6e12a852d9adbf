import pytest
from tpujob_operator.checkpoints import parse_progress, split_gs_path, step_candidates


def test_only_digit_step_directories_are_candidates_newest_first():
    prefix = "runs/ml/llama/checkpoints/"
    prefixes = [f"{prefix}{p}/" for p in ("100", "20", "300.orbax-checkpoint-tmp-1712", "abc", "1000")] + ["other/5/"]
    assert step_candidates(prefix, prefixes) == [1000, 100, 20]


@pytest.mark.parametrize(
    ("path", "bucket", "prefix"),
    [("gs://b/runs/ml/x", "b", "runs/ml/x"), ("gs://b", "b", ""), ("gs://b/a/", "b", "a")],
)
def test_split_gs_path(path, bucket, prefix):
    assert split_gs_path(path) == (bucket, prefix)


def test_progress_record_parses():
    record = parse_progress(b'{"step": 12, "attempt": 1, "updated_at": "2026-11-30T12:00:00Z", "loss": 2.5}')
    assert (record.step, record.attempt, record.loss, record.updated_at.tzinfo is not None) == (12, 1, 2.5, True)
