"""The built-in trainer's configuration: its own flags (model and schedule, each with an env
fallback) on top of the operator's TPUJOB_* environment, which the library parses (tpujob.config).

Parsing is a pure function of (argv, env) so that every rule here is table-testable; invalid input
raises ConfigError, which main() turns into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from tpujob.config import ConfigError, RunConfig, run_config
from tpujob.config import env_float as _float
from tpujob.config import env_int as _int
from tpujob.config import require as _require
from tpujob_contract import DEFAULT_STEPS, STEPS_ENV


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        per_layer = 4 * self.d_model * self.d_model + 3 * self.d_model * self.d_ff + 2 * self.d_model
        return self.vocab_size * self.d_model + self.n_layers * per_layer + self.d_model


# Llama-style shapes (RMSNorm, RoPE, SwiGLU, tied embeddings). `tiny` is for CPU tests (seconds);
# `1b` is about 1.1e9 parameters, sized for one v5p/v6e host or more.
MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig("tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=512),
        ModelConfig("small", vocab_size=4096, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_seq_len=1024),
        # About 18.9 M parameters, ~227 MB of float32 state with Adam's moments: a GCS restore that costs
        # seconds behind a per-host bandwidth cap (bench/recovery.py --gcs-mb-per-s), still trainable on CPU.
        ModelConfig("medium", vocab_size=4096, d_model=512, n_layers=4, n_heads=8, d_ff=2048, max_seq_len=1024),
        ModelConfig("100m", vocab_size=32000, d_model=768, n_layers=12, n_heads=12, d_ff=2048, max_seq_len=2048),
        ModelConfig("350m", vocab_size=32000, d_model=1024, n_layers=24, n_heads=16, d_ff=2816, max_seq_len=2048),
        ModelConfig("1b", vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, d_ff=5632, max_seq_len=4096),
    )
}

DType = Literal["auto", "float32", "bfloat16"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    steps: int
    batch_size: int
    seq_len: int
    seed: int
    log_every: int
    learning_rate: float
    warmup_steps: int
    dtype: DType
    data: str  # --data: a text corpus (file or directory, local or gs://); "" = synthetic (data.py)
    min_step_seconds: float = 0.0  # --min-step-seconds: each step padded to at least this long; 0 = unpaced


@dataclasses.dataclass(frozen=True)
class Config(RunConfig):
    """The operator's environment (RunConfig) and the built-in model's flags."""

    train: TrainConfig = dataclasses.field(kw_only=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse would sys.exit(2) from inside parse_args; raise instead so parsing stays pure.
        raise ConfigError(message)


def _flag_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = _Parser(prog="tpujob-train", description="JAX LM trainer run by tpujob (see README.md).")
    p.add_argument("--model", default=env.get("TPUJOB_MODEL", "tiny"), help=f"one of {sorted(MODELS)}")
    p.add_argument("--steps", type=int, default=_int(env, STEPS_ENV, DEFAULT_STEPS))
    p.add_argument("--batch-size", type=int, default=_int(env, "TPUJOB_BATCH_SIZE", 8))
    p.add_argument("--seq-len", type=int, default=_int(env, "TPUJOB_SEQ_LEN", 64))
    p.add_argument("--seed", type=int, default=_int(env, "TPUJOB_SEED", 0))
    p.add_argument("--log-every", type=int, default=_int(env, "TPUJOB_LOG_EVERY", 10))
    p.add_argument("--learning-rate", type=float, default=_float(env, "TPUJOB_LEARNING_RATE", 3e-3))
    p.add_argument("--warmup-steps", type=int, default=_int(env, "TPUJOB_WARMUP_STEPS", -1),
                   help="default: 10%% of --steps")  # fmt: skip
    p.add_argument("--dtype", default=env.get("TPUJOB_DTYPE", "auto"), choices=["auto", "float32", "bfloat16"],
                   help="compute dtype; auto = bfloat16 on TPU/GPU, float32 on CPU")  # fmt: skip
    p.add_argument("--data", default=env.get("TPUJOB_DATA", ""),
                   help="train on this text corpus (a file, or a directory of them; local or gs://) as "
                        "bytes; default: synthetic data")  # fmt: skip
    p.add_argument("--min-step-seconds", type=float, default=_float(env, "TPUJOB_MIN_STEP_SECONDS", 0.0),
                   help="pad each step to at least this long: a larger model's step time, on a machine "
                        "where the model's own steps are far shorter (CPU demos and tests); default 0, "
                        "as fast as it goes")  # fmt: skip
    return p


# A paced step longer than this would read as a hang to a default hangTimeoutSeconds long before
# it reads as slow: a typo, not a step time.
MAX_MIN_STEP_SECONDS = 60.0

# A byte-level corpus (corpus.py) has tokens 0..255: the embedding must have a row for each.
BYTE_VOCAB = 256


def check_data(data: str, model: ModelConfig) -> None:
    """Raise ConfigError if the model cannot take the corpus's byte tokens."""
    _require(
        not data or model.vocab_size >= BYTE_VOCAB,
        f"--data {data} is read as bytes (tokens 0..{BYTE_VOCAB - 1}): model {model.name} has a vocabulary "
        f"of {model.vocab_size}, fewer than {BYTE_VOCAB}",
    )


def _train_config(args: argparse.Namespace) -> TrainConfig:
    _require(args.model in MODELS, f"unknown model {args.model!r}; choose one of {sorted(MODELS)}")
    model: ModelConfig = MODELS[args.model]
    _require(args.steps > 0, f"steps must be > 0, got {args.steps}")
    _require(args.batch_size > 0, f"batch size must be > 0, got {args.batch_size}")
    _require(2 <= args.seq_len <= model.max_seq_len, f"seq len must be in [2, {model.max_seq_len}] for {model.name}")
    _require(args.seed >= 0, f"seed must be >= 0, got {args.seed}")
    _require(args.log_every > 0, f"log every must be > 0, got {args.log_every}")
    _require(args.learning_rate > 0, f"learning rate must be > 0, got {args.learning_rate}")
    _require(
        0 <= args.min_step_seconds <= MAX_MIN_STEP_SECONDS,
        f"min step seconds must be in [0, {MAX_MIN_STEP_SECONDS:g}], got {args.min_step_seconds}",
    )
    warmup = args.warmup_steps if args.warmup_steps >= 0 else max(1, args.steps // 10)
    _require(warmup < args.steps, f"warmup steps ({warmup}) must be < steps ({args.steps})")
    data = args.data.strip()
    check_data(data, model)
    return TrainConfig(
        model=model, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
        log_every=args.log_every, learning_rate=args.learning_rate, warmup_steps=warmup, dtype=args.dtype,
        data=data, min_step_seconds=args.min_step_seconds,
    )  # fmt: skip


def parse_config(argv: Sequence[str], env: Mapping[str, str]) -> Config:
    """Build the configuration from command-line flags (first) and the environment (fallback)."""
    args = _flag_parser(env).parse_args(list(argv))
    train = _train_config(args)
    run = run_config(env)
    return Config(**{f.name: getattr(run, f.name) for f in dataclasses.fields(run)}, train=train)
