"""A bandwidth-limited TCP proxy in front of the GCS emulator, for benchmarks.

The emulator answers at loopback speed, so a restore from it costs what reading a file costs; on GKE
a restore is bound by each host's share of GCS bandwidth. `ThrottledProxy` forwards every byte both
ways unchanged and paces each direction with its own token bucket (a NIC is full duplex), shared by
all connections: the client libraries open many in parallel, and the cap is on the hosts, not on a
connection.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

from .fakegcs import FakeGcsServer

CHUNK = 64 * 1024
BURST_SECONDS = 0.05  # a bucket holds this much of a second's bytes: smooth pacing, little burst


@dataclass
class TokenBucket:
    """`rate` bytes per second, at most `rate * BURST_SECONDS` of them saved up."""

    rate: float
    tokens: float = 0.0
    stamp: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def capacity(self) -> float:
        return self.rate * BURST_SECONDS

    def reserve(self, size: int, now: float) -> float:
        """Take `size` bytes (the balance may go negative) and return how long to wait before sending them."""
        with self.lock:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            self.tokens -= size
            return max(0.0, -self.tokens / self.rate)


class ThrottledProxy:
    """Listens on a free loopback port and forwards to `upstream`'s, at most `bytes_per_second` per direction."""

    def __init__(self, upstream: FakeGcsServer, bytes_per_second: float):
        if bytes_per_second <= 0:
            raise ValueError(f"bytes_per_second must be positive, got {bytes_per_second}")
        self.upstream = upstream
        self.down = TokenBucket(bytes_per_second)  # emulator -> client (restores)
        self.up = TokenBucket(bytes_per_second)  # client -> emulator (saves)
        self.transferred = {"down": 0, "up": 0}  # bytes forwarded each way
        self._counting = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="throttled-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The emulator's environment, with every client pointed at the proxy instead."""
        return {k: v.replace(self.upstream.endpoint, self.endpoint) for k, v in self.upstream.env().items()}

    def start(self) -> ThrottledProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()

    def __enter__(self) -> ThrottledProxy:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream.port), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            threading.Thread(target=self._connection, args=(client, server), daemon=True).start()

    def _connection(self, client: socket.socket, server: socket.socket) -> None:
        upward = threading.Thread(target=self._pump, args=(client, server, self.up, "up"), daemon=True)
        upward.start()
        self._pump(server, client, self.down, "down")
        upward.join()
        client.close()
        server.close()

    def _pump(self, source: socket.socket, sink: socket.socket, bucket: TokenBucket, key: str) -> None:
        try:
            while data := source.recv(CHUNK):
                with self._counting:  # before sending: once the peer has the bytes, they are counted
                    self.transferred[key] += len(data)
                if (wait := bucket.reserve(len(data), time.monotonic())) > 0:
                    time.sleep(wait)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # The other direction may still be sending (a response after the request's end): half-close.
            for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
                with contextlib.suppress(OSError):
                    sock.shutdown(how)
