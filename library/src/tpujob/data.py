"""A data iterator's position inside the checkpoint, per process.

Every process reads its own shard of the data, so every process has its own iterator state (Grain's
`DatasetIterator.get_state()`, a dict; `grain.DataLoader`'s iterator, bytes; or anything with
`get_state()`/`set_state()` whose state is JSON or bytes). The states travel in the checkpoint as one
uint8 array of shape (processes, CAPACITY), row p written and read by process p alone, sharded over
the processes: so they are saved and restored by Orbax with the model, in the same step, committed
by the same marker, on GCS and on the local tier alike.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CAPACITY = 16384  # bytes of one process's encoded iterator state (Grain's are tens of bytes)


@runtime_checkable
class Checkpointable(Protocol):
    """A data iterator whose position can be saved: Grain's iterators are."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


def encode(state: Any) -> bytes:
    """The iterator state as bytes of at most CAPACITY (ValueError otherwise, or if not JSON)."""
    if isinstance(state, bytes):
        doc: dict[str, Any] = {"bytes": base64.b64encode(state).decode()}
    else:
        doc = {"json": state}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > CAPACITY:
        raise ValueError(f"the data iterator's state takes {len(raw)} bytes, more than {CAPACITY}")
    return raw


def decode(row: np.ndarray) -> Any:
    raw = bytes(row.tobytes()).rstrip(b"\0")
    doc = json.loads(raw)
    return base64.b64decode(doc["bytes"]) if "bytes" in doc else doc["json"]


def process_mesh() -> Mesh:
    """All devices, one row per process (row p: process p's devices)."""
    rows = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    return Mesh(np.array(rows), ("process", "local"))


def _sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec("process"))  # type: ignore[no-untyped-call]


def abstract(mesh: Mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((jax.process_count(), CAPACITY), np.uint8, sharding=_sharding(mesh))  # type: ignore[no-untyped-call]


def to_array(mesh: Mesh, state: Any) -> jax.Array:
    """This process's iterator state as its row of the global (processes, CAPACITY) array."""
    row = np.zeros((1, CAPACITY), np.uint8)
    raw = encode(state)
    row[0, : len(raw)] = np.frombuffer(raw, np.uint8)
    me = jax.process_index()

    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is None or index[0].start in (None, me), f"process {me} asked for row {index[0]}"
        return row

    return jax.make_array_from_callback((jax.process_count(), CAPACITY), _sharding(mesh), shard)


def from_array(array: jax.Array) -> Any:
    """This process's iterator state from its row."""
    return decode(np.asarray(array.addressable_data(0))[0])


def step_array(mesh: Mesh, step: int) -> jax.Array:
    """The step, a replicated int32 scalar: checked against the step a checkpoint is listed under."""
    replicated = NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]
    return jax.make_array_from_callback((), replicated, lambda _: np.asarray(step, np.int32))


def abstract_step(mesh: Mesh) -> jax.ShapeDtypeStruct:
    replicated = NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]
    return jax.ShapeDtypeStruct((), np.int32, sharding=replicated)  # type: ignore[no-untyped-call]
