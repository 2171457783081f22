"""The pieces of TRM's one small network: LeCun truncated-normal init, parameter-free RMSNorm, RoPE,
bidirectional attention, SwiGLU, and the post-norm block that mixes tokens by attention or, in the Sudoku
variant (mlp_t), by a SwiGLU across positions."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from harvest.trm.hparams import TrmConfig

# std of a standard normal truncated to [-2, 2]: dividing by it makes the truncated draw's std the one asked.
_TRUNC_STD = math.sqrt(1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / math.erf(math.sqrt(2)))


def trunc_normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """Truncated at two (corrected) standard deviations, as the reference and flax initialise."""
    return jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) * (std / _TRUNC_STD)


def dense(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    return trunc_normal(key, (fan_in, fan_out), 1.0 / math.sqrt(fan_in))


def swiglu_width(width: int, expansion: float) -> int:
    """2/3 of expansion x width (SwiGLU has two input matrices), rounded up to a multiple of 256."""
    return -(-round(expansion * width * 2 / 3) // 256) * 256


def init_swiglu(key: jax.Array, width: int, expansion: float) -> dict:
    inner = swiglu_width(width, expansion)
    k1, k2 = jax.random.split(key)
    return {"gate_up": dense(k1, width, 2 * inner), "down": dense(k2, inner, width)}


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    gate, up = jnp.split(x @ p["gate_up"].astype(x.dtype), 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ p["down"].astype(x.dtype)


def rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """No learned scale (TRM's norms have none); statistics in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rope_tables(cfg: TrmConfig) -> tuple[jax.Array, jax.Array] | None:
    """cos, sin [total_len, head_dim] in the rotate-half layout; None unless pos_encodings is rope."""
    if cfg.pos_encodings != "rope":
        return None
    head_dim = cfg.hidden // cfg.heads
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.outer(jnp.arange(cfg.total_len, dtype=jnp.float32), inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None] + turned * sin[:, None]).astype(x.dtype)


def init_attention(key: jax.Array, cfg: TrmConfig) -> dict:
    k1, k2 = jax.random.split(key)
    return {"qkv": dense(k1, cfg.hidden, 3 * cfg.hidden), "o": dense(k2, cfg.hidden, cfg.hidden)}


def attention(p: dict, x: jax.Array, cfg: TrmConfig, rope) -> jax.Array:
    """Multi-head attention over all positions (no causal mask: the whole grid is the input)."""
    b, t, _ = x.shape
    head_dim = cfg.hidden // cfg.heads
    q, k, v = jnp.moveaxis((x @ p["qkv"].astype(x.dtype)).reshape(b, t, 3, cfg.heads, head_dim), 2, 0)
    if rope is not None:
        q, k = _rotate(q, *rope), _rotate(k, *rope)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1).astype(v.dtype), v)
    return out.reshape(b, t, cfg.hidden) @ p["o"].astype(x.dtype)


def init_block(key: jax.Array, cfg: TrmConfig) -> dict:
    k1, k2 = jax.random.split(key)
    mix = init_swiglu(k1, cfg.total_len, cfg.expansion) if cfg.mlp_t else init_attention(k1, cfg)
    return {"mix": mix, "mlp": init_swiglu(k2, cfg.hidden, cfg.expansion)}


def block(p: dict, h: jax.Array, cfg: TrmConfig, rope) -> jax.Array:
    """Post-norm: h = norm(h + mix(h)); h = norm(h + mlp(h)). The token-mixing MLP works on the transposed
    [batch, hidden, positions] state and normalises over positions there, as the reference does."""
    eps = cfg.rms_norm_eps
    if cfg.mlp_t:
        ht = jnp.swapaxes(h, 1, 2)
        h = jnp.swapaxes(rms_norm(ht + swiglu(p["mix"], ht), eps), 1, 2)
    else:
        h = rms_norm(h + attention(p["mix"], h, cfg, rope), eps)
    return rms_norm(h + swiglu(p["mlp"], h), eps)
