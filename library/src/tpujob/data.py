"""A data iterator's position inside the checkpoint.

Per process: every process reads its own shard of the data, so every process has its own iterator
state (Grain's `DatasetIterator.get_state()`, a dict; `grain.DataLoader`'s iterator, bytes; or
anything with `get_state()`/`set_state()` whose state is JSON or bytes). The states travel in the
checkpoint as one uint8 array of shape (processes, CAPACITY), row p written and read by process p
alone, sharded over the processes: so they are saved and restored by Orbax with the model, in the
same step, committed by the same marker, on GCS and on the local tier alike. Such a position holds
for the same number of processes only.

Global: an iterator whose class says `position_is_global = True` (`StepBatches`) has one state, the
same on every process and valid on any number of them. It travels as one replicated row, so a run
resized to fewer or more processes (elastic slices) continues exactly where it was.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any, Protocol, SupportsIndex, runtime_checkable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CAPACITY = 16384  # bytes of one process's encoded iterator state (Grain's are tens of bytes)


@runtime_checkable
class Checkpointable(Protocol):
    """A data iterator whose position can be saved: Grain's iterators are."""

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


class RandomAccess(Protocol):
    """What StepBatches reads: element i of a dataset (Grain's MapDataset, repeated: any index)."""

    def __getitem__(self, index: SupportsIndex, /) -> Any: ...


class StepBatches(Iterator[np.ndarray]):
    """This process's rows of each global batch: global batch s is elements [s*B, (s+1)*B) of a
    random-access dataset (Grain's `MapDataset`, shuffled and repeated), and process p of P takes
    rows [p*B/P, (p+1)*B/P) of it, stacked. The position is the number of global batches read, the
    same on every process: a run restored on another number of processes (an elastic resize)
    reads exactly the batches an uninterrupted run would, and each step's global batch is the same
    rows in the same order (the gradient-accumulation microbatches take them in order too)."""

    position_is_global = True

    def __init__(self, dataset: RandomAccess, global_batch: int):
        processes = jax.process_count()
        if global_batch <= 0 or global_batch % processes:
            raise ValueError(f"the global batch ({global_batch}) is not a positive multiple of {processes} processes")
        self.dataset, self.global_batch = dataset, global_batch
        self._rows = global_batch // processes
        self._first = jax.process_index() * self._rows
        self.step = 0  # global batches read: the next one is global batch `step`

    def __next__(self) -> np.ndarray:
        start = self.step * self.global_batch + self._first
        rows = np.stack([np.asarray(self.dataset[i]) for i in range(start, start + self._rows)])
        self.step += 1
        return rows

    def get_state(self) -> dict[str, int]:
        return {"step": self.step}

    def set_state(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def position_is_global(iterator: Any) -> bool:
    """Whether the iterator's state is one global position (saved once, valid on any process count)."""
    return bool(getattr(iterator, "position_is_global", False))


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


def _replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]


def abstract_position(mesh: Mesh, iterator: Any) -> jax.ShapeDtypeStruct:
    """The checkpoint leaf the iterator's position is restored from."""
    if position_is_global(iterator):
        return jax.ShapeDtypeStruct((CAPACITY,), np.uint8, sharding=_replicated(mesh))  # type: ignore[no-untyped-call]
    return abstract(mesh)


def position_array(mesh: Mesh, iterator: Any) -> jax.Array:
    """The iterator's position as a checkpoint leaf: one replicated row when it is global, else this
    process's row of the (processes, CAPACITY) array."""
    row = np.zeros((1, CAPACITY), np.uint8)
    raw = encode(iterator.get_state())
    row[0, : len(raw)] = np.frombuffer(raw, np.uint8)
    if position_is_global(iterator):
        return jax.make_array_from_callback((CAPACITY,), _replicated(mesh), lambda _: row[0])
    me = jax.process_index()

    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is None or index[0].start in (None, me), f"process {me} asked for row {index[0]}"
        return row

    return jax.make_array_from_callback((jax.process_count(), CAPACITY), _sharding(mesh), shard)


def restore_position(iterator: Any, array: jax.Array) -> None:
    """Set the iterator to the position a checkpoint leaf holds (this process's row, or the global one)."""
    rows = np.asarray(array.addressable_data(0))
    iterator.set_state(decode(rows if rows.ndim == 1 else rows[0]))


def step_array(mesh: Mesh, step: int) -> jax.Array:
    """The step, a replicated int32 scalar: checked against the step a checkpoint is listed under."""
    return jax.make_array_from_callback((), _replicated(mesh), lambda _: np.asarray(step, np.int32))


def abstract_step(mesh: Mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((), np.int32, sharding=_replicated(mesh))  # type: ignore[no-untyped-call]
