"""A persistent JAX compilation cache in two tiers, so a restarted process does not compile again.

Where: the shared tier (config.compilation_cache_dir) is `$TPUJOB_COMPILATION_CACHE_DIR` if set
(empty or `off` turns both tiers off), else `$JAX_COMPILATION_CACHE_DIR` (a cache the user
configured for JAX itself), else `$TPUJOB_RUN_DIR/jax-cache`; gs:// or a local path. The process's
own tier (config.local_compilation_cache_dir) is `$TPUJOB_LOCAL_COMPILATION_CACHE_DIR`, a local
path: the operator mounts an emptyDir there in InPlace jobs, which a restart in place keeps (a new
pod starts it empty). A lookup reads the own tier first, then the shared one (a shared hit is copied
into the own tier); a compile writes to both (TieredCache).

Why every attempt and every host may share one directory (JAX 0.10.2, jax/_src/cache_key.py): an
entry's key is a sha256 of the computation (StableHLO without debug info), the jaxlib version,
the platform and its version, the XLA flags, the compile options (including the global device
assignment) and the accelerator topology's fingerprint. A new attempt of the same job on other
hosts of the same slice shape computes the same key; anything that would change the executable
(model, batch, mesh, jax version, flags) changes it. Only JAX process 0 writes entries
(jax/_src/compiler.py, `_cache_write`), so one attempt has one writer. On TPU the topology is the
slice's, the same on every host, so every host reads process 0's entries (JAX's documented
multi-host set-up). On the CPU stand-in (tests, devcluster) XLA's CPU topology fingerprint differs
per process, so only process 0 could hit while the others compile, which skews the first step's
collectives past gloo's patience: with several CPU processes the cache turns itself off (one CPU
process, as in the devcluster's one-host slices, uses it). And since an XLA:CPU executable is
native code for the host CPU, which the key does not cover, this module adds the host CPU's model
and feature flags to the key on CPU (JAX's `custom_hook`).

The own tier works on CPU and TPU alike: XLA's CPU fingerprint differs per process but not between
restarts of one process (its process index and devices), so a process restarted in place computes
the keys it wrote. For every process to write its own entries, JAX's `_cache_write` (process 0
only) is widened to the others (`_every_process_writes`, with JAX's other rules kept); the shared
tier is still written by process 0 alone. With several CPU processes, whose first collective gloo
would time out while one of them compiles what the others read, the processes first compare which
functions their own tiers hold, each entry checked (JAX's key-value store, `GuardedCache._agree`):
a tier is read only where every process holds the same ones (a new pod among restarted ones, a
damaged or missing entry: every process compiles, as without the tier, and writes what it lacks).

What this module adds to JAX's own file cache (jax/_src/lru_cache.py), which it replaces through
the one hook JAX has for it (`jax._src.compilation_cache._cache`), in each tier (a GuardedCache):
- every storage call runs in a daemon thread with a deadline (TPUJOB_STORAGE_TIMEOUT_SECONDS):
  GCS clients retry an unreachable endpoint for about 30 s and a hung server forever, and a
  compile must never wait on that. The first storage error or timeout turns the cache off for the
  rest of the process: an outage costs one recompile, never a stop;
- one listing of the directory (started as soon as storage is known to answer, in parallel with
  the restore) answers misses, instead of one storage round trip per compiled function;
- an entry is `MAGIC + sha256(payload) + payload` and is checked before JAX sees it: a truncated,
  corrupt or foreign object is a miss (logged), and the fresh compile's entry replaces it;
- writes are whole objects: on gs:// an object upload is atomic; on a filesystem the entry is
  written to a unique temporary name and renamed, so concurrent writers (two attempts that
  overlap while the old pods terminate) and a writer killed mid-way never leave a partial entry;
- writes happen in a background thread, after the compile, so the first step does not wait for
  the upload (an entry lost to a kill is written again by the next attempt).

The executable is the same binary whether it was compiled or read: training is bit-identical
with and without the cache (tests/trainer/test_compile_cache.py checks the parameters).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import platform
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
from etils import epath
from jax._src import cache_key as jax_cache_key
from jax._src import compilation_cache as jax_cc
from jax._src import compiler as jax_compiler
from jax._src import config as jax_config
from jax._src import distributed as jax_distributed
from jax._src.compilation_cache_interface import CacheInterface

from tpujob.bounded import bounded

log = logging.getLogger("tpujob")

MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
SUFFIX = ".xc"
MAGIC = b"tpujob-xc1\n"
_DIGEST = 32
AGREE_TIMEOUT_S = 20.0  # at most (and at most half the storage deadline): the processes' wait for each other's tiers


def frame(payload: bytes) -> bytes:
    return MAGIC + hashlib.sha256(payload).digest() + payload


def unframe(blob: bytes) -> bytes | None:
    """The payload of a whole, intact entry; None for anything else (truncated, corrupt, foreign)."""
    head = len(MAGIC) + _DIGEST
    if len(blob) < head or not blob.startswith(MAGIC):
        return None
    payload = blob[head:]
    return payload if hashlib.sha256(payload).digest() == blob[len(MAGIC) : head] else None


@dataclasses.dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    errors: int = 0


class GuardedCache(CacheInterface):
    """JAX's CacheInterface over a directory (gs:// or local) that can only ever cost a recompile."""

    def __init__(self, directory: str, timeout_s: float, tier: str = "shared"):
        self.directory = directory
        self.tier = tier  # "shared" (the run directory's: platform rules apply) or "local" (this process's own)
        self._path = epath.Path(directory)  # type: ignore[assignment]  # JAX reads it for its logs
        self.timeout_s = timeout_s
        self.stats = Stats()
        self._lock = threading.Lock()
        self._listed = threading.Event()
        self._listing_started = False
        self._present: set[str] = set()  # keys in storage (listed, or written by this process)
        self._bad: set[str] = set()  # keys whose stored entry failed its check: a put replaces them
        self._disabled: str | None = None  # why the cache is off for the rest of this process
        self._unread: str | None = None  # why its entries are not read (they are still written)
        self._writes: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    # -- the directory listing ---------------------------------------------------------------------
    def prefetch(self) -> None:
        """List the directory in the background (call once storage answers; get() starts it otherwise)."""
        with self._lock:
            if self._listing_started:
                return
            self._listing_started = True
        if self.tier == "shared" and (why := self._platform_rules_out()) is not None:
            self._disable(why, error=False)
            self._listed.set()
            return
        threading.Thread(target=self._list, name="tpujob-compile-cache-list", daemon=True).start()

    def _list(self) -> None:
        started = time.monotonic()
        try:
            keys = bounded(self._list_keys, self.timeout_s, f"listing {self.directory}")
        except Exception as err:
            self._disable(f"listing failed: {type(err).__name__}: {err}")
        else:
            with self._lock:
                self._present |= keys
            log.info(
                "compile cache: %s holds %d entries (listed in %.2fs)",
                self.directory, len(keys), time.monotonic() - started,
            )  # fmt: skip
            if self.tier == "local":
                self._agree(keys)
        finally:
            self._listed.set()

    def _list_keys(self) -> set[str]:
        path = epath.Path(self.directory)
        try:
            names = [p.name for p in path.iterdir()]
        except FileNotFoundError:
            return set()
        return {n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX)}

    @staticmethod
    def _platform_rules_out() -> str | None:
        """On CPU, XLA's topology fingerprint (part of the key) differs per process, so with several
        processes only process 0 could hit: it would reach the first step's collectives while the
        others still compile, and gloo gives up waiting for its peers after a while (the multi-process
        devcluster demo deadlocked so). Hits there cannot shorten the step anyway: it waits for the
        slowest process, which compiles. TPU hosts share the slice's topology, hence the key."""
        if jax.process_count() > 1 and jax.default_backend() == "cpu":
            return f"{jax.process_count()} CPU processes look up different keys (see compile_cache.py)"
        return None

    def _agree(self, keys: set[str]) -> None:
        """CPU processes whose own tiers differ would compile different functions (a new pod beside pods
        restarted in place): the ones that hit would reach the first collective while the others compile,
        past gloo's patience. So with several CPU processes each tells the others which functions its
        tier holds (JAX's key-value store), and the tier is read only where every process holds the same
        ones; otherwise every process compiles (and writes), as without the tier. TPU processes need no
        agreement (a miss here is a hit in the shared cache, whose key is the slice's). Each entry is
        checked first (a local read), so a damaged one also makes every process compile, not this one alone."""
        if jax.process_count() <= 1 or jax.default_backend() != "cpu":
            return
        whole = {k for k in keys if self._intact(k)}
        names = sorted(k.rpartition("-")[0] for k in whole)  # the hash part of a CPU key differs per process
        mine = f"{len(names)}:{hashlib.sha256(chr(10).join(names).encode()).hexdigest()[:16]}"
        try:
            client = jax_distributed.global_state.client
            if client is None:
                raise RuntimeError("JAX's distributed runtime is not started")
            client.key_value_set(f"tpujob/compile-cache/{jax.process_index()}", mine)
            wait_ms = int(min(self.timeout_s / 2, AGREE_TIMEOUT_S) * 1000)
            theirs = [
                client.blocking_key_value_get(f"tpujob/compile-cache/{i}", wait_ms) for i in range(jax.process_count())
            ]
        except Exception as err:
            why = f"the processes could not compare their tiers ({type(err).__name__}: {err})"
        else:
            if len(set(theirs)) == 1:
                return
            why = f"the processes' tiers differ ({', '.join(theirs)})"
        with self._lock:
            self._unread = why
        log.warning("compile cache: %s: not read by this attempt, every process compiles", why)

    def _intact(self, key: str) -> bool:
        try:
            blob = bounded(self._entry(key).read_bytes, self.timeout_s, f"reading {_short(key)}")
        except Exception as err:
            log.warning(
                "compile cache: reading %s (%s) failed: %s: %s", _short(key), self.tier, type(err).__name__, err
            )
            blob = b""
        if unframe(blob) is not None:
            return True
        with self._lock:
            self._bad.add(key)
            self.stats.corrupt += 1
        log.warning(
            "compile cache: entry %s is damaged (%s, %d bytes); compiling it again", _short(key), self.tier, len(blob)
        )
        return False

    def _disable(self, why: str, error: bool = True) -> None:
        with self._lock:
            if self._disabled is not None:
                return
            self._disabled = why
            self.stats.errors += int(error)
        log.warning("compile cache: %s; compiling without the cache for the rest of this process", why)

    # -- CacheInterface ----------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        self.prefetch()
        if not self._listed.wait(self.timeout_s):
            self._disable(f"listing {self.directory} did not answer within {self.timeout_s:g}s")
        with self._lock:
            if self._disabled is not None:
                return None
            present = key in self._present and key not in self._bad and self._unread is None
        if not present:
            with self._lock:
                self.stats.misses += 1
            log.info("compile cache: miss %s (%s)", _short(key), self.tier)
            return None
        started = time.monotonic()
        try:
            blob = bounded(self._entry(key).read_bytes, self.timeout_s, f"reading {_short(key)}")
        except FileNotFoundError:
            with self._lock:
                self._present.discard(key)
                self.stats.misses += 1
            log.info("compile cache: miss %s (%s: listed, then gone)", _short(key), self.tier)
            return None
        except Exception as err:
            self._disable(f"reading {_short(key)} failed: {type(err).__name__}: {err}")
            return None
        payload = unframe(blob)
        with self._lock:
            if payload is None:
                self._bad.add(key)
                self.stats.corrupt += 1
            else:
                self.stats.hits += 1
        if payload is None:
            log.warning(
                "compile cache: entry %s is damaged (%s, %d bytes); compiling it again",
                _short(key),
                self.tier,
                len(blob),
            )
            return None
        took = time.monotonic() - started
        log.info("compile cache: hit %s (%s, %d bytes, read in %.2fs)", _short(key), self.tier, len(blob), took)
        return payload

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            if self._disabled is not None or (key in self._present and key not in self._bad):
                return
            self._present.add(key)
            self._bad.discard(key)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="tpujob-compile-cache-write", daemon=True)
                self._writer.start()
        self._writes.put((key, frame(value)))

    # -- writes --------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            key, blob = item
            try:
                if self._disabled is None:
                    started = time.monotonic()
                    bounded(functools.partial(self._write, key, blob), self.timeout_s, f"writing {_short(key)}")
                    with self._lock:
                        self.stats.writes += 1
                    took = time.monotonic() - started
                    log.info("compile cache: wrote %s (%s, %d bytes in %.2fs)", _short(key), self.tier, len(blob), took)
            except Exception as err:
                self._disable(f"writing {_short(key)} failed: {type(err).__name__}: {err}")
            finally:
                self._writes.task_done()

    def _write(self, key: str, blob: bytes) -> None:
        target = self._entry(key)
        if self.directory.startswith("gs://"):  # one object upload: whole or absent
            target.write_bytes(blob)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
        temporary.write_bytes(blob)
        os.replace(temporary, target)  # atomic on one filesystem: readers see no entry or a whole one

    def _entry(self, key: str) -> epath.Path:
        return epath.Path(self.directory) / f"{key}{SUFFIX}"

    def flush(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for the writes already asked for, e.g. before a clean exit."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)

    def summary(self) -> str:
        s = self.stats
        state = f"off ({self._disabled})" if self._disabled else f"not read ({self._unread})" if self._unread else "on"
        counts = f"{s.hits} hits, {s.misses} misses, {s.corrupt} damaged, {s.writes} writes"
        return f"{self.tier} {self.directory}: {counts}, {state}"


class TieredCache(CacheInterface):
    """This process's own tier (the pod's volume, which a restart in place keeps), then the shared one.

    A key found in neither is compiled and written to both, though to the shared tier by process 0 only
    (JAX's one writer: `_cache_write` is only widened to the other processes for the own tier); an entry
    read from the shared tier is copied into the own tier, so the next restart in place reads it there."""

    def __init__(self, local: GuardedCache | None, shared: GuardedCache | None):
        self.tiers = [t for t in (local, shared) if t is not None]
        assert self.tiers, "a tiered cache needs a tier"
        self.local, self.shared = local, shared
        self._path = self.tiers[-1]._path  # JAX reads it for its logs

    def prefetch(self) -> None:
        for tier in self.tiers:
            tier.prefetch()

    def get(self, key: str) -> bytes | None:
        if self.local is not None and (value := self.local.get(key)) is not None:
            return value
        if self.shared is None or (value := self.shared.get(key)) is None:
            return None
        if self.local is not None:
            self.local.put(key, value)
        return value

    def put(self, key: str, value: bytes) -> None:
        if self.local is not None:
            self.local.put(key, value)
        if self.shared is not None and _process_id() == 0:
            self.shared.put(key, value)

    def flush(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for tier in self.tiers:
            tier.flush(max(0.0, deadline - time.monotonic()))

    def summary(self) -> str:
        return "; ".join(tier.summary() for tier in self.tiers)

    @property
    def stats(self) -> Stats:
        """The tiers' counts added up (a key missed in the own tier and hit in the shared one counts both)."""
        fields = [f.name for f in dataclasses.fields(Stats)]
        return Stats(**{f: sum(getattr(t.stats, f) for t in self.tiers) for f in fields})


def _process_id() -> int:
    return int(jax_distributed.global_state.process_id or 0)


_CACHE_WRITE_PARAMETERS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]


def _every_process_writes(original: Callable[..., None]) -> Callable[..., None]:
    """JAX's `_cache_write` (jax/_src/compiler.py), which returns at once on any process but 0, widened
    to every process with JAX's other rules kept (no host callbacks, the minimum compile time); the
    TieredCache sends a non-zero process's entries to its own tier only."""

    @functools.wraps(original)
    def cache_write(
        cache_key: str,
        compile_time_secs: float,
        module_name: str,
        backend: Any,
        executable: Any,
        host_callbacks: Any,
    ) -> None:
        if _process_id() == 0:
            original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
            return
        if host_callbacks or compile_time_secs < jax_config.persistent_cache_min_compile_time_secs.value:
            return
        try:
            jax_cc.put_executable_and_time(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as err:  # as JAX's own: a failed write is a warning, never the compile's failure
            log.warning("compile cache: writing %s failed: %s: %s", module_name, type(err).__name__, err)

    cache_write.tpujob_original = original  # type: ignore[attr-defined]
    return cache_write


def _widen_cache_write() -> bool:
    """Make every process write its entries (for its own tier); False where this JAX's `_cache_write`
    is not the one this was written against (then only process 0's own tier fills)."""
    current = getattr(jax_compiler, "_cache_write", None)
    if current is None:
        return False
    if hasattr(current, "tpujob_original"):
        return True
    try:
        parameters = list(inspect.signature(current).parameters)
    except (TypeError, ValueError):
        return False
    if parameters != _CACHE_WRITE_PARAMETERS:
        return False
    jax_compiler._cache_write = _every_process_writes(current)
    return True


def _short(key: str) -> str:
    """module name and the first 12 hex digits of the hash: enough to tell entries apart in logs."""
    name, _, digest = key.rpartition("-")
    return f"{name}-{digest[:12]}" if name else key[:40]


def _cpu_identity() -> str:
    """The host CPU's model and feature flags (Linux), which an XLA:CPU executable depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    wanted = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return hashlib.sha256("\n".join(sorted(set(wanted))).encode()).hexdigest()


def _key_hook() -> str:
    return _cpu_identity() if jax.default_backend() == "cpu" else ""


def install(
    directory: str | None,
    timeout_s: float,
    env: Mapping[str, str] = os.environ,
    local_directory: str | None = None,
) -> TieredCache | None:
    """Make JAX use the cache: this process's own tier in `local_directory` (None: none), then the shared
    one in `directory` (None: none); neither: no persistent cache at all, JAX's own included.

    Call before the first compile. Entries of every compile time are written (unless the user set
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS): on a restart even a small compile costs more than
    reading its entry, and the directory listing makes a miss free.
    """
    if directory is None and local_directory is None:
        jax.config.update("jax_enable_compilation_cache", False)  # type: ignore[no-untyped-call]
        log.info("compile cache: off")
        return None
    hooks = [(jax_cc, "_cache"), (jax_cc, "_cache_initialized"), (jax_cc, "_cache_initialized_mutex")]
    if not all(hasattr(module, name) for module, name in [*hooks, (jax_cache_key, "custom_hook")]):
        log.warning("compile cache: this JAX (%s) has no cache hook; compiling without the cache", jax.__version__)
        jax.config.update("jax_enable_compilation_cache", False)  # type: ignore[no-untyped-call]
        return None
    if MIN_COMPILE_TIME_ENV not in env:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # type: ignore[no-untyped-call]
    local = GuardedCache(local_directory, timeout_s, tier="local") if local_directory else None
    shared = GuardedCache(directory, timeout_s) if directory else None
    if local is not None and not _widen_cache_write():
        why = "writes from process 0 only: the other processes' own tiers stay empty"
        log.warning("compile cache: this JAX (%s) %s", jax.__version__, why)
    cache = TieredCache(local, shared)
    jax_cache_key.custom_hook = _key_hook  # JAX's own extension point of the key
    with jax_cc._cache_initialized_mutex:
        jax_cc._cache = cache
        jax_cc._cache_initialized = True  # JAX's own initialisation (its LRUCache) never runs
    log.info("compile cache: %s", ", then ".join(f"{t.tier} {t.directory}" for t in cache.tiers))
    return cache
