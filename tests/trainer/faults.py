"""Storage faults for the trainer tests: a fake-gcs-server that can be stopped and started again
(same port, same data) or hung (SIGSTOP) and resumed (SIGCONT) while trainers keep running.

Lives here, not in tpujob_devcluster.fakegcs, because only these tests need it; it reuses that
module's start_fake_gcs and swaps in the new process on restart.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

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
        shutil.rmtree(self.root_dir / name, ignore_errors=True)
        (self.root_dir / f".{name}.hidden").rename(self.root_dir / name)

    def stop(self) -> None:
        if self.running():
            self.unhang()  # a stopped process would ignore SIGTERM until continued
        super().stop()
