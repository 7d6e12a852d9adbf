"""The persistent compilation cache in the run directory (trainer_image/.../compile_cache.py).

Real processes on the GCS emulator: a restarted attempt of the same job reads what the first
attempt wrote and compiles nothing; the trained parameters are the same bit for bit with and
without the cache; several CPU processes (whose keys differ) train without it; damaged entries and unusable
cache storage only cost a recompile. In-process: the storage deadline, atomic local writes, the
entry check and the configuration.
"""

from __future__ import annotations

import hashlib
import re
import signal
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tpujob import compile_cache
from tpujob.compile_cache import GuardedCache, TieredCache, frame, unframe
from tpujob.config import compilation_cache_dir, local_compilation_cache_dir
from tpujob_trainer.config import parse_config

from tests.trainer.procs import BUCKET, Job

STEPS = 300  # long enough that the kill always lands mid-run, even on an idle machine
ARGS = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32"]


def _without_jax_cache(job: Job) -> None:
    """The session shares a local JAX cache (conftest); these tests exercise the run directory's."""
    job.base_env = {k: v for k, v in job.base_env.items() if k != "JAX_COMPILATION_CACHE_DIR"}


def _cache_objects(job: Job) -> list[str]:
    return job.gcs.list_objects(BUCKET, f"{job.prefix}/jax-cache/")


