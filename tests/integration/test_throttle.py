"""The recovery bench's throttle in front of the real emulator: what a GCS client writes and reads
through it arrives unchanged, and no faster than its cap."""

import os
import time

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from tpujob_devcluster.fakegcs import FakeGcsServer
from tpujob_devcluster.throttle import BURST_SECONDS, ThrottledProxy

from ..conftest import TEST_BUCKET


def test_a_gcs_client_through_the_proxy_writes_and_reads_the_same_bytes_no_faster_than_its_cap(
    fake_gcs_server: FakeGcsServer, unique_name: str
) -> None:
    payload = os.urandom(1_500_000)
    rate = 3_000_000.0  # bytes per second, each way
    with ThrottledProxy(fake_gcs_server, rate) as proxy:
        client = storage.Client(
            project="tpujob-test", credentials=AnonymousCredentials(), client_options={"api_endpoint": proxy.endpoint}
        )
        blob = client.bucket(TEST_BUCKET).blob(f"{unique_name}/state")
        started = time.monotonic()
        blob.upload_from_string(payload)
        read = blob.download_as_bytes()
        elapsed = time.monotonic() - started
    assert fake_gcs_server.download(TEST_BUCKET, f"{unique_name}/state") == payload  # the emulator's own copy
    assert read == payload
    assert proxy.transferred["up"] >= len(payload) and proxy.transferred["down"] >= len(payload)
    # A lower bound only (a busy machine is slower, never faster): the upload, then the download, paced.
    assert elapsed >= 2 * len(payload) / rate - 2 * BURST_SECONDS


def test_the_proxy_refuses_a_rate_that_is_not_positive(fake_gcs_server: FakeGcsServer) -> None:
    with pytest.raises(ValueError, match="bytes_per_second"):
        ThrottledProxy(fake_gcs_server, 0)
