"""The real fake-gcs-server's own helpers, as the server itself reports their effect."""

import pytest
from tpujob_devcluster.fakegcs import FakeGcsServer

from ..conftest import TEST_BUCKET


def test_a_forgotten_folder_is_gone_from_the_emulators_listing_and_nothing_beside_it_is(
    fake_gcs_server: FakeGcsServer,
) -> None:
    """FakeGcsServer.forget, which the trainer and e2e tiers run after each test, as the server reports it."""
    kept, gone = "forget-test/kept/0", ["forget-test/gone/0", "forget-test/gone/1/x"]
    for name in [kept, *gone]:
        fake_gcs_server.upload(TEST_BUCKET, name, b"bytes")
    fake_gcs_server.forget(TEST_BUCKET, "forget-test/gone")
    assert fake_gcs_server.list_objects(TEST_BUCKET, "forget-test/") == [kept]
    assert fake_gcs_server.download(TEST_BUCKET, kept) == b"bytes"
    for outside in ("", "/", "forget-test/..", "../other-bucket", "forget-test/../.."):
        with pytest.raises(ValueError):
            fake_gcs_server.forget(TEST_BUCKET, outside)
    assert fake_gcs_server.list_objects(TEST_BUCKET, "forget-test/") == [kept]
