"""failures.classify over the exceptions the trainer's storage stack really raises. The texts were
provoked against a real checkpoint on fake-gcs-server (a truncated, zeroed or deleted array file,
unparseable metadata, another model's shapes, a FaultProxy answering 401/403/503); the exception
classes are the clients' own (gcsfs, aiohttp, requests, JAX)."""

from __future__ import annotations

import json

import aiohttp
import jax
import pytest
import requests
from gcsfs.retry import HttpError
from tpujob.bounded import StorageTimeout
from tpujob.failures import CheckpointMismatch, Kind, classify

OCDBT = "in OCDBT database at gs://tpujob-trainer-tests/tests/x/checkpoints/6/default/"
SPEC = ' [tensorstore_spec[1]=\'{"base":{"driver":"zarr","fill_missing_data_reads":false}}\']'


def _orbax_read_error(cause: BaseException) -> Exception:
    """How Orbax wraps a tensorstore read failure: a bare Exception, the ValueError as its cause."""
    top = Exception(
        "Encountered error while reading array index: (slice(0, 2, 1), slice(32, 64, 1)). See full TensorStore "
        "details: <bound method spec of TensorStore({'driver': 'zarr', 'dtype': 'float32', 'gcs_request_retries': {}})>"
    )
    top.__cause__ = cause
    return top


def _json_error() -> json.JSONDecodeError:
    try:
        json.loads("{not json")
    except json.JSONDecodeError as err:
        return err
    raise AssertionError("unreachable")


DAMAGED = {
    "truncated array file (416)": _orbax_read_error(
        ValueError(f'OUT_OF_RANGE: Error reading "opt_state.1.0.mu.layers.wo/0.1.0" {OCDBT}: '
                   "Range Not Satisfiable [http_response_code='416']")
    ),
    "zeroed array file": _orbax_read_error(
        ValueError(f'FAILED_PRECONDITION: Error reading "params.layers.wqkv/0.0.1" {OCDBT}: '
                   "ZSTD_decompressStream() failed: Unknown frame descriptor; at byte 0; at uncompressed byte 0")
    ),
    "deleted array file": _orbax_read_error(
        ValueError(f'FAILED_PRECONDITION: Error reading "params.layers.wo/0.0.0" {OCDBT}: '
                   "Truncated Zstd-compressed stream; at byte 0; at uncompressed byte 0")
    ),
    "deleted manifest": ValueError(
        'NOT_FOUND: Error opening "cast" driver: Error opening "zarr" driver: Metadata at "data_position/.zarray" '
        f"{OCDBT} does not exist{SPEC}"
    ),
    "garbage manifest": ValueError(
        'DATA_LOSS: Error opening "cast" driver: Error opening "zarr" driver: Error reading "step/.zarray" '
        f"{OCDBT}: Error decoding manifest: Encoded length (2) is less than minimum length (16){SPEC}"
    ),
    "garbage _METADATA": _json_error(),
    "a metadata file gone (gcsfs 404)": FileNotFoundError("b/tpujob-trainer-tests/o/tests%2Fx%2Fcheckpoints%2F6"),
    "a step that holds another step": CheckpointMismatch("checkpoint 6 holds step 4"),
}  # fmt: skip
MISMATCH = {
    "another model's shapes": ValueError(
        "Requested shape: (4096, 256) is not compatible with the stored shape: (256, 64). Truncating/padding is "
        "disabled. To enable it, set `strict=False` in `ArrayRestoreArgs` for any array in v0 API"
    ),
    "another state tree": ValueError(
        "pytree structure error: different types at key path\n    tree_map tree['opt_state']\nAt that key path, "
        "the prefix pytree tree_map tree has a subtree of type\n    <class 'tuple'>"
    ),
}
TRANSIENT = {
    "gcsfs 503 after its retries": HttpError({"code": 503, "message": "backendError for GET /storage/v1/b/x/o/y"}),
    "gcsfs 429": HttpError({"code": 429, "message": "rateLimitExceeded"}),
    "gcsfs 502": requests.exceptions.ProxyError(),
    "server disconnected": aiohttp.ServerDisconnectedError(),
    "connection refused": aiohttp.ClientConnectionError("Cannot connect to host 127.0.0.1:4443"),
    "a hung storage call": StorageTimeout("checkpoint storage gs://b/run did not answer within 30s"),
    "tensorstore 503": ValueError(
        f"UNAVAILABLE: Error reading gs://b/run/checkpoints/6/default/manifest.ocdbt: "
        f"backendError [http_response_code='503']{SPEC}"
    ),
    "tensorstore throttled": ValueError(f"RESOURCE_EXHAUSTED: rateLimitExceeded [http_response_code='429']{SPEC}"),
    "host out of memory": MemoryError(),
    "device out of memory": jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4294967296 bytes."
    ),
    "barrier timeout": jax.errors.JaxRuntimeError(
        "DEADLINE_EXCEEDED: Barrier timed out. Id: tpujob-move-quarantine-30::0. Timed out task names: "
        "/job:jax_worker/replica:0/task:1"
    ),
    "damage seen while the read also timed out": _orbax_read_error(
        ValueError(f"NOT_FOUND: Error reading {OCDBT}: DEADLINE_EXCEEDED: read timed out")
    ),
    "something unrecognizable": RuntimeError("the flux capacitor is out of sync"),
}
DENIED = {
    "gcsfs 403": OSError("Forbidden: b/tpujob-trainer-tests/o\ntpujob FaultProxy: 403 forbidden for GET /o?prefix=x"),
    "gcsfs 401": HttpError({"code": 401, "message": "Invalid Credentials"}),
    "tensorstore 403": _orbax_read_error(
        ValueError(
            'PERMISSION_DENIED: Error opening "cast" driver: Error reading gs://b/run/checkpoints/6/default/'
            f"manifest.ocdbt: 403 forbidden{SPEC}"
        )
    ),
    "tensorstore 401": ValueError(f"UNAUTHENTICATED: Error reading gs://b/x: [http_response_code='401']{SPEC}"),
    "a local directory we may not write": PermissionError(13, "Permission denied", "/ckpt/run/.tpujob-probe"),
}


@pytest.mark.parametrize(
    ("error", "kind"),
    [pytest.param(e, k, id=f"{k.name}: {name}") for cases, k in
     ((DAMAGED, Kind.DAMAGED), (MISMATCH, Kind.MISMATCH), (TRANSIENT, Kind.TRANSIENT), (DENIED, Kind.DENIED))
     for name, e in cases.items()],
)  # fmt: skip
def test_only_the_data_condemns_a_step(error: BaseException, kind: Kind) -> None:
    assert classify(error) == kind


def test_a_refusal_anywhere_in_the_chain_wins() -> None:
    top = RuntimeError("save failed")
    top.__cause__ = OSError("Forbidden: b/bucket/o/run%2Fcheckpoints%2F12%2Fcommit_success.txt")
    assert classify(top) == Kind.DENIED
