"""Buddy copies: where no other slice holds a process's shards (a job of one slice of several hosts),
each process sends every committed local step to the next process of its slice, its buddy, which keeps
the newest ones in its own memory volume. A process whose volume is new (its node was replaced) gets
its step back from its buddy, byte for byte, and every process then restores as from its own tier.

The plan is pure (buddy_plan); the copies travel over plain TCP between the processes (the JAX
distributed runtime's key-value store hands out each process's address and a per-attempt token),
in a background thread after the step committed locally: the training loop never waits for a copy.
A copy is committed at its buddy only once all its bytes arrived (a rename, as Orbax commits a local
step), and only a step committed where it comes from is ever sent, so a restore never reads a step
that is half there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import shutil
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from tpujob.peer import slice_of_process

log = logging.getLogger("tpujob")

KEPT_DIR = "buddy"  # beside the local tier's steps: the ward's steps this process keeps
TMP_SUFFIX = ".orbax-checkpoint-tmp-buddy"  # what the local tier removes at start as half-written
TOKEN_KEY = "tpujob-buddy/token"
ADDRESS_KEY = "tpujob-buddy/address/{}"
_LENGTH = struct.Struct("!I")
_MAX_HEADER_BYTES = 16 << 20
_CHUNK_BYTES = 4 << 20
KV_TIMEOUT_MS = 60_000
SOCKET_TIMEOUT_S = 120.0  # a peer that stops sending or reading for this long is given up


def _neighbour(process: int, num_processes: int, num_slices: int, offset: int) -> int | None:
    """The process `offset` places from `process` in a ring over its slice's processes; None alone in it."""
    mine = slice_of_process(process, num_processes, num_slices)
    members = [p for p in range(num_processes) if slice_of_process(p, num_processes, num_slices) == mine]
    if len(members) < 2:
        return None
    return members[(members.index(process) + offset) % len(members)]


def buddy_of(process: int, num_processes: int, num_slices: int) -> int | None:
    """The process that keeps `process`'s copies: the next one of its slice; None alone in it."""
    return _neighbour(process, num_processes, num_slices, 1)


def ward_of(process: int, num_processes: int, num_slices: int) -> int | None:
    """The process whose copies `process` keeps: the previous one of its slice; None alone in it."""
    return _neighbour(process, num_processes, num_slices, -1)


@dataclasses.dataclass(frozen=True)
class BuddyPlan:
    step: int
    fetchers: frozenset[int]  # the processes that lack it and get it from their buddies


def buddy_plan(
    own: Sequence[Sequence[int]], kept: Sequence[Sequence[int]], buddies: Sequence[int | None], floor: int | None
) -> BuddyPlan | None:
    """The newest step at or after `floor` that every process holds in its own tier or its buddy keeps
    for it (`kept[b]`: the steps process b keeps for its ward), and that some process holds only at its
    buddy (otherwise it is an own-tier restore); None when there is none."""

    def from_buddy(p: int) -> set[int]:
        b = buddies[p]
        return set(kept[b]) if b is not None else set()

    available = [set(own[p]) | from_buddy(p) for p in range(len(own))]
    common = set.intersection(*available) if available else set()
    usable = sorted((s for s in common if floor is None or s >= floor), reverse=True)
    for step in usable:
        fetchers = frozenset(p for p in range(len(own)) if step not in own[p])
        if fetchers:
            return BuddyPlan(step, fetchers)
        return None  # every process holds the newest itself: an own-tier plan, better than any older one
    return None


def _files(root: Path) -> list[tuple[str, int]]:
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size) for p in root.rglob("*") if p.is_file())


def _safe(rel: str) -> PurePosixPath:
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"refusing the path {rel!r}")
    return path


def _send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _chunks(sock: socket.socket, size: int) -> Iterator[bytes]:
    """The next `size` bytes from the socket, as they arrive."""
    while size:
        chunk = sock.recv(min(size, _CHUNK_BYTES))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        size -= len(chunk)
        yield chunk


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    return b"".join(_chunks(sock, size))


def _receive_message(sock: socket.socket) -> dict[str, Any]:
    (size,) = _LENGTH.unpack(_receive_exactly(sock, _LENGTH.size))
    if size > _MAX_HEADER_BYTES:
        raise ValueError(f"a header of {size} bytes")
    message = json.loads(_receive_exactly(sock, size))
    if not isinstance(message, dict):
        raise ValueError("a header that is not an object")
    return message


