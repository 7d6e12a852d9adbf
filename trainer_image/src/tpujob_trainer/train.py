"""Train state, sharding, optimizer and the jitted train step.

Mesh: `data` spans slices (pure data parallelism over DCN), `fsdp` spans the devices of one slice
(parameters and optimizer state are sharded over ICI and all-gathered per layer by XLA). The batch
is split over both axes.

Elastic (an attempt on fewer slices than the full size, Topology.microbatches > 1): each step
accumulates gradients over that many microbatches of the unchanged global batch, then applies one
update, so the batch, the schedule and the data order stay those of the full-size run while each
device's microbatch is the full-size run's per-device batch (memory per device unchanged).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tpujob.config import ConfigError

from tpujob_trainer import model
from tpujob_trainer.config import DType, TrainConfig

State = dict[str, Any]
DATA, FSDP = "data", "fsdp"


def resolve_dtype(requested: DType, platform: str) -> jnp.dtype:
    """bfloat16 where the hardware computes in it natively (TPU, GPU), else float32."""
    name = ("bfloat16" if platform in ("tpu", "gpu") else "float32") if requested == "auto" else requested
    dtype: jnp.dtype = jnp.dtype(name)
    return dtype


def spec(*axes: str | tuple[str, ...] | None) -> PartitionSpec:
    return PartitionSpec(*axes)  # type: ignore[no-untyped-call]  # jax leaves __init__ unannotated


def make_mesh(num_slices: int) -> Mesh:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) % num_slices:
        raise ConfigError(f"{len(devices)} devices do not divide into {num_slices} slices")
    per_slice = len(devices) // num_slices
    if num_slices > 1 and len({getattr(d, "slice_index", 0) for d in devices}) == num_slices:  # TPU multislice
        grid = mesh_utils.create_hybrid_device_mesh((1, per_slice), (num_slices, 1), devices)
    else:
        # Processes are numbered slice-major (process_id = slice_id * hosts_per_slice + index),
        # so rows of the process-sorted device list are slices.
        grid = np.array(devices).reshape(num_slices, per_slice)
    return Mesh(grid, (DATA, FSDP))


def partition_spec(path: tuple[Any, ...], shape: tuple[int, ...], fsdp_size: int) -> PartitionSpec:
    """Shard the largest axis divisible by the fsdp size; never the stacked layer axis; else replicate."""
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    first = 1 if stacked else 0
    candidates = [i for i in range(first, len(shape)) if shape[i] % fsdp_size == 0 and shape[i] >= fsdp_size]
    if fsdp_size == 1 or not candidates:
        return spec()
    axis = max(candidates, key=lambda i: shape[i])
    return spec(*[FSDP if i == axis else None for i in range(len(shape))])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay to 10%; no weight decay on norm scales."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.steps, end_value=cfg.learning_rate * 0.1,
    )  # fmt: skip

    def decay_mask(params: model.Params) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any("norm" in str(getattr(k, "key", "")) for k in path), params
        )

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask),
    )


def init_state(cfg: TrainConfig, optimizer: optax.GradientTransformation, key: jax.Array) -> State:
    """The whole checkpointed state. data_position is the next batch index (== step, see data.py)."""
    params = model.init_params(cfg.model, key)
    step = jnp.zeros((), jnp.int32)
    return {"params": params, "opt_state": optimizer.init(params), "step": step, "data_position": step}


def accumulated_loss_and_grads(
    params: model.Params, tokens: jax.Array, cfg: TrainConfig, dtype: jnp.dtype
) -> tuple[jax.Array, model.Params]:
    """Mean loss and mean gradient over microbatches tokens[a] ([A, B/A, L]), one at a time (scan)."""
    grad_fn = jax.value_and_grad(model.loss_fn)

    def one(carry: tuple[jax.Array, model.Params], micro: jax.Array) -> tuple[tuple[jax.Array, model.Params], None]:
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, micro, cfg.model, dtype)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss_sum, grad_sum), _ = jax.lax.scan(one, zero, tokens)
    count = tokens.shape[0]
    return loss_sum / count, jax.tree.map(lambda g: g / count, grad_sum)


def train_step(
    state: State, tokens: jax.Array, *, cfg: TrainConfig, optimizer: optax.GradientTransformation, dtype: jnp.dtype
) -> tuple[State, jax.Array]:
    """One update. tokens: the global batch [B, L], or [A, B/A, L] to accumulate over A microbatches."""
    if tokens.ndim == 3:
        loss, grads = accumulated_loss_and_grads(state["params"], tokens, cfg, dtype)
    else:  # the full-size step, unchanged (exact-resume digests compare it bit for bit)
        loss, grads = jax.value_and_grad(model.loss_fn)(state["params"], tokens, cfg.model, dtype)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    step = state["step"] + 1
    new_state = {
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "step": step,
        "data_position": step,
    }
    return new_state, loss


class Trainer:
    """Binds config, mesh and shardings to the pure functions above."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, microbatches: int = 1):
        n_devices = mesh.devices.size
        if cfg.batch_size % microbatches:
            raise ConfigError(f"batch size {cfg.batch_size} is not divisible into {microbatches} microbatches")
        micro = cfg.batch_size // microbatches
        if micro % n_devices:
            what = (
                f"batch size {micro}"
                if microbatches == 1
                else f"microbatch size {micro} ({cfg.batch_size} / {microbatches})"
            )
            raise ConfigError(f"{what} is not divisible by the {n_devices} devices")
        self.cfg, self.mesh, self.microbatches = cfg, mesh, microbatches
        self.dtype = resolve_dtype(cfg.dtype, jax.devices()[0].platform)
        self.optimizer = make_optimizer(cfg)
        init = functools.partial(init_state, cfg, self.optimizer)
        fsdp_size = mesh.shape[FSDP]
        self.abstract_state: State = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.ShapeDtypeStruct(  # type: ignore[no-untyped-call]
                leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, partition_spec(path, leaf.shape, fsdp_size))
            ),
            jax.eval_shape(init, jax.random.key(0)),
        )
        shardings = jax.tree.map(lambda s: s.sharding, self.abstract_state)
        # Rows over (data, fsdp); with microbatches, the rows of each microbatch ([A, B/A, L]).
        rows = spec((DATA, FSDP), None) if microbatches == 1 else spec(None, (DATA, FSDP), None)
        self.batch_sharding = NamedSharding(mesh, rows)
        self._init: Callable[[jax.Array], State] = jax.jit(init, out_shardings=shardings)
        self._step = jax.jit(
            functools.partial(train_step, cfg=cfg, optimizer=self.optimizer, dtype=self.dtype),
            in_shardings=(shardings, self.batch_sharding),
            out_shardings=(shardings, NamedSharding(mesh, spec())),
            donate_argnums=0,
        )

    def init(self) -> State:
        return self._init(jax.random.key(self.cfg.seed))

    def device_batch(self, global_batch: np.ndarray) -> jax.Array:
        """Each process materialises only its own shards of the (host-computed) global batch; with
        microbatches, microbatch a is rows [a*B/A, (a+1)*B/A) of it, in order."""
        if self.microbatches > 1:
            global_batch = global_batch.reshape(self.microbatches, -1, *global_batch.shape[1:])
        return jax.make_array_from_callback(global_batch.shape, self.batch_sharding, lambda idx: global_batch[idx])

    def step(self, state: State, tokens: jax.Array) -> tuple[State, jax.Array]:
        new_state, loss = self._step(state, tokens)
        return new_state, loss
