"""The kubelet's container-logs endpoint, served by the pod runner, so `kubectl logs` works on the
devcluster as on GKE: the apiserver proxies pods/log to the node's kubelet port over TLS.

GET /containerLogs/{namespace}/{pod}/{container}?follow=&previous=&tailLines=&limitBytes=
- the logs are the pod runner's files: <state>/pods/<namespace>/<pod>/log for the running (or last)
  container, log.previous for the one before an in-place restart (what `--previous` reads, as the
  kubelet keeps one terminated instance);
- TLS both ways, as the apiserver and a kubelet do: this server's certificate is signed by the
  devcluster CA (the apiserver's --kubelet-certificate-authority) and a client must present a
  certificate of the same CA (the apiserver's --kubelet-client-certificate);
- not served: timestamps, sinceSeconds and sinceTime (the runner keeps no per-line times; the kubelet
  would prefix or filter by them), exec, attach and port-forward.
"""

from __future__ import annotations

import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger("podrunner.logs")

LOG_FILE = "log"
PREVIOUS_LOG_FILE = "log.previous"
CONTAINER_FILE = "container"  # the name of the pod's container, written by the runner at its start
FOLLOW_POLL_SECONDS = 0.2
_PATH = re.compile(r"^/containerLogs/(?P<namespace>[^/]+)/(?P<pod>[^/]+)/(?P<container>[^/]+)$")


@dataclass(frozen=True)
class LogRequest:
    namespace: str
    pod: str
    container: str
    follow: bool = False
    previous: bool = False
    tail_lines: int | None = None
    limit_bytes: int | None = None


class BadRequest(ValueError):
    """What the kubelet answers with 400."""


def _flag(values: dict[str, list[str]], name: str) -> bool:
    return values.get(name, ["false"])[-1].lower() in ("true", "1")


def _count(values: dict[str, list[str]], name: str) -> int | None:
    if name not in values:
        return None
    try:
        number = int(values[name][-1])
    except ValueError as error:
        raise BadRequest(f"{name}: not a number: {values[name][-1]!r}") from error
    if number < 0:
        raise BadRequest(f"{name}: must not be negative")
    return number


def parse_request(target: str) -> LogRequest | None:
    """The request of a kubelet logs URL, None when the path is not the logs endpoint."""
    parts = urlsplit(target)
    match = _PATH.match(parts.path)
    if match is None:
        return None
    values = parse_qs(parts.query)
    return LogRequest(
        namespace=match["namespace"],
        pod=match["pod"],
        container=match["container"],
        follow=_flag(values, "follow"),
        previous=_flag(values, "previous"),
        tail_lines=_count(values, "tailLines"),
        limit_bytes=_count(values, "limitBytes"),
    )


def tail(data: bytes, lines: int | None) -> bytes:
    """The last `lines` lines of `data` (a last line without its newline counts as one)."""
    if lines is None:
        return data
    if lines == 0:
        return b""
    cut = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        cut = data.rfind(b"\n", 0, cut)
        if cut < 0:
            return data
    return data[cut + 1 :]


def log_file(pods_dir: Path, request: LogRequest) -> Path:
    """The file that answers `request`, or FileNotFoundError/BadRequest as the kubelet would answer."""
    directory = pods_dir / request.namespace / request.pod
    name_file = directory / CONTAINER_FILE
    if not name_file.is_file():
        raise FileNotFoundError(f'pod "{request.pod}" in namespace "{request.namespace}" not found')
    if name_file.read_text().strip() != request.container:
        raise BadRequest(f'container "{request.container}" in pod "{request.pod}" is not valid')
    if request.previous:
        previous = directory / PREVIOUS_LOG_FILE
        if not previous.is_file():
            raise BadRequest(f'previous terminated container "{request.container}" in pod "{request.pod}" not found')
        return previous
    return directory / LOG_FILE


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except FileNotFoundError:
        return None


def _read(path: Path) -> tuple[int | None, bytes]:
    """The file's inode and its bytes, from one open: a follow goes on from exactly what was read."""
    try:
        with path.open("rb") as handle:
            return os.fstat(handle.fileno()).st_ino, handle.read()
    except FileNotFoundError:
        return None, b""


def server_context(cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.load_verify_locations(client_ca)
    context.verify_mode = ssl.CERT_REQUIRED  # the apiserver's client certificate, of the cluster's CA
    return context


def serve(
    pods_dir: Path,
    port: int,
    context: ssl.SSLContext,
    running: Callable[[str, str], bool],
    stopping: threading.Event,
) -> ThreadingHTTPServer:
    """Serve the endpoint on 127.0.0.1:port from daemon threads. `running(namespace, pod)`: whether
    the pod's container still runs (a follow ends when it does not, as the kubelet's does)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _error(self, code: int, message: str) -> None:
            body = message.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            try:
                request = parse_request(self.path)
                if request is None:
                    self._error(404, "404 page not found")
                    return
                path = log_file(pods_dir, request)
            except BadRequest as error:
                self._error(400, str(error))
                return
            except FileNotFoundError as error:
                self._error(404, str(error))
                return
            inode, whole = _read(path)
            data = tail(whole, request.tail_lines)
            if request.limit_bytes is not None:
                data = data[: request.limit_bytes]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                self._chunk(data)
                if request.follow and not request.previous:
                    self._follow(path, request, inode, len(whole), len(data))
                self.wfile.write(b"0\r\n\r\n")  # the last chunk
                self.wfile.flush()
            except OSError:  # the client went (kubectl logs -f interrupted)
                return

        def _chunk(self, data: bytes) -> None:
            if data:  # an empty chunk would end the stream
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        def _follow(self, path: Path, request: LogRequest, inode: int | None, offset: int, sent: int) -> None:
            """New lines past `offset` of the file `inode` as they are written, until the container
            stops or restarts (its file moves to log.previous and a new one begins) or the server stops."""
            while not stopping.is_set():
                now = _stat(path)
                if now is not None and inode is not None and now.st_ino != inode:
                    return
                if now is not None and now.st_size > offset:
                    inode = now.st_ino
                    with path.open("rb") as handle:
                        handle.seek(offset)
                        data = handle.read(now.st_size - offset)
                    offset += len(data)
                    if request.limit_bytes is not None:
                        data = data[: max(0, request.limit_bytes - sent)]
                    self._chunk(data)
                    sent += len(data)
                    continue
                if not running(request.namespace, request.pod):
                    return
                time.sleep(FOLLOW_POLL_SECONDS)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="kubelet-logs", daemon=True).start()
    log.info("serving container logs on https://127.0.0.1:%d/containerLogs/", port)
    return server
