"""Real trainer processes for the tests: launch 1..N processes of one attempt, watch, kill, inspect."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_devcluster.podrunner import process_compile_cache

BUCKET = "tpujob-trainer-tests"
NAMESPACE = "tests"
DIGEST = Path(__file__).with_name("digest.py")
_STEP_LINE = re.compile(r"^step (\d+)/\d+ ", re.MULTILINE)


# One CPU device per process where a run has several, as the devcluster's pods have: XLA:CPU runs a
# cross-process collective once per local device (a 2-process step of the tiny model takes 78 ms with 2
# devices each, 17 ms with 1). A test that needs more passes its own XLA_FLAGS.
ONE_DEVICE = "--xla_force_host_platform_device_count=1"


# The session's compilation cache as each process's own tier too, one folder per process index, as the
# devcluster gives its pods (podrunner.process_compile_cache): with several CPU processes the shared tier
# turns itself off, so every start compiled again. Tests of the cache itself drop JAX_COMPILATION_CACHE_DIR,
# and with it this.
def own_compile_tier(env: dict[str, str]) -> dict[str, str]:
    """The own tier of the process whose env this is, under the session's cache; none where the env sets
    one, runs one process or has no session cache."""
    shared = env.get("JAX_COMPILATION_CACHE_DIR")
    return process_compile_cache(env, Path(f"{shared}-own")) if shared else {}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclasses.dataclass
class Attempt:
    """The processes of one attempt (one pod per process in the real JobSet)."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    files: list[IO[bytes]]

    def output(self, index: int = 0) -> str:
        return self.logs[index].read_text(errors="replace")

    def last_step(self) -> int:
        """The latest step that process 0 reported on its progress line (0 if none yet)."""
        steps = _STEP_LINE.findall(self.output(0))
        return int(steps[-1]) if steps else 0

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def signal(self, sig: signal.Signals) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def _tail(self) -> str:
        return self.output(0)[-4000:]

    def _written(self) -> int:
        return sum(log.stat().st_size if log.exists() else 0 for log in self.logs)

    def _stalled(self, since: list[float], seen: list[int], quiet: float) -> bool:
        """Whether the processes wrote nothing for `quiet` seconds (they log every step, every save and
        restore, and each compilation's start): a stall, where a slow machine is only slower."""
        written = self._written()
        if written != seen[0]:
            seen[0], since[0] = written, time.monotonic()
        return time.monotonic() - since[0] > quiet

    def wait(self, quiet: float) -> list[int]:
        """The exit codes, once every process exited; fails if they all stay silent `quiet` seconds."""
        since, seen = [time.monotonic()], [self._written()]
        try:
            while any(p.poll() is None for p in self.procs):
                if self._stalled(since, seen, quiet):
                    self.signal(signal.SIGKILL)
                    raise AssertionError(f"trainer silent for {quiet}s before exiting; output:\n{self._tail()}")
                time.sleep(0.05)
        finally:
            for f in self.files:
                f.close()
        return [int(p.returncode) for p in self.procs]

    def wait_until(self, predicate: Any, quiet: float, poll: float = 0.05) -> None:
        """Until `predicate()` holds; fails if the processes exit first or stay silent `quiet` seconds."""
        since, seen = [time.monotonic()], [self._written()]
        while not predicate():
            if not self.running():
                raise AssertionError(f"trainer exited early; output:\n{self._tail()}")
            if self._stalled(since, seen, quiet):
                raise AssertionError(f"condition not met, trainer silent for {quiet}s; output:\n{self._tail()}")
            time.sleep(poll)


