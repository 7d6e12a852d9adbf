"""Real data (--data): byte-level windows of a text corpus, in an order that is a pure function of
(corpus, seed, step), like the synthetic batches of data.py.

The corpus is one file, or every regular file under a directory (recursively, sorted by path,
hidden files and directories skipped) joined with b"\\n" between files; local or gs:// (etils.epath,
gcsfs). Its bytes are the tokens (0..255). It is cut into non-overlapping windows of seq_len
tokens (the model predicts tokens 1..L-1 of each from the ones before, as with synthetic data); a
tail shorter than a window is left out. The windows form a Grain MapDataset, shuffled with --seed
and repeated (each epoch in a new order), and the global batch for step s is its elements
[s*B, (s+1)*B). So the saved data position is still the step: a resume at step k replays exactly
the batches an uninterrupted run would from k, on any number of hosts and after an elastic resize.
The order depends on Grain's shuffle, which is why its version is pinned (pyproject.toml).

Each process reads the whole corpus into memory once, at start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import grain
import numpy as np
from etils import epath
from tpujob.config import ConfigError

from tpujob_trainer.config import TrainConfig

log = logging.getLogger("tpujob_trainer")

FILE_SEPARATOR = b"\n"


def _hidden(path: epath.Path) -> bool:
    name: str = path.name
    return name.startswith(".")


def _local(path: epath.Path) -> bool:
    return "://" not in os.fspath(path)


def _regular_file(path: epath.Path) -> bool:
    """A file to read: an object (gs://), or a local regular file or link to one; not a FIFO, socket
    or device, which epath's is_file() accepts locally and whose read could block for ever."""
    return os.path.isfile(os.fspath(path)) if _local(path) else path.is_file()


def corpus_files(root: epath.Path) -> list[epath.Path]:
    """The corpus's files: `root` itself if it is a file, else the regular files under it, sorted.

    Walked with iterdir, one listing per directory: epath refuses `**` globs on gs://. Local symbolic
    links to directories are not followed (a link to a parent would never end); links to files are."""
    if not root.is_dir():
        return [root]
    found: list[epath.Path] = []
    pending = [root]
    while pending:
        for child in pending.pop().iterdir():
            if _hidden(child):
                continue
            if child.is_dir():
                if not (_local(child) and os.path.islink(os.fspath(child))):
                    pending.append(child)
            elif _regular_file(child):
                found.append(child)
    return sorted(found, key=lambda path: path.as_posix())


def read_corpus(path: str) -> np.ndarray:
    """The corpus's bytes (uint8). ConfigError if the path names nothing."""
    root = epath.Path(path)
    if not root.exists():
        raise ConfigError(f"--data {path}: no such file or directory")
    return np.frombuffer(FILE_SEPARATOR.join(file.read_bytes() for file in corpus_files(root)), np.uint8)


class Windows:
    """Random access to the non-overlapping windows of seq_len tokens (int32) of a corpus: a Grain source."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len].astype(np.int32)


def global_batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> grain.MapDataset:
    """Element s is the global batch [batch_size, seq_len] (int32) consumed by the update producing s+1."""
    windows = grain.MapDataset.source(Windows(tokens, seq_len)).shuffle(seed=seed).repeat()
    return windows.batch(batch_size)  # element s: windows [s*B, (s+1)*B) of the endless shuffled sequence


def batches(cfg: TrainConfig) -> Callable[[int], np.ndarray]:
    """Load cfg.data and return step -> the global batch for that step (data.batch_for_step's role).

    ConfigError if the corpus does not exist or holds less than one window."""
    tokens = read_corpus(cfg.data)
    windows = len(tokens) // cfg.seq_len
    if windows == 0:
        raise ConfigError(
            f"--data {cfg.data}: {len(tokens)} bytes, less than one window of --seq-len {cfg.seq_len} bytes"
        )
    log.info(
        "data: %s, %d bytes, %d windows of %d bytes; an epoch is %.1f steps of %d windows (%.2f epochs in %d steps)",
        cfg.data, len(tokens), windows, cfg.seq_len, windows / cfg.batch_size, cfg.batch_size,
        cfg.steps * cfg.batch_size / windows, cfg.steps,
    )  # fmt: skip
    dataset = global_batches(tokens, cfg.seq_len, cfg.batch_size, cfg.seed)

    def batch_for_step(step: int) -> np.ndarray:
        batch: np.ndarray = dataset[step]
        return batch

    return batch_for_step
