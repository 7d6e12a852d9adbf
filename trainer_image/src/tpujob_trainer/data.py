"""Deterministic synthetic data: the batch for a step is a pure function of (seed, step).

So the saved data position is simply the step: resuming at step k replays exactly the batches an
uninterrupted run would have seen from k on, on any number of hosts. Each sequence is an
arithmetic progression modulo the vocabulary with a random start and stride, which a small model
learns within a few hundred steps (the loss visibly falls) while still exercising every layer.
"""

from __future__ import annotations

import numpy as np

MAX_STRIDE = 8


def batch_for_step(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int) -> np.ndarray:
    """The global batch [batch_size, seq_len] (int32) consumed by the update that produces step+1."""
    rng = np.random.default_rng([seed, step])  # SeedSequence: distinct, stable stream per (seed, step)
    start = rng.integers(0, vocab_size, size=(batch_size, 1), dtype=np.int64)
    stride = rng.integers(1, MAX_STRIDE + 1, size=(batch_size, 1), dtype=np.int64)
    positions = np.arange(seq_len, dtype=np.int64)[None, :]
    return ((start + stride * positions) % vocab_size).astype(np.int32)