def _compile_seconds(record: dict[str, Any]) -> float:
    """Restore end (or storage ready, on a fresh start) -> first step: compilation, mostly."""
    start = record["restore_finished_at"] or record["storage_ready_at"]
    first = datetime.fromisoformat(record["first_step_at"].replace("Z", "+00:00"))
    return (first - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()


def _kill_after_a_committed_step(job: Job, env: dict[str, str], processes: int = 1) -> None:
    cached = env.get("TPUJOB_COMPILATION_CACHE_DIR") != "off"
    attempt = job.start(ARGS, env, processes=processes)
    attempt.wait_until(
        lambda: (
            attempt.last_step() >= 8
            and any(s >= 4 for s in job.committed_steps())
            and (not cached or any("/jit_train_step-" in o for o in _cache_objects(job)))
        ),
        quiet=240,
    )
    attempt.signal(signal.SIGKILL)
    attempt.wait(30)


def _train_step_keys(out: str, what: str) -> set[str]:
    return set(re.findall(rf"compile cache: {what} (jit_train_step-\w+)", out))


@pytest.mark.timeout(600)
def test_restart_reads_the_cache_and_trains_identically(job: Job, tmp_path: Path) -> None:
    _without_jax_cache(job)
    verbose = {"JAX_LOG_COMPILES": "1"}  # JAX itself logs "Persistent compilation cache hit for ..."

    # With the cache: attempt 0 compiles and writes; attempt 1 (a new process) reads.
    _kill_after_a_committed_step(job, verbose)
    written = set(_cache_objects(job))
    assert any(f"{job.prefix}/jax-cache/jit_train_step-" in o for o in written), written
    assert _train_step_keys(job.attempts[0].output(), "wrote")
    resumed = job.start(ARGS, verbose)
    assert resumed.wait(300) == [0], resumed.output()[-4000:]
    out = resumed.output()
    assert _train_step_keys(out, "hit") == _train_step_keys(job.attempts[0].output(), "wrote"), out[-4000:]
    assert "Persistent compilation cache hit for 'jit_train_step'" in out
    assert not _train_step_keys(out, "miss") and "compile cache: wrote" not in out
    assert " is damaged" not in out and "without the cache" not in out
    assert set(_cache_objects(job)) == written  # nothing new to write: every compile was a hit
    cached = job.progress()
    assert cached["state"] == "succeeded" and cached["restored_step"] is not None

    # Without the cache: the same kill and restart, compiled both times.
    plain = Job(gcs=job.gcs, base_env=job.base_env, log_dir=tmp_path / "plain", name=f"{job.name}-plain")
    plain.log_dir.mkdir()
    try:
        off = {**verbose, "TPUJOB_COMPILATION_CACHE_DIR": "off"}
        _kill_after_a_committed_step(plain, off)
        again = plain.start(ARGS, off)
        assert again.wait(300) == [0], again.output()[-4000:]
        assert "compile cache: off" in again.output()
        assert "Persistent compilation cache hit" not in again.output()
        assert _cache_objects(plain) == []
        uncached = plain.progress()
        # The same parameters, optimizer state, step and data position, bit for bit.
        assert plain.digest(STEPS) == job.digest(STEPS)
    finally:
        plain.kill_all()

    # How much faster is the benchmark's business (bench/recovery.py); here, only that it was measured.
    cached_s, uncached_s = _compile_seconds(cached), _compile_seconds(uncached)
    print(f"restore end -> first step: cached {cached_s:.2f}s, uncached {uncached_s:.2f}s")


@pytest.mark.timeout(300)
def test_several_cpu_processes_train_without_the_cache(job: Job) -> None:
    """On CPU each process looks up a key of its own (XLA's CPU topology fingerprint is in it), so
    only process 0 could hit, and it would wait at the first collective for the others to compile:
    the cache turns itself off and nothing is written. (TPU hosts share the slice's key.)"""
    _without_jax_cache(job)
    attempt = job.start(["--steps", "6", "--batch-size", "8", "--seq-len", "32"], processes=2)
    assert attempt.wait(240) == [0, 0], attempt.output(0)[-4000:]
    for index in (0, 1):
        out = attempt.output(index)
        assert "2 CPU processes look up different keys" in out, out[-4000:]
        assert "compile cache: wrote" not in out and "compile cache: hit" not in out
    assert _cache_objects(job) == []


# -- each process's own tier (TPUJOB_LOCAL_COMPILATION_CACHE_DIR: the pod's volume, kept by a restart in place)

OWN_ARGS = ["--steps", "60", "--batch-size", "8", "--seq-len", "32"]


def _own_tiers(tmp_path: Path) -> tuple[list[Path], Any]:
    dirs = [tmp_path / f"own-cache-{i}" for i in range(2)]
    return dirs, lambda i: {"TPUJOB_LOCAL_COMPILATION_CACHE_DIR": str(dirs[i])}


def _entries(directory: Path, name: str = "jit_train_step") -> list[Path]:
    return sorted(directory.glob(f"{name}-*.xc")) if directory.is_dir() else []


def _kill_once_cached(job: Job, dirs: list[Path], own: Any) -> None:
    """Attempt 0 of 2 processes trains until a step is committed and each has written its train step's
    entry to its own tier, then both are SIGKILLed (what a restart in place follows)."""
    attempt = job.start(OWN_ARGS, processes=2, process_env=own)
    attempt.wait_until(
        lambda: attempt.last_step() >= 8 and any(s >= 4 for s in job.committed_steps()) and all(map(_entries, dirs)),
        quiet=240,
    )
    attempt.signal(signal.SIGKILL)
    attempt.wait(30)
    for index in (0, 1):
        assert "compile cache: wrote jit_train_step" in attempt.output(index), attempt.output(index)[-4000:]


def _uninterrupted_without_cache(job: Job, tmp_path: Path) -> dict[str, str]:
    plain = Job(gcs=job.gcs, base_env=job.base_env, log_dir=tmp_path / "plain", name=f"{job.name}-plain")
    plain.log_dir.mkdir()
    try:
        run = plain.start(OWN_ARGS, {"TPUJOB_COMPILATION_CACHE_DIR": "off"}, processes=2)
        assert run.wait(300) == [0, 0], run.output(0)[-4000:]
        assert "compile cache: off" in run.output(1)
        return plain.digest(60)
    finally:
        plain.kill_all()


def _restart_in_place_until_it_trains(job: Job, own: Any) -> list[str]:
    """A restart in place (the same volumes) SIGKILLed once each process has logged 3 steps; its outputs."""
    attempt = job.start(OWN_ARGS, processes=2, process_env=own)
    attempt.wait_until(lambda: len(re.findall(r"^step \d+/", attempt.output(0), re.MULTILINE)) >= 3, quiet=240)
    attempt.signal(signal.SIGKILL)
    attempt.wait(30)
    return [attempt.output(index) for index in (0, 1)]


@pytest.mark.timeout(900)
def test_restarts_in_place_read_each_process_own_tier_and_a_damaged_entry_costs_every_process_a_compile(
    job: Job, tmp_path: Path
) -> None:
    """Two CPU processes (whose keys differ, so the shared cache is off), restarted in place with their
    own tiers:
    - the first restart compiles only what the killed processes had not compiled (the restore's few
      functions: attempt 0 started fresh);
    - then one process's train step entry gets bytes flipped: its check fails before any lookup, the
      processes find that their tiers differ, and both compile (one alone would reach the first
      collective while the other compiles); the fresh compile replaces the entry;
    - the last restart compiles nothing at all: every lookup hits their own entries.
    The trained state is the same bit for bit as an uninterrupted run without any cache."""
    _without_jax_cache(job)
    dirs, own = _own_tiers(tmp_path)
    _kill_once_cached(job, dirs, own)
    written = [{p.name[: -len(".xc")] for p in d.iterdir()} for d in dirs]
    assert written[0] != written[1]  # each process's own keys (XLA's CPU topology fingerprint differs)

    for index, out in enumerate(_restart_in_place_until_it_trains(job, own)):
        assert re.search(r"compile cache: hit jit_train_step-\w+ \(local", out), out[-4000:]
        missed = set(re.findall(r"compile cache: miss (\S+) \(local\)", out))
        assert not {_short_key(k) for k in written[index]} & missed, out[-4000:]
        assert " is damaged" not in out and "not read" not in out

    (entry,) = _entries(dirs[1])
    blob = bytearray(entry.read_bytes())
    for at in range(len(blob) // 2, len(blob) // 2 + 64):
        blob[at] ^= 0xFF
    entry.write_bytes(bytes(blob))
    damaged = _restart_in_place_until_it_trains(job, own)
    assert re.search(r"compile cache: entry jit_train_step-\w+ is damaged \(local", damaged[1]), damaged[1][-4000:]
    for out in damaged:
        assert "the processes' tiers differ" in out and "compile cache: hit" not in out, out[-4000:]
        assert re.search(r"compile cache: miss jit_train_step-\w+ \(local\)", out), out[-4000:]
    assert "compile cache: wrote jit_train_step" in damaged[1]  # the damaged entry replaced
    assert unframe(entry.read_bytes()) is not None
    rewritten = [{p.name for p in d.iterdir()} for d in dirs]

    last = job.start(OWN_ARGS, processes=2, process_env=own)
    assert last.wait(300) == [0, 0], last.output(0)[-4000:]
    for index in (0, 1):
        out = last.output(index)
        assert "compile cache: miss" not in out, out[-4000:]  # every compile was a lookup that hit: none ran
        assert "compile cache: wrote" not in out and " is damaged" not in out and "not read" not in out
        assert re.search(r"compile cache: local \S+: [1-9]\d* hits, 0 misses, 0 damaged, 0 writes, on", out), out[
            -3000:
        ]
    assert [{p.name for p in d.iterdir()} for d in dirs] == rewritten  # nothing new
    assert job.progress()["state"] == "succeeded" and job.progress()["restored_step"] is not None
    assert job.digest(60) == _uninterrupted_without_cache(job, tmp_path)


def _short_key(key: str) -> str:
    name, _, digest = key.rpartition("-")
    return f"{name}-{digest[:12]}"


@pytest.mark.timeout(400)
def test_damaged_entries_cost_a_recompile_and_are_replaced(job: Job) -> None:
    _without_jax_cache(job)
    args = ["--steps", "6", "--batch-size", "4", "--seq-len", "32"]
    assert job.start(args).wait(200) == [0]
    objects = _cache_objects(job)
    step_entry = next(o for o in objects if "/jit_train_step-" in o)
    whole = job.gcs.download(BUCKET, step_entry)
    job.gcs.upload(BUCKET, step_entry, whole[: len(whole) // 2])  # a truncated upload
    for name in objects:
        if name != step_entry:  # the others: garbage of the same length
            job.gcs.upload(BUCKET, name, bytes(len(job.gcs.download(BUCKET, name))))

    fresh = {"TPUJOB_RESUME_STEP": "fresh"}  # start over: compile init and the step again
    damaged = job.start(args, fresh)
    assert damaged.wait(200) == [0], damaged.output()[-4000:]
    out = damaged.output()
    assert re.search(r"compile cache: entry jit_train_step-\w+ is damaged", out), out[-4000:]
    assert "compile cache: wrote jit_train_step" in out  # the fresh compile replaced it
    # the fresh start set the committed steps aside, bytes kept, instead of deleting them
    assert f"{job.prefix}/superseded/6/commit_success.txt" in job.gcs.list_objects(BUCKET, f"{job.prefix}/superseded/")
    assert job.gcs.download(BUCKET, step_entry) != whole[: len(whole) // 2]

    healed = job.start(args, fresh)
    assert healed.wait(200) == [0], healed.output()[-4000:]
    assert "compile cache: hit jit_train_step" in healed.output() and " is damaged" not in healed.output()


@pytest.mark.timeout(300)
def test_unusable_cache_storage_only_costs_a_recompile(job: Job) -> None:
    _without_jax_cache(job)
    args = ["--steps", "4", "--batch-size", "4", "--seq-len", "32"]
    attempt = job.start(args, {"TPUJOB_COMPILATION_CACHE_DIR": "gs://no-such-bucket-tpujob/cache"})
    assert attempt.wait(200) == [0], attempt.output()[-4000:]
    out = attempt.output()
    assert "compiling without the cache for the rest of this process" in out
    assert job.progress()["state"] == "succeeded" and job.committed_steps()[-1] == 4


# -- in-process -------------------------------------------------------------------------------------


def test_cache_directory_configuration() -> None:
    run = "gs://b/ns/job"
    assert compilation_cache_dir({}, run) == "gs://b/ns/job/jax-cache"
    assert compilation_cache_dir({}, None) is None
    assert compilation_cache_dir({"TPUJOB_COMPILATION_CACHE_DIR": "off"}, run) is None
    assert compilation_cache_dir({"TPUJOB_COMPILATION_CACHE_DIR": " OFF "}, run) is None
    assert compilation_cache_dir({"TPUJOB_COMPILATION_CACHE_DIR": ""}, run) is None
    assert compilation_cache_dir({"TPUJOB_COMPILATION_CACHE_DIR": "gs://c/x/"}, run) == "gs://c/x"
    assert compilation_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/var/cache/jax"}, run) == "/var/cache/jax"
    both = {"JAX_COMPILATION_CACHE_DIR": "/var/cache/jax", "TPUJOB_COMPILATION_CACHE_DIR": "off"}
    assert compilation_cache_dir(both, run) is None
    assert parse_config([], {"TPUJOB_RUN_DIR": run + "/"}).compilation_cache_dir == "gs://b/ns/job/jax-cache"
    own = {"TPUJOB_LOCAL_COMPILATION_CACHE_DIR": "/tpujob/compile-cache/"}
    assert local_compilation_cache_dir(own) == "/tpujob/compile-cache"
    assert local_compilation_cache_dir({}) is None
    assert local_compilation_cache_dir({**own, "TPUJOB_COMPILATION_CACHE_DIR": "off"}) is None
    assert local_compilation_cache_dir({**own, "TPUJOB_COMPILATION_CACHE_DIR": "gs://c/x"}) == "/tpujob/compile-cache"
    with pytest.raises(ValueError):
        local_compilation_cache_dir({"TPUJOB_LOCAL_COMPILATION_CACHE_DIR": "gs://c/x"})


def test_the_own_tier_is_read_first_and_learns_from_the_shared_one(tmp_path: Path) -> None:
    own, shared = tmp_path / "own", tmp_path / "shared"
    key_a, key_b = "jit_a-" + "a" * 64, "jit_b-" + "b" * 64
    first = TieredCache(GuardedCache(str(own), 10, tier="local"), GuardedCache(str(shared), 10))
    assert first.get(key_a) is None
    first.put(key_a, b"A")  # process 0 (no distributed runtime here): both tiers
    first.flush(10)
    assert (own / f"{key_a}.xc").exists() and (shared / f"{key_a}.xc").exists()
    other = GuardedCache(str(shared), 10)
    other.put(key_b, b"B")  # another process 0's entry, in the shared tier only
    other.flush(10)
    (shared / f"{key_a}.xc").write_bytes(frame(b"not A"))  # the own tier answers first
    again = TieredCache(GuardedCache(str(own), 10, tier="local"), GuardedCache(str(shared), 10))
    assert again.get(key_a) == b"A" and again.get(key_b) == b"B"
    again.flush(10)
    assert unframe((own / f"{key_b}.xc").read_bytes()) == b"B"  # copied: the next restart reads it here
    assert (again.stats.hits, again.stats.writes) == (2, 1)
    assert "local " in again.summary() and "shared " in again.summary()


def test_entries_are_checked_before_jax_sees_them() -> None:
    payload = b"\x78\x9c" + bytes(range(256)) * 10
    blob = frame(payload)
    assert unframe(blob) == payload
    assert unframe(blob[:-1]) is None  # truncated
    assert unframe(blob[: len(blob) // 2]) is None
    assert unframe(blob[:-1] + bytes([blob[-1] ^ 1])) is None  # one bit flipped
    assert unframe(payload) is None  # an entry JAX's own cache wrote (no header)
    assert unframe(b"") is None
    assert unframe(frame(b"")) == b""


def test_local_writes_are_atomic_and_listed(tmp_path: Path) -> None:
    directory = str(tmp_path / "cache")
    writer = GuardedCache(directory, timeout_s=10)
    assert writer.get("jit_f-" + "0" * 64) is None  # a directory that does not exist yet: a miss
    values = {f"jit_f{i}-{hashlib.sha256(bytes([i])).hexdigest()}": bytes([i]) * 10000 for i in range(5)}
    for key, value in values.items():
        writer.put(key, value)
        writer.put(key, b"never written: the key is already being written")
    writer.flush(10)
    assert writer.stats.writes == 5
    assert sorted(p.name for p in Path(directory).iterdir()) == sorted(k + ".xc" for k in values)  # no temporaries
    reader = GuardedCache(directory, timeout_s=10)
    assert all(reader.get(k) == v for k, v in values.items())
    assert (reader.stats.hits, reader.stats.misses) == (5, 0)


def test_concurrent_writers_of_one_key_leave_a_whole_entry(tmp_path: Path) -> None:
    directory, key = str(tmp_path / "cache"), "jit_g-" + "1" * 64
    caches = [GuardedCache(directory, timeout_s=10) for _ in range(4)]
    start = threading.Barrier(len(caches))

    def write(i: int) -> None:
        start.wait()
        caches[i].put(key, bytes([i]) * 3_000_000)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(caches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for cache in caches:
        cache.flush(30)
    value = GuardedCache(directory, timeout_s=10).get(key)
    assert value is not None and len(set(value)) == 1 and len(value) == 3_000_000  # one writer's, whole
    assert [p.name for p in Path(directory).iterdir()] == [key + ".xc"]


def test_hung_storage_never_holds_a_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hang = threading.Event()

    def hung(*_: Any, **__: Any) -> Any:
        hang.wait()  # until the test ends: each call below returns while storage still hangs
        raise OSError("storage came back too late")

    try:
        listing = GuardedCache(str(tmp_path / "a"), timeout_s=0.5)
        monkeypatch.setattr(listing, "_list_keys", hung)
        assert listing.get("jit_h-" + "2" * 64) is None
        assert listing.get("jit_h-" + "3" * 64) is None  # off for the rest of the process: no new wait
        assert "off (listing" in listing.summary()

        directory = str(tmp_path / "b")
        reading = GuardedCache(directory, timeout_s=0.5)
        key = "jit_r-" + "4" * 64
        Path(directory).mkdir()
        (Path(directory) / f"{key}.xc").write_bytes(frame(b"x"))
        monkeypatch.setattr(reading, "_entry", lambda _key: type("Hung", (), {"read_bytes": hung})())
        assert reading.get(key) is None
        assert reading.stats.errors == 1

        writing = GuardedCache(str(tmp_path / "c"), timeout_s=0.5)
        monkeypatch.setattr(writing, "_write", hung)
        writing.put("jit_w-" + "5" * 64, b"y")  # returns at once: the upload is in the background
        writing.flush(60)  # returns once the write gave up (after its 0.5 s)
        assert "off (writing" in writing.summary()
        writing.put("jit_w-" + "6" * 64, b"z")  # off: not even queued
        assert writing.stats.writes == 0
    finally:
        hang.set()


def test_install_hooks_into_jax(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from jax._src import cache_key
    from jax._src import compilation_cache as jax_cc

    monkeypatch.setattr(cache_key, "custom_hook", cache_key.custom_hook)
    monkeypatch.setattr(jax_cc, "_cache", None)
    monkeypatch.setattr(jax_cc, "_cache_initialized", False)
    cache = compile_cache.install(str(tmp_path / "cache"), timeout_s=5, env={})
    assert cache is not None and jax_cc._cache is cache and jax_cc._cache_initialized
    assert cache_key.custom_hook() != ""  # on CPU the key also names the host CPU
