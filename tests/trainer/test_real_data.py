"""Real data (--data): the global batch of a step is a pure function of (corpus, seed, step), so a
run killed and restarted on a text corpus ends bitwise equal to an uninterrupted one; bad corpora
exit 2 (bad configuration), naming the path.

The corpus is real text that every Python install carries: the standard library's own sources.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tpujob.config import ConfigError
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_trainer import corpus
from tpujob_trainer.config import MODELS, check_data, parse_config

from tests.trainer.procs import BUCKET, Attempt, Job

SEQ_LEN = 32
BATCH = 8


def stdlib_text(size: int) -> bytes:
    """The first `size` bytes of the standard library's top-level *.py files, sorted and concatenated."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b""
    for path in sorted(stdlib.glob("*.py")):
        text += path.read_bytes()
        if len(text) >= size:
            return text[:size]
    raise AssertionError(f"the standard library holds less than {size} bytes of *.py")


def _batches_of(path: Path, *flags: str) -> Callable[[int], np.ndarray]:
    args = ["--data", str(path), "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), *flags]
    return corpus.batches(parse_config(args, {}).train)


def test_data_flag_and_its_env_fallback() -> None:
    assert parse_config([], {}).train.data == ""  # synthetic, the default
    assert parse_config(["--data", "gs://b/corpus/"], {}).train.data == "gs://b/corpus/"
    assert parse_config([], {"TPUJOB_DATA": "/data/text"}).train.data == "/data/text"
    assert parse_config(["--data", "/a"], {"TPUJOB_DATA": "/b"}).train.data == "/a"
    small_vocab = dataclasses.replace(MODELS["tiny"], name="bytes-half", vocab_size=128)
    check_data("", small_vocab)  # synthetic data fits any vocabulary
    with pytest.raises(ConfigError, match=r"--data /corpus.*model bytes-half.*128"):
        check_data("/corpus", small_vocab)


def test_global_batch_is_a_pure_function_of_corpus_seed_and_step(tmp_path: Path) -> None:
    # Random bytes: every window is distinct, so a row names the window it is.
    windows = 40
    text = np.random.default_rng(7).integers(0, 256, windows * SEQ_LEN + 5, dtype=np.uint8).tobytes()
    (tmp_path / "corpus.bin").write_bytes(text)
    by_bytes = {text[i * SEQ_LEN : (i + 1) * SEQ_LEN]: i for i in range(windows)}
    assert len(by_bytes) == windows

    batch_of = _batches_of(tmp_path / "corpus.bin")
    again = _batches_of(tmp_path / "corpus.bin")  # a new process, or the restarted one
    other_seed = _batches_of(tmp_path / "corpus.bin", "--seed", "1")

    def window_ids(step: int) -> list[int]:
        batch = batch_of(step)
        assert batch.shape == (BATCH, SEQ_LEN) and batch.dtype == np.int32
        assert batch.min() >= 0 and batch.max() <= 255
        return [by_bytes[row.astype(np.uint8).tobytes()] for row in batch]  # KeyError: not a window

    for step in (0, 3, 4, 11, 1000):
        assert np.array_equal(batch_of(step), again(step)), step
        assert not np.array_equal(batch_of(step), other_seed(step)), step
    # One epoch is 40 windows = 5 steps: each window exactly once; the next epoch, all again, reordered.
    first = [w for step in range(5) for w in window_ids(step)]
    second = [w for step in range(5, 10) for w in window_ids(step)]
    assert sorted(first) == sorted(second) == list(range(windows))
    assert first != second
    assert set(window_ids(0)).isdisjoint(window_ids(1))


def test_rows_are_windows_of_real_text(tmp_path: Path) -> None:
    text = stdlib_text(50_000)
    (tmp_path / "stdlib.py.txt").write_bytes(text)
    batch_of = _batches_of(tmp_path / "stdlib.py.txt")
    for step in (0, 7, 100):
        for row in batch_of(step):
            offset = text.find(row.astype(np.uint8).tobytes())
            assert offset >= 0, f"step {step}: a row that is not in the corpus"


def test_directory_corpus_is_its_files_sorted_hidden_skipped(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    # Written in another order than the sorted one, so the listing's order is not the answer by chance.
    (root / "sub" / "c.txt").write_bytes(b"third")
    (root / "b.txt").write_bytes(b"second")
    (root / "a.txt").write_bytes(b"first")
    (root / ".hidden").write_bytes(b"HIDDEN")
    (root / ".git" / "HEAD").write_bytes(b"GIT")
    (root / "sub" / "loop").symlink_to(root, target_is_directory=True)  # not followed: no endless walk
    os.mkfifo(root / "fifo")  # not a regular file: never read (it would block)
    assert bytes(corpus.read_corpus(str(root))) == b"first\nsecond\nthird"
    assert bytes(corpus.read_corpus(str(root / "b.txt"))) == b"second"


def test_corpus_shorter_than_a_window_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_bytes(b"x" * (SEQ_LEN - 1))
    with pytest.raises(ConfigError, match=rf"short.txt: {SEQ_LEN - 1} bytes, less than one window"):
        _batches_of(tmp_path / "short.txt")
    with pytest.raises(ConfigError, match="no such file or directory"):
        _batches_of(tmp_path / "missing.txt")


@pytest.mark.timeout(300)
def test_bad_corpus_exits_2_naming_the_path(job: Job, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-corpus"
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    # Both at once: each exits before JAX starts or storage is touched.
    attempts = [job.start(["--steps", "3", "--data", str(path)]) for path in (missing, empty)]
    for attempt, path in zip(attempts, (missing, empty), strict=True):
        assert attempt.wait(quiet=120) == [2], attempt.output()
        assert f"bad configuration: --data {path}" in attempt.output()
    assert "no such file or directory" in attempts[0].output()
    assert "0 bytes, less than one window" in attempts[1].output()
    assert job.committed_steps() == []


STEPS = 60
ARGS = ["--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN)]
_DATA_LINE = re.compile(r"data: (\S+), (\d+) bytes, (\d+) windows")


def _data_line(attempt: Attempt, process: int) -> tuple[str, int, int]:
    found = _DATA_LINE.search(attempt.output(process))
    assert found, attempt.output(process)
    return found.group(1), int(found.group(2)), int(found.group(3))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_and_restarted_real_data_run_is_bitwise_equal_to_uninterrupted(
    job: Job, gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path
) -> None:
    """2 processes (data axis across them, one CPU device each). The reference reads a
    local file; the interrupted run reads the same bytes from gs://, as a directory of two files
    split at a newline (which the reader joins back with one) beside a hidden file it must skip; it
    is SIGKILLed at a random step once a checkpoint is committed, and restarted as the operator does."""
    text = stdlib_text(200_000)
    local = tmp_path / "corpus.txt"
    local.write_bytes(text)
    cut = text.index(b"\n", len(text) // 2)
    remote = f"{job.prefix}-corpus"
    gcs.upload(BUCKET, f"{remote}/part-1.txt", text[cut + 1 :])
    gcs.upload(BUCKET, f"{remote}/part-0.txt", text[:cut])
    gcs.upload(BUCKET, f"{remote}/.partial-upload", b"not part of the corpus")

    (tmp_path / "reference").mkdir()
    reference = Job(gcs, trainer_env, tmp_path / "reference", f"ref-{job.name}")
    try:
        # The reference trains beside the interrupted run's first attempt.
        uninterrupted = reference.start([*ARGS, "--data", str(local)], processes=2, slices=2)
        data = ["--data", f"gs://{BUCKET}/{remote}"]
        first = job.start([*ARGS, *data], processes=2, slices=2)
        target = random.Random(20261206).randint(6, 20)
        first.wait_until(lambda: first.last_step() >= target and bool(job.committed_steps()), quiet=240)
        first.signal(signal.SIGKILL)
        first.wait(quiet=30)
        killed_at, committed = first.last_step(), job.committed_steps()[-1]
        assert committed < STEPS, f"the run ended before the kill (step {killed_at})"

        second = job.start([*ARGS, *data], processes=2, slices=2)  # TPUJOB_ATTEMPT 1, same run dir
        assert second.wait(quiet=240) == [0, 0], second.output()
        assert uninterrupted.wait(quiet=240) == [0, 0], uninterrupted.output()
        assert f"resume: restoring step {committed} (latest committed)" in second.output()
        print(f"SIGKILL at step {killed_at}, resumed from {committed}")

        windows = len(text) // SEQ_LEN
        assert _data_line(uninterrupted, 1) == (str(local), len(text), windows)
        for attempt in (first, second):
            for process in (0, 1):
                assert _data_line(attempt, process) == (f"gs://{BUCKET}/{remote}", len(text), windows)
        assert job.digest(STEPS) == reference.digest(STEPS)
    finally:
        reference.kill_all()
