"""Your own JAX training loop under tpujob: a byte-level Flax NNX language model on real text.

The corpus is the Python standard library's own sources (the top-level `*.py` files of
`sysconfig.get_paths()["stdlib"]`, about 4.7 MB with CPython 3.11): real text that every Python
install carries, so nothing is downloaded at run time. Grain shuffles its windows; global batch s is
windows [s*B, (s+1)*B) of that order, each process reading its own rows (`tpujob.StepBatches`), and
the position is saved in every checkpoint: a restarted run sees exactly the examples an
uninterrupted run would, on any number of processes, after an elastic resize too (then every step
accumulates the same global batch over `run.microbatches` microbatches).

The lines marked `# tpujob` are all the loop needs to be protected (docs/guides/own-loop.md):
restore from the newest committed checkpoint, continuous saves, the SIGTERM stop step, the
progress record and the exit codes the operator classifies failures by.

    python examples/own-loop/train.py --steps 200          # alone, on any JAX backend
    # under the operator: a TrainingJob whose workers run this file (examples/own-loop/README.md)
"""

from __future__ import annotations

import argparse
import functools
import sysconfig
from pathlib import Path

import grain
import jax
import numpy as np
import optax
import tpujob  # tpujob
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


class Block(nnx.Module):
    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        # No biases: softmax ignores a key bias, whose gradient is then rounding noise that Adam scales up.
        self.attn = nnx.MultiHeadAttention(heads, dim, use_bias=False, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class ByteLM(nnx.Module):
    """A small causal transformer over bytes (vocabulary 256)."""

    def __init__(self, dim: int, layers: int, heads: int, seq_len: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(256, dim, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, dim)))
        self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.out = nnx.Linear(dim, 256, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class StdlibWindows:
    """Random access to fixed windows of seq_len + 1 bytes of the standard library's sources."""

    def __init__(self, seq_len: int):
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        corpus = b"\n".join(path.read_bytes() for path in sorted(stdlib.glob("*.py")))
        self.tokens = np.frombuffer(corpus, np.uint8)
        self.window = seq_len + 1

    def __len__(self) -> int:
        return len(self.tokens) // self.window

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[index * self.window : (index + 1) * self.window].astype(np.int32)


def data_iterator(seq_len: int, global_batch: int, seed: int) -> tpujob.StepBatches:
    """This process's rows of each global batch of the shuffled windows; checkpointable (get_state)."""
    windows = grain.MapDataset.source(StdlibWindows(seq_len)).shuffle(seed=seed).repeat()
    return tpujob.StepBatches(windows, global_batch)  # tpujob: its position holds on any process count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default: TPUJOB_STEPS (100)")
    parser.add_argument("--batch-size", type=int, default=16, help="global, a multiple of the device count")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    run = tpujob.start(steps=args.steps)  # tpujob: first, before any other JAX call

    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))
    tx = optax.adamw(args.learning_rate)

    def create() -> tuple[ByteLM, nnx.Optimizer]:
        model = ByteLM(args.dim, args.layers, 4, args.seq_len, nnx.Rngs(args.seed))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, _ = nnx.split(nnx.eval_shape(create))
    # The state is a pytree: the model's parameters and the optimizer's moments and step count.
    state = jax.jit(lambda: nnx.state(create()), out_shardings=replicated)()

    microbatches = run.microbatches  # tpujob: 1 at full size, more on an elastic attempt with fewer slices

    @functools.partial(jax.jit, out_shardings=(replicated, replicated), donate_argnums=0)
    def train_step(state: nnx.State, batch: jax.Array) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model: ByteLM, rows: jax.Array) -> jax.Array:
            logits = model(rows[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()

        # The global batch's rows in order, microbatch a = rows [a*B/A, (a+1)*B/A): the mean of the
        # microbatches' gradients is the full batch's gradient, so every step is the full-size one.
        losses, grads = [], []
        for rows in batch.reshape(microbatches, -1, batch.shape[-1]):
            loss, grad = nnx.value_and_grad(loss_fn)(model, rows)
            losses.append(loss)
            grads.append(grad)
        mean_grad = grads[0] if microbatches == 1 else jax.tree.map(lambda *g: sum(g) / microbatches, *grads)
        optimizer.update(model, mean_grad)
        return nnx.state((model, optimizer)), sum(losses) / microbatches

    data = data_iterator(args.seq_len, args.batch_size, args.seed)
    state = run.restore(state, data)  # tpujob: the newest committed step and its data position

    for step in range(run.first_step, run.final_step):  # tpujob: from the restored step
        local = next(data)
        batch = jax.make_array_from_process_local_data(batch_sharding, local)
        state, loss = train_step(state, batch)
        run.step_done(step + 1, state, data, loss=loss)  # tpujob: saves when due, reports progress
        if (step + 1) % args.log_every == 0 and jax.process_index() == 0:
            print(f"step {step + 1}/{run.final_step} loss {float(loss):.4f}", flush=True)
        if run.should_stop(step + 1):  # tpujob: SIGTERM, every process at the same step, saved
            break

    run.finish(state, data)  # tpujob: the final save, committed; exit 143 after a stop


if __name__ == "__main__":
    main()