def _send_files(sock: socket.socket, root: Path, files: Sequence[tuple[str, int]]) -> None:
    for rel, size in files:
        with open(root / rel, "rb") as f:
            if sock.sendfile(f, count=size) != size:
                raise ConnectionError(f"{rel} changed size while it was sent")


def _receive_files(sock: socket.socket, into: Path, files: Sequence[Sequence[Any]]) -> None:
    for rel, size in files:
        target = into / _safe(str(rel))
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            for chunk in _chunks(sock, int(size)):
                f.write(chunk)


def _receive_whole(sock: socket.socket, into: Path, files: Sequence[Sequence[Any]]) -> None:
    """All of `files` into `into`, or nothing left there: a copy cut short must not hold the volume."""
    shutil.rmtree(into, ignore_errors=True)
    try:
        _receive_files(sock, into, files)
    except BaseException:
        shutil.rmtree(into, ignore_errors=True)
        raise


def _commit(received: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    received.rename(final)


def committed_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else []


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(SOCKET_TIMEOUT_S)
        try:
            request = _receive_message(sock)
            self.server.keeper.serve(sock, request)
        except Exception as err:  # a bad or broken request costs that copy, never the trainer
            log.warning("buddy copies: a request from %s failed (%s)", self.client_address, err)
            with contextlib.suppress(OSError):
                _send_message(sock, {"error": str(err)})


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    keeper: Keeper


class Keeper:
    """What this process keeps for its ward (`directory`, the newest `keep` steps), served over TCP to
    requests that carry the attempt's token and the ward's identity."""

    def __init__(self, directory: Path, token: str, ward: int, ward_identity: dict[str, Any], keep: int, host: str):
        self.directory, self.token, self.ward, self.ward_identity, self.keep = (
            directory,
            token,
            ward,
            ward_identity,
            keep,
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(f"*{TMP_SUFFIX}"):
            shutil.rmtree(leftover, ignore_errors=True)
        self._lock = threading.Lock()  # one copy lands or is removed at a time
        self._server = _Server((host, 0), _Handler)
        self._server.keeper = self
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="tpujob-buddy-keeper", daemon=True)
        self._thread.start()

    def steps(self) -> list[int]:
        return committed_steps(self.directory)

    def forget_after(self, step: int | None) -> None:
        with self._lock:
            for s in self.steps():
                if step is None or s > step:
                    shutil.rmtree(self.directory / str(s))

    def _check(self, request: dict[str, Any]) -> int:
        if not secrets.compare_digest(str(request.get("token", "")), self.token):
            raise PermissionError("a request without this attempt's token")
        if request.get("ward") != self.ward or request.get("identity") != self.ward_identity:
            raise PermissionError(f"a request for another process or run than process {self.ward}'s")
        step = request.get("step")
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step {step!r}")
        return step

    def serve(self, sock: socket.socket, request: dict[str, Any]) -> None:
        step = self._check(request)
        if request.get("op") == "put":
            incoming = self.directory / f"{step}{TMP_SUFFIX}"
            _receive_whole(sock, incoming, request.get("files") or [])
            with self._lock:
                _commit(incoming, self.directory / str(step))
                for old in self.steps()[: -self.keep]:
                    shutil.rmtree(self.directory / str(old))
            _send_message(sock, {"ok": True})
        elif request.get("op") == "get":
            with self._lock:
                held = self.directory / str(step)
                if not held.is_dir():
                    raise FileNotFoundError(f"no copy of step {step} here")
                files = _files(held)
                _send_message(sock, {"files": files})
                _send_files(sock, held, files)
        else:
            raise ValueError(f"op {request.get('op')!r}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=SOCKET_TIMEOUT_S)
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def _answer(sock: socket.socket) -> dict[str, Any]:
    answer = _receive_message(sock)
    if "error" in answer:
        raise ConnectionError(f"the buddy refused: {answer['error']}")
    return answer


def put(address: str, request: dict[str, Any], step_dir: Path) -> None:
    """Send the committed step in `step_dir` to the keeper at `address`; returns once it is committed there."""
    files = _files(step_dir)
    with _connect(address) as sock:
        _send_message(sock, request | {"op": "put", "files": files})
        _send_files(sock, step_dir, files)
        _answer(sock)


def get(address: str, request: dict[str, Any], steps_dir: Path, step: int) -> Path:
    """Receive the keeper's copy of `step` into `steps_dir/<step>` (committed by a rename once whole)."""
    incoming = steps_dir / f"{step}{TMP_SUFFIX}"
    with _connect(address) as sock:
        _send_message(sock, request | {"op": "get"})
        answer = _answer(sock)
        _receive_whole(sock, incoming, answer.get("files") or [])
    final = steps_dir / str(step)
    _commit(incoming, final)
    return final


class Sender:
    """Sends this process's newest committed local step to its buddy, in a thread: offer() only notes
    the step; a step not yet committed is waited for, and a newer offer supersedes it."""

    def __init__(self, steps_dir: Path, address: Callable[[], str], request: Callable[[int], dict[str, Any]]):
        self._steps_dir, self._address, self._request = steps_dir, address, request
        self._wanted: int | None = None
        self._sending = False
        self._closed = False
        self._changed = threading.Condition()
        self.copies_sent = 0  # copies the buddy committed
        self._thread = threading.Thread(target=self._run, name="tpujob-buddy-sender", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A copy is waiting for its step to commit, or on its way: what a local save's cost includes."""
        return self._wanted is not None or self._sending

    def offer(self, step: int) -> None:
        with self._changed:
            self._wanted = step
            self._changed.notify()

    def _next(self) -> int | None:
        """The step to send once it committed here; None when closed."""
        with self._changed:
            while not self._closed:
                step = self._wanted
                if step is not None and (self._steps_dir / str(step)).is_dir():
                    self._wanted, self._sending = None, True
                    return step
                self._changed.wait(timeout=0.05 if step is not None else None)
            return None

    def _run(self) -> None:
        while (step := self._next()) is not None:
            try:
                put(self._address(), self._request(step), self._steps_dir / str(step))
                self.copies_sent += 1
            except Exception as err:  # the buddy is gone or refused: the next step is tried anew
                log.warning("buddy copies: step %d not copied to the buddy (%s)", step, err)
            finally:
                self._sending = False

    def close(self, timeout_s: float = 30.0) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join(timeout_s)


class KeyValueStore(Protocol):
    """Where the token and the keepers' addresses are handed out to every process of the attempt."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> str: ...


class _DistributedStore:
    """The JAX distributed runtime's key-value store (its coordination service)."""

    def __init__(self, client: Any):
        self._client = client

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str) -> str:
        return str(self._client.blocking_key_value_get(key, KV_TIMEOUT_MS))


def distributed_store() -> KeyValueStore | None:
    from jax._src import distributed

    client = distributed.global_state.client
    return _DistributedStore(client) if client is not None else None


def own_host() -> str:
    """The address the other processes reach this one at: the pod's own (its hostname resolves to it)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Buddies:
    """One process's part in the buddy copies: the keeper of its ward's steps and the sender of its own."""

    def __init__(
        self,
        kept_dir: Path,
        steps_dir: Path,
        store: KeyValueStore,
        me: int,
        topology: tuple[int, int],
        identities: Callable[[int], dict[str, Any]],
        keep: int,
    ):
        num_processes, num_slices = topology
        buddy, ward = buddy_of(me, *topology), ward_of(me, *topology)
        assert buddy is not None and ward is not None
        self.buddy, self.ward, self.me = buddy, ward, me
        self._buddies = [buddy_of(p, num_processes, num_slices) for p in range(num_processes)]
        self._store, self._identities, self._steps_dir = store, identities, steps_dir
        if me == 0:
            store.set(TOKEN_KEY, secrets.token_hex(32))
        self._token = store.get(TOKEN_KEY)
        self.keeper = Keeper(kept_dir, self._token, ward, identities(ward), keep, own_host())
        store.set(ADDRESS_KEY.format(me), self.keeper.address)
        self._buddy_address: str | None = None
        self.sender = Sender(steps_dir, self.buddy_address, self._request)

    def buddies(self) -> list[int | None]:
        return list(self._buddies)

    def buddy_address(self) -> str:
        if self._buddy_address is None:
            self._buddy_address = self._store.get(ADDRESS_KEY.format(self.buddy))
        return self._buddy_address

    def _request(self, step: int) -> dict[str, Any]:
        return {"token": self._token, "ward": self.me, "identity": self._identities(self.me), "step": step}

    def fetch(self, step: int) -> Path:
        """This process's copy of `step` from its buddy, committed into its own steps directory."""
        return get(self.buddy_address(), self._request(step), self._steps_dir, step)

    def close(self) -> None:
        self.sender.close()
        self.keeper.close()
