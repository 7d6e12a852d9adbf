import pytest
import tpujob_contract as contract
from tpujob_operator.checkpoints import split_gs_path, step_candidates


def test_only_digit_step_directories_are_candidates_newest_first():
    prefix = "runs/ml/llama/checkpoints/"
    prefixes = [f"{prefix}{p}/" for p in ("100", "20", "300.orbax-checkpoint-tmp-1712", "abc", "1000")] + ["other/5/"]
    assert step_candidates(prefix, prefixes) == [1000, 100, 20]


@pytest.mark.parametrize(
    ("path", "bucket", "prefix"),
    [("gs://b/runs/ml/x", "b", "runs/ml/x"), ("gs://b", "b", ""), ("gs://b/a/", "b", "a")],
)
def test_split_gs_path(path, bucket, prefix):
    assert split_gs_path(path) == (bucket, prefix)


def test_progress_record_parses():
    record = contract.from_json(b'{"step": 12, "attempt": 1, "updated_at": "2026-11-30T12:00:00Z", "loss": 2.5}')
    assert (record.step, record.attempt, record.loss, record.updated.tzinfo is not None) == (12, 1, 2.5, True)


@pytest.fixture
def refusing_gcs():
    """An HTTP server that answers every request as GCS does a caller without access: 403 (GCS IAM
    cannot exist here; the client library and its error mapping are the real ones)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            body = json.dumps({"error": {"code": 403, "message": "caller does not have storage.objects.list access"}})
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = _refuse

        def log_message(self, *_args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_refusal_of_the_operators_identity_names_the_bucket_and_the_grant(refusing_gcs):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from tpujob_operator.checkpoints import RunView, StoragePermissionError, refresh_latest, refresh_progress

    client = storage.Client(
        project="t", credentials=AnonymousCredentials(), client_options={"api_endpoint": refusing_gcs}
    )
    for read in (refresh_latest, refresh_progress):
        with pytest.raises(StoragePermissionError) as refused:
            read(client, "gs://acme-ckpt/runs/ml/llama", RunView())
        assert "permission denied (403)" in str(refused.value) and "gs://acme-ckpt" in str(refused.value)
        assert "roles/storage.objectViewer" in str(refused.value)
