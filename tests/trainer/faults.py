"""Storage faults for the trainer tests: a fake-gcs-server that can be stopped and started again
(same port, same data) or hung (SIGSTOP) and resumed (SIGCONT) while trainers keep running; and a
proxy in front of one that answers chosen requests with an HTTP error (403, 503, ...).

Lives here, not in tpujob_devcluster.fakegcs, because only these tests need it; it reuses that
module's start_fake_gcs and swaps in the new process on restart.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import http.server
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpujob_devcluster.fakegcs import FakeGcsServer, start_fake_gcs


class RestartableGcs(FakeGcsServer):  # type: ignore[misc]  # mypy sees the devcluster package as untyped here
    """A FakeGcsServer whose endpoint outlives its process: stop() then start() serves the same
    objects at the same address, so trainers see an outage, not a different bucket."""

    @classmethod
    def launch(cls, root_dir: Path) -> RestartableGcs:
        first = start_fake_gcs(root_dir)
        return cls(first._process, first.port, first.root_dir, first.log_path)

    def start(self) -> None:
        """Start a new server process on the same port and data (call from the test's own thread:
        the server dies with the thread that started it)."""
        if self.running():
            return
        self._process = start_fake_gcs(self.root_dir, self.port)._process

    def hang(self) -> None:
        """The process stops answering but keeps its socket: connections open, requests stall."""
        os.kill(self.pid, signal.SIGSTOP)

    def unhang(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def hide_bucket(self, name: str) -> None:
        """Requests for the bucket's objects fail (mostly 404: the filesystem backend reads the
        disk per request) until restore_bucket(): storage that answers, but with errors that
        clients do not retry, as with revoked permissions."""
        (self.root_dir / name).rename(self.root_dir / f".{name}.hidden")

    def restore_bucket(self, name: str) -> None:
        """Put the bucket back; what the server wrote meanwhile (it recreates a directory for an
        object upload) is discarded, as if those writes had failed too."""
        # The server may recreate the directory between the rmtree and the rename: try again.
        for _ in range(100):
            shutil.rmtree(self.root_dir / name, ignore_errors=True)
            try:
                (self.root_dir / f".{name}.hidden").rename(self.root_dir / name)
                return
            except OSError as error:
                if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        raise RuntimeError(f"could not put bucket {name} back: the server keeps writing into its path")

    def stop(self) -> None:
        if self.running():
            self.unhang()  # a stopped process would ignore SIGTERM until continued
        super().stop()


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}
_GCS_REASONS = {401: "required", 403: "forbidden", 429: "rateLimitExceeded", 500: "backendError", 503: "backendError"}
Rule = Callable[[str, str], int | None]  # (method, path) -> the status to answer with, or None: forward


class FaultProxy:
    """A loopback HTTP proxy in front of a real fake-gcs-server that answers the requests a rule
    picks with a GCS-style error (403 forbidden, 429, 503, ...) and forwards the rest: what a
    revoked permission or a throttling, browning-out GCS looks like to every client the trainer
    uses (gcsfs, tensorstore), which the emulator itself cannot produce.

    Object names are read from the emulator directly (Job.gcs); point the trainer at env().
    """

    def __init__(self, upstream: FakeGcsServer):
        self.upstream = upstream
        self.rule: Rule | None = None
        self.slow: Callable[[str, str], bool] = lambda method, path: False  # the requests to hold back
        self.slow_seconds = 0.0
        self.answered: dict[int, int] = {}  # status -> how many requests got it (forwarded ones: 0)
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                if proxy.slow(self.command, self.path):
                    time.sleep(proxy.slow_seconds)
                status = proxy._pick(self.command, self.path)
                if status is not None:
                    reason = _GCS_REASONS.get(status, "error")
                    message = f"tpujob FaultProxy: {status} {reason} for {self.command} {self.path}"
                    error = {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}
                    self._reply(status, [("Content-Type", "application/json")], json.dumps({"error": error}).encode())
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    payload = response.read()
                finally:
                    conn.close()
                here, there = proxy.endpoint.encode(), proxy.upstream.endpoint.encode()
                out = [(k, v.replace(there.decode(), here.decode())) for k, v in response.getheaders()]
                self._reply(response.status, out, payload.replace(there, here))

            def _reply(self, status: int, headers: list[tuple[str, str]], payload: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in _HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up
                        self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that hung up (a retry, a killed trainer) is no test failure

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def env(self) -> dict[str, str]:
        """The emulator's environment, with every client pointed at the proxy instead."""
        return {k: v.replace(self.upstream.endpoint, self.endpoint) for k, v in self.upstream.env().items()}

    def _pick(self, method: str, path: str) -> int | None:
        with self._lock:
            status = self.rule(method, path) if self.rule else None
            if status is not None:
                self.answered[status] = self.answered.get(status, 0) + 1
            return status

    def fail(
        self, status: int, when: Callable[[str, str], bool] = lambda method, path: True, times: int | None = None
    ) -> None:
        """From now on, answer the requests `when` picks with `status`: all of them, or the next
        `times` ones (then forward again)."""
        left = [times]

        def rule(method: str, path: str) -> int | None:
            if not when(method, path) or left[0] == 0:
                return None
            if left[0] is not None:
                left[0] -= 1
            return status

        with self._lock:
            self.rule = rule

    def delay(self, seconds: float, when: Callable[[str, str], bool]) -> None:
        """From now on, hold each request `when` picks back for `seconds` before forwarding it: slow
        storage for those objects alone (each request of an upload, so a save takes at least that)."""
        self.slow_seconds, self.slow = seconds, when

    def heal(self) -> None:
        with self._lock:
            self.rule = None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