@dataclasses.dataclass
class Job:
    """One TrainingJob's run directory on the emulator, and the attempts that train into it."""

    gcs: FakeGcsServer
    base_env: dict[str, str]
    log_dir: Path
    name: str
    attempts: list[Attempt] = dataclasses.field(default_factory=list)

    @property
    def prefix(self) -> str:
        return f"{NAMESPACE}/{self.name}"

    @property
    def run_dir(self) -> str:
        return f"gs://{BUCKET}/{self.prefix}"

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.run_dir}/checkpoints"

    def env(self, **overrides: str) -> dict[str, str]:
        return {
            **self.base_env,
            "TPUJOB_RUN_DIR": self.run_dir,
            "TPUJOB_NAME": self.name,
            "TPUJOB_NAMESPACE": NAMESPACE,
            "TPUJOB_ATTEMPT": str(len(self.attempts)),
            **overrides,
        }

    def start(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        processes: int = 1,
        slices: int = 1,
        coordinator: str | None = None,
        only: Sequence[int] | None = None,
        process_env: Callable[[int], dict[str, str]] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "tpujob_trainer"),
    ) -> Attempt:
        """Launch one attempt: `processes` trainer processes laid out as `slices` equal slices, serving
        or dialing `coordinator` (default: a free loopback port); `only` starts just those processes;
        `process_env(index)` adds to one process's environment (its own node's paths, say); `command`
        is the program each process runs with `args` (default: the built-in trainer)."""
        common = self.env(**(env or {}))
        hosts_per_slice = processes // slices
        if processes > 1:
            if "XLA_FLAGS" not in (env or {}):
                common["XLA_FLAGS"] = ONE_DEVICE
            common |= {
                "TPUJOB_COORDINATOR_ADDRESS": coordinator or f"127.0.0.1:{free_port()}",
                "TPUJOB_NUM_SLICES": str(slices),
                "TPUJOB_HOSTS_PER_SLICE": str(hosts_per_slice),
            }
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        files: list[IO[bytes]] = []
        for index in range(processes) if only is None else only:
            log = self.log_dir / f"attempt{len(self.attempts)}-process{index}.log"
            out = log.open("wb")
            placed = {
                **common,
                "TPUJOB_SLICE_ID": str(index // hosts_per_slice),
                "JOB_COMPLETION_INDEX": str(index % hosts_per_slice),
            }
            procs.append(
                subprocess.Popen(
                    [*command, *args],
                    env=placed | own_compile_tier(placed) | (process_env(index) if process_env else {}),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
            logs.append(log)
            files.append(out)
        attempt = Attempt(procs, logs, files)
        self.attempts.append(attempt)
        return attempt

    def kill_all(self) -> None:
        for attempt in self.attempts:
            attempt.signal(signal.SIGKILL)
            for p in attempt.procs:
                p.wait()

    def objects(self) -> list[str]:
        return self.gcs.list_objects(BUCKET, f"{self.prefix}/checkpoints/")

    def step_dirs(self) -> dict[int, bool]:
        """{step: committed} for every step directory in the bucket (committed = has the marker)."""
        dirs: dict[int, bool] = {}
        for name in self.objects():
            parts = name[len(self.prefix) + 1 :].split("/")
            if len(parts) >= 3 and parts[1].isdigit():
                step = int(parts[1])
                dirs[step] = dirs.get(step, False) or parts[2:] == ["commit_success.txt"]
        return dirs

    def committed_steps(self) -> list[int]:
        return sorted(step for step, done in self.step_dirs().items() if done)

    def progress(self) -> dict[str, Any]:
        record: dict[str, Any] = json.loads(self.gcs.download(BUCKET, f"{self.prefix}/progress.json"))
        return record

    def metadata(self, step: int) -> dict[str, Any]:
        raw = self.gcs.download(BUCKET, f"{self.prefix}/checkpoints/{step}/_CHECKPOINT_METADATA")
        record: dict[str, Any] = json.loads(raw)
        return record

    def digest(self, step: int, npz: Path | None = None) -> dict[str, str]:
        """sha256 of every leaf of the checkpointed state at `step` (params, optimizer, step, data);
        `npz`: also write the leaves there (np.load), keyed by the same paths."""
        out = subprocess.run(
            [sys.executable, str(DIGEST), self.checkpoint_dir, str(step), *([str(npz)] if npz else [])],
            env=self.base_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, f"digest of step {step} failed: {out.stderr[-3000:]}"
        result: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
        return result
