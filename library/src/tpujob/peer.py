"""Restore from a peer slice's local tier: a process whose local tier lacks the step (its node was
replaced, its memory volume is new) receives its shards from the processes of another slice, which
hold the same shards (the state is replicated over the slices) and the same committed local step.

The plan is pure (which step, from which slice); the copy is one jitted collective over the JAX
distributed runtime: every device contributes its shard's bits if it is its replica group's chosen
source, zeros otherwise, and a sum over the replicated mesh axes hands every device the source's
bits, exactly (the bits travel as integers: a float sum would turn -0.0 into 0.0).

Why not Orbax's P2P or replicator managers (orbax-checkpoint 0.12.8): the replicator needs GKE's
multi-tier checkpointing driver (a CSI driver and its replication service, not on this machine or in
open clusters), and the P2P manager replaces this trainer's GCS tier and its commit rule as the
emergency manager does (local_tier.py). What they do for a lost host is this: the shards of a
replica slice, moved over the network the job already has.

A leaf that is not replicated over the source slice (sharded over the slices, or not a jax.Array
with a NamedSharding), such as the per-process positions of a data iterator, cannot come from a
peer: the plan is then not taken, and the processes restore from their own tier or from GCS.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """A step to restore from the local tiers, and from where: `source_slice` None when every process
    holds it in its own tier (once the `fetchers` received their copies from their buddies, buddy.py);
    else the slice whose processes all hold it and hand it to the others."""

    step: int
    source_slice: int | None
    fetchers: frozenset[int] = frozenset()


def slice_of_process(process: int, num_processes: int, num_slices: int) -> int:
    """The slice a process belongs to: JobSet numbers processes slice by slice."""
    return process * num_slices // num_processes


def local_plans(per_process: Sequence[Sequence[int]], slices: Sequence[int], floor: int | None) -> list[LocalPlan]:
    """The local restores to try, best first: the newest step at or after `floor` (GCS's choice) that
    every process of some slice holds, from the processes' own tiers if all hold it, else from the
    lowest such slice; then, if that needs a peer, the newest step every process holds (own tiers)."""
    held_by_slice: dict[int, set[int]] = {}
    for steps, s in zip(per_process, slices, strict=True):
        held_by_slice[s] = held_by_slice[s] & set(steps) if s in held_by_slice else set(steps)
    everywhere = set.intersection(*(set(steps) for steps in per_process)) if per_process else set()

    def usable(step: int) -> bool:
        return floor is None or step >= floor

    plans: list[LocalPlan] = []
    offered = [(step, s) for s, steps in held_by_slice.items() for step in steps if usable(step)]
    if offered:
        newest = max(step for step, _ in offered)
        source = None if newest in everywhere else min(s for step, s in offered if step == newest)
        plans.append(LocalPlan(newest, source))
    own = [step for step in everywhere if usable(step)]
    if own and (not plans or plans[0].source_slice is not None):
        plans.append(LocalPlan(max(own), None))
    return plans


def _replicated_axes(sharding: NamedSharding) -> list[str]:
    """The mesh axes a leaf is not sharded over: the devices along them hold the same shard."""
    used: set[str] = set()
    for entry in sharding.spec:
        if entry is not None:
            used.update(entry if isinstance(entry, tuple) else (entry,))
    return [name for name in sharding.mesh.axis_names if name not in used]


def source_table(sharding: Any, sources: frozenset[int]) -> np.ndarray | None:
    """For each device of the leaf's mesh, whether it is its replica group's source (first_sources),
    among the devices of processes in `sources`; None without a NamedSharding."""
    if not isinstance(sharding, NamedSharding):
        return None
    names = list(sharding.mesh.axis_names)
    holds = np.vectorize(lambda d: d.process_index in sources, otypes=[bool])(sharding.mesh.devices)
    return first_sources(holds, [names.index(name) for name in _replicated_axes(sharding)])


def first_sources(holds: np.ndarray, replicated: Sequence[int]) -> np.ndarray | None:
    """`holds` marks the mesh's devices that hold the data; a replica group is the devices that differ
    only along the `replicated` mesh axes (they hold the same shard). The source of each group: its
    first holding device. None when a group has no holding device."""
    order = [i for i in range(holds.ndim) if i not in replicated] + list(replicated)
    grouped = np.transpose(holds, order)
    flat = grouped.reshape(*grouped.shape[: holds.ndim - len(replicated)], -1)
    if not flat.any(axis=-1).all():
        return None
    first = np.zeros_like(flat)
    np.put_along_axis(first, flat.argmax(axis=-1)[..., None], True, axis=-1)
    return np.transpose(first.reshape(grouped.shape), np.argsort(order))


def peer_tables(abstract_state: Any, sources: frozenset[int]) -> list[np.ndarray] | None:
    """source_table for every leaf, or None when any leaf cannot come from `sources`."""
    tables = []
    for leaf in jax.tree_util.tree_leaves(abstract_state):
        table = source_table(getattr(leaf, "sharding", None), sources)
        if table is None or not carried(leaf.dtype):
            return None
        tables.append(table)
    return tables


def carried(dtype: Any) -> bool:
    """Whether a leaf of this dtype travels as int32 bits: booleans and numbers of at most 32 bits; not
    64-bit numbers, nor PRNG keys (an extended dtype)."""
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(np.dtype(dtype) == np.bool_ or np.dtype(dtype).itemsize <= 4)


def zeros_like_abstract(abstract_state: Any) -> Any:
    """The state's global arrays with zeros in this process's shards: what a process with no copy
    contributes to the copy."""

    def zeros(leaf: Any) -> jax.Array:
        shape: tuple[int, ...] = tuple(leaf.shape)
        return jax.make_array_from_callback(
            shape, leaf.sharding, lambda index: np.zeros(_shard_shape(shape, index or ()), leaf.dtype)
        )

    return jax.tree_util.tree_map(zeros, abstract_state)


def _shard_shape(shape: tuple[int, ...], index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


_SAME_WIDTH_INT = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}  # a carried dtype's bits, by its width in bytes


def _as_bits(x: jax.Array) -> jax.Array:
    """The leaf's bits as int32 (sign-extended for narrower types): a sum with zeros keeps them."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    return jax.lax.bitcast_convert_type(x, _SAME_WIDTH_INT[jnp.dtype(x.dtype).itemsize]).astype(jnp.int32)


def _from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
    if dtype == jnp.bool_:
        return bits.astype(jnp.bool_)
    return jax.lax.bitcast_convert_type(bits.astype(_SAME_WIDTH_INT[jnp.dtype(dtype).itemsize]), dtype)


def _copy_leaf(x: jax.Array, source: _Source) -> jax.Array:
    mesh, spec = source.sharding.mesh, source.sharding.spec
    replicated = tuple(_replicated_axes(source.sharding))
    if not replicated:
        return x  # each shard is held once: every device was its own source (the table said so)
    table = jnp.asarray(source.table)

    def block(shard: jax.Array) -> jax.Array:
        here = table[tuple(jax.lax.axis_index(name) for name in mesh.axis_names)]
        bits = jnp.where(here, _as_bits(shard), 0)
        return _from_bits(jax.lax.psum(bits, replicated), shard.dtype)  # type: ignore[no-untyped-call]

    return jax.shard_map(block, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


@dataclasses.dataclass(frozen=True, eq=False)
class _Source:
    """A leaf's sharding and source table, a static argument of jit (hashed by identity: a copy is
    compiled once per restore)."""

    sharding: NamedSharding
    table: np.ndarray


@functools.partial(jax.jit, static_argnums=1, donate_argnums=0)  # the copy's output reuses its input
def _copy(state: Any, sources: tuple[_Source, ...]) -> Any:
    leaves, tree = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(tree, [_copy_leaf(x, s) for x, s in zip(leaves, sources, strict=True)])


def copy_from_sources(state: Any, tables: Sequence[np.ndarray]) -> Any:
    """Every device's shard replaced by its replica group's source's (a collective: every process
    calls it with the same tables, each with its own shards; non-sources hold zeros)."""
    leaves = jax.tree_util.tree_leaves(state)
    return _copy(state, tuple(_Source(x.sharding, t) for x, t in zip(leaves, tables, strict=True)))
