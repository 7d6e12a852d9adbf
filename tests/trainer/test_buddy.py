"""Buddy copies (issue 34 item 1, one slice): each host of a slice keeps the next host's newest local
steps, so a host whose memory volume is new gets its step back from its buddy, not from GCS.

The plan is pure; the keeper is a real TCP server in this process; the restore runs real trainer
processes (CPU JAX, gloo) against the real GCS emulator, and its truth is an uninterrupted run's bits
and a step the bucket never had.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
from pathlib import Path

import pytest
from tpujob import buddy, local_tier
from tpujob_devcluster.fakegcs import FakeGcsServer

from tests.trainer.test_local_tier import ARGS, GCS_EVERY_10, M, _reference_and_interrupted, _restored, _start_two
from tests.trainer.test_local_tier import local_steps as own_steps

IDENTITY = {"run_dir": "gs://b/run", "uid": "u", "process_index": 1}


def test_each_host_of_a_slice_keeps_the_next_ones_steps_and_a_lone_host_has_no_buddy() -> None:
    assert [buddy.buddy_of(p, 4, 1) for p in range(4)] == [1, 2, 3, 0]
    assert [buddy.ward_of(p, 4, 1) for p in range(4)] == [3, 0, 1, 2]
    assert [buddy.buddy_of(p, 4, 2) for p in range(4)] == [1, 0, 3, 2]  # within its own slice
    assert [buddy.buddy_of(p, 2, 2) for p in range(2)] == [None, None]
    assert buddy.ward_of(0, 1, 1) is None


def test_the_buddy_plan_is_the_newest_step_every_process_holds_itself_or_at_its_buddy() -> None:
    ring = [1, 0]
    # Process 1's volume is new; process 0 keeps its step 8: both restore 8, process 1 fetching.
    assert buddy.buddy_plan([[6, 8], []], [[6, 8], [6, 8]], ring, None) == buddy.BuddyPlan(8, frozenset({1}))
    # Process 0 keeps only step 6 of process 1's (8 was not sent yet): 6.
    assert buddy.buddy_plan([[6, 8], []], [[6], [6, 8]], ring, None) == buddy.BuddyPlan(6, frozenset({1}))
    # Not older than GCS's choice.
    assert buddy.buddy_plan([[6, 8], []], [[6], [6, 8]], ring, 7) is None
    # Both hold the newest themselves: an own-tier plan, no buddy plan (even an older one).
    assert buddy.buddy_plan([[6, 8], [6, 8]], [[6, 8], [6, 8]], ring, None) is None
    # Each lost a different step: each fetches what it lacks.
    assert buddy.buddy_plan([[8], [6]], [[6, 8], [6, 8]], ring, None) == buddy.BuddyPlan(8, frozenset({1}))
    # Nobody keeps anything for process 1: nothing.
    assert buddy.buddy_plan([[6, 8], []], [[], [6, 8]], ring, None) is None


def _step_dir(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


@pytest.fixture
def keeper(tmp_path: Path):  # type: ignore[no-untyped-def]
    kept = buddy.Keeper(tmp_path / "kept", "secret", 1, IDENTITY, keep=2, host="127.0.0.1")
    yield kept
    kept.close()


def _request(step: int, **overrides: object) -> dict[str, object]:
    return {"token": "secret", "ward": 1, "identity": IDENTITY, "step": step} | overrides


def test_a_kept_step_comes_back_byte_for_byte_and_only_the_newest_two_are_kept(keeper: buddy.Keeper, tmp_path: Path):
    files = {"d/ocdbt.process_0/manifest": b"m" * 5, "_METADATA": bytes(range(256)) * 4096}
    for step in (2, 4, 6):
        buddy.put(keeper.address, _request(step), _step_dir(tmp_path / f"own-{step}", files))
    assert keeper.steps() == [4, 6]
    steps = tmp_path / "replaced" / "checkpoints"
    steps.mkdir(parents=True)
    got = buddy.get(keeper.address, _request(6), steps, 6)
    assert got == steps / "6" and {rel: (got / rel).read_bytes() for rel in files} == files
    assert [p.name for p in steps.iterdir()] == ["6"]  # no half-written directory beside it
    keeper.forget_after(4)
    assert keeper.steps() == [4]


@pytest.mark.parametrize(
    "wrong",
    [{"token": "guess"}, {"ward": 0}, {"identity": IDENTITY | {"uid": "another job"}}, {"step": -1}],
    ids=["token", "ward", "identity", "step"],
)
def test_a_request_without_the_token_or_for_another_ward_is_refused_and_writes_nothing(
    keeper: buddy.Keeper, tmp_path: Path, wrong: dict[str, object]
) -> None:
    own = _step_dir(tmp_path / "own", {"f": b"x"})
    with pytest.raises(ConnectionError, match="the buddy refused"):
        buddy.put(keeper.address, _request(2) | wrong, own)
    buddy.put(keeper.address, _request(2), own)
    with pytest.raises(ConnectionError, match="the buddy refused"):
        buddy.get(keeper.address, _request(2) | wrong, tmp_path, 2)
    assert keeper.steps() == [2] and sorted(p.name for p in keeper.directory.iterdir()) == ["2"]


def _raw_put(address: str, request: dict[str, object], body: bytes) -> bytes:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        header = json.dumps(request | {"op": "put"}).encode()
        sock.sendall(len(header).to_bytes(4, "big") + header + body)
        # A keeper that refuses the header answers and closes with the body unread: its reset may come
        # first (ENOTCONN here); the answer it sent before is still in this socket's queue.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        return sock.recv(1 << 16)


def test_a_copy_cut_short_or_naming_a_path_outside_is_never_committed(keeper: buddy.Keeper, tmp_path: Path) -> None:
    # Ten bytes announced, four sent, then the sender is gone (its node, say).
    _raw_put(keeper.address, _request(2, files=[["f", 10]]), b"abcd")
    answer = _raw_put(keeper.address, _request(4, files=[["../../escaped", 1]]), b"x")
    assert b"refusing the path" in answer
    assert keeper.steps() == [] and not (tmp_path / "escaped").exists()
    assert list(keeper.directory.iterdir()) == []  # nothing half-received holds the volume


@pytest.mark.timeout(300)
def test_a_host_whose_memory_volume_is_new_gets_its_newest_step_from_its_buddy_not_from_gcs(
    gcs: FakeGcsServer, trainer_env: dict[str, str], tmp_path: Path, run_name: str
) -> None:
    """One slice of two processes: each holds only its own shards. Process 1's node is replaced between
    two attempts (its volume is new). Process 0 kept process 1's newest step, which GCS never had: both
    restore it (process 1 from its buddy, process 0 from its own tier) and the run ends on the bits of
    an uninterrupted one."""
    reference, job = _reference_and_interrupted(gcs, trainer_env, tmp_path, run_name)
    dirs = [tmp_path / "local-0", tmp_path / "local-1"]
    kept_by_0 = dirs[0] / buddy.KEPT_DIR / local_tier.STEPS_DIR
    try:
        uninterrupted = reference.start(ARGS, GCS_EVERY_10, processes=2, slices=1)
        attempt = _start_two(job, dirs)

        def ahead() -> list[int]:
            """Steps past GCS's latest that process 0 holds itself and keeps for process 1."""
            committed = job.committed_steps()
            both = set(own_steps(dirs[0])) & set(buddy.committed_steps(kept_by_0))
            return sorted(s for s in both if committed and s > committed[-1])

        while True:  # frozen for the check (SIGSTOP), as _kill_ahead_of_gcs does
            attempt.wait_until(lambda: bool(ahead()), quiet=120, poll=0.02)
            attempt.signal(signal.SIGSTOP)
            if found := ahead():
                break
            attempt.signal(signal.SIGCONT)
        attempt.signal(signal.SIGKILL)
        attempt.wait(30)
        newest = found[-1]
        assert uninterrupted.wait(180) == [0, 0]
        shutil.rmtree(dirs[1])  # a new, empty memory volume

        resumed = _start_two(job, dirs)
        assert resumed.wait(180) == [0, 0], resumed.output(0) + resumed.output(1)
        assert newest not in job.committed_steps()  # no byte of it could come from the bucket
        assert _restored(job) == ("peer", newest), resumed.output(0)
        assert f"resume: step {newest}: processes [1] receive their copies from their buddies" in resumed.output(1)
        assert job.digest(M) == reference.digest(M)
        # Each keeps the other's newest steps again: process 1 kept process 0's after its volume was new.
        assert buddy.committed_steps(dirs[1] / buddy.KEPT_DIR / local_tier.STEPS_DIR)
    finally:
        reference.kill_all()
        job.kill_all()
