"""Decoder-only transformer LM in plain JAX (RMSNorm, RoPE, causal attention, SwiGLU, tied embedding).

Parameters are a dict pytree; the per-layer weights are stacked on a leading layer axis so the
forward pass is one `lax.scan` (compile time does not grow with depth). Parameters stay float32;
activations use the compute dtype (bfloat16 on TPU/GPU), logits and loss are float32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tpujob_trainer.config import ModelConfig

Params = dict[str, Any]


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Scaled-normal initialisation; output projections scaled down by depth (GPT-2 style)."""
    d, f, n_l = cfg.d_model, cfg.d_ff, cfg.n_layers
    k_embed, k_qkv, k_o, k_up, k_down = jax.random.split(key, 5)

    def normal(k: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
        return std * jax.random.normal(k, shape, jnp.float32)

    out_std = 0.02 / (2 * n_l) ** 0.5
    return {
        "embed": normal(k_embed, (cfg.vocab_size, d), 0.02),
        "layers": {
            "attn_norm": jnp.ones((n_l, d), jnp.float32),
            "wqkv": normal(k_qkv, (n_l, d, 3 * d), 0.02),
            "wo": normal(k_o, (n_l, d, d), out_std),
            "mlp_norm": jnp.ones((n_l, d), jnp.float32),
            "w_gate_up": normal(k_up, (n_l, d, 2 * f), 0.02),
            "w_down": normal(k_down, (n_l, f, d), out_std),
        },
        "final_norm": jnp.ones((d,), jnp.float32),
    }


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * scale).astype(x.dtype)


def _rope(x: jax.Array) -> jax.Array:
    """Rotary position embedding over the last axis of [batch, seq, heads, head_dim]."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freqs = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, dtype: jnp.dtype) -> jax.Array:
    """tokens [batch, seq] int32 -> logits [batch, seq, vocab] float32."""
    batch, seq = tokens.shape
    heads, head_dim = cfg.n_heads, cfg.head_dim
    embed = params["embed"].astype(dtype)
    x = embed[tokens]

    def layer(x: jax.Array, p: Params) -> tuple[jax.Array, None]:
        h = _rms_norm(x, p["attn_norm"])
        qkv = (h @ p["wqkv"].astype(dtype)).reshape(batch, seq, 3, heads, head_dim)
        q, k, v = _rope(qkv[:, :, 0]), _rope(qkv[:, :, 1]), qkv[:, :, 2]
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(batch, seq, cfg.d_model)
        x = x + attn @ p["wo"].astype(dtype)
        h = _rms_norm(x, p["mlp_norm"])
        gate, up = jnp.split(h @ p["w_gate_up"].astype(dtype), 2, axis=-1)
        x = x + (jax.nn.silu(gate) * up) @ p["w_down"].astype(dtype)
        return x, None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    x = _rms_norm(x, params["final_norm"])
    return jnp.einsum("bsd,vd->bsv", x, embed, preferred_element_type=jnp.float32)


def loss_fn(params: Params, tokens: jax.Array, cfg: ModelConfig, dtype: jnp.dtype) -> jax.Array:
    """Mean next-token cross-entropy."""
    logits = forward(params, tokens[:, :-1], cfg, dtype)
    targets = tokens[:, 1:]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))
