"""The decoder forward pass: pure functions over a params pytree, with capture points and early exit.

Layers are stacked on a leading axis and run under `lax.scan`, so compile time does not grow with
depth. Captures land in per-point buffers [n_captured, batch, seq, width] carried through the scan
(one dynamic_update_slice per layer; layers that are not captured write to a spare index that is
dropped), so memory holds only what was asked for. Only layers up to the last captured one run.

A row of the batch may pack several samples: `segment_ids` (0 = padding) keep each one attending to
itself only, with positions restarting at 0, so each sample gets the values it would get alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from harvest.model.attention import attention_of
from harvest.model.config import ModelConfig, RopeConfig
from harvest.model.points import CapturePlan

Params = dict


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies as transformers computes them (float32), with default/linear/llama3 scaling."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its (contiguous) segment: restarts at 0 where the segment changes."""
    idx = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=segment_ids.ndim - 1)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """As transformers: normalize in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [b, s, h, d] with cos/sin [b, s, d/2]: the rotate-half form of HF checkpoints."""
    half = x.shape[-1] // 2
    cos = jnp.concatenate([cos, cos], -1)[:, :, None, :]
    sin = jnp.concatenate([sin, sin], -1)[:, :, None, :]
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _proj(x: jax.Array, w: jax.Array, b: jax.Array | None, spec: str) -> jax.Array:
    y = jnp.einsum(spec, x, w)
    return y if b is None else y + b


def layer(cfg: ModelConfig, lp: Params, h: jax.Array, cos, sin, attend) -> dict[str, jax.Array]:
    """One decoder layer; returns every capture point (unused ones are dead code to XLA)."""
    x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
    q = _proj(x, lp["q_proj"], lp.get("q_bias"), "bsd,dhk->bshk")
    k = _proj(x, lp["k_proj"], lp.get("k_bias"), "bsd,dhk->bshk")
    v = _proj(x, lp["v_proj"], lp.get("v_bias"), "bsd,dhk->bshk")
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn = attend(q, k, v)
    attn_out = _proj(attn, lp["o_proj"], lp.get("o_bias"), "bshk,hkd->bsd")
    resid_mid = h + attn_out
    x = rms_norm(resid_mid, lp["mlp_norm"], cfg.rms_norm_eps)
    gate = _proj(x, lp["gate_proj"], lp.get("gate_bias"), "bsd,df->bsf")
    up = _proj(x, lp["up_proj"], lp.get("up_bias"), "bsd,df->bsf")
    mlp_hidden = jax.nn.silu(gate) * up
    mlp_out = _proj(mlp_hidden, lp["down_proj"], lp.get("down_bias"), "bsf,fd->bsd")
    return {
        "resid_pre": h,
        "attn_out": attn_out,
        "resid_mid": resid_mid,
        "mlp_hidden": mlp_hidden,
        "mlp_out": mlp_out,
        "resid_post": resid_mid + mlp_out,
    }


def _width(cfg: ModelConfig, point: str) -> int:
    return cfg.intermediate_size if point == "mlp_hidden" else cfg.hidden_size


def attention_inputs(cfg: ModelConfig, segment_ids: jax.Array, n_run: int, dtype, attention: str, mesh):
    """Rotary cos/sin from each token's position in its segment, and `attend_of(layer)`: attention that is
    causal, within the segment and inside the layer's sliding window if it has one (model.attention)."""
    positions = segment_positions(segment_ids)
    inv_freq = jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)
    return cos, sin, attention_of(attention, segment_ids, cfg.sliding_windows[:n_run], cfg.head_dim**-0.5, mesh)


def embed(table: jax.Array, tokens: jax.Array, constrain) -> jax.Array:
    # Gather the table's fsdp-split dim first: a lookup from a table split on both dims is replicated.
    table = constrain(table, ("vocab", None))
    return constrain(table[tokens], ("batch", "seq", None))


def forward(
    params: Params,
    tokens: jax.Array,
    segment_ids: jax.Array,
    *,
    cfg: ModelConfig,
    plan: CapturePlan,
    constrain=None,
    attention: str = "dense",
    mesh=None,
) -> dict[str, jax.Array]:
    """Run layers 0..plan.num_layers-1 over tokens [batch, seq]; return {point: [n_layers_captured, b, s, w]}.

    `constrain(x, logical_axes)` (from runtime.mesh) pins activation shardings on a mesh; None on one device.
    `attention` names the implementation (model.attention.KINDS); the kernels run under shard_map on `mesh`.
    """
    constrain = constrain or (lambda x, axes: x)
    n_run = plan.num_layers
    stacked = params["layers"]
    depth = jax.tree.leaves(stacked)[0].shape[0]
    if n_run > depth:
        raise ValueError(f"capture plan needs {n_run} layers; params hold {depth}")
    dtype = params["embed"].dtype
    batch, seq = tokens.shape
    cos, sin, attend_of = attention_inputs(cfg, segment_ids, n_run, dtype, attention, mesh)

    # Index of each layer in each point's buffer; n (the spare one) where that layer is not captured.
    index = {}
    buffers = {}
    for point, layers in plan.points:
        table = np.full(n_run, len(layers), np.int32)
        table[list(layers)] = np.arange(len(layers))
        index[point] = jnp.asarray(table)
        buffers[point] = constrain(
            jnp.zeros((len(layers) + 1, batch, seq, _width(cfg, point)), dtype), ("capture", "batch", "seq", None)
        )

    h = embed(params["embed"], tokens, constrain)

    def step(carry, i):
        h, buffers = carry
        lp = jax.tree.map(lambda a: a[i], stacked)
        out = layer(cfg, lp, h, cos, sin, attend_of(i))
        buffers = {
            p: jax.lax.dynamic_update_slice_in_dim(buf, out[p][None].astype(dtype), index[p][i], axis=0)
            for p, buf in buffers.items()
        }
        return (constrain(out["resid_post"], ("batch", "seq", None)), buffers), None

    (_, buffers), _ = jax.lax.scan(step, (h, buffers), jnp.arange(n_run))
    # Pinned again on the way out: without it XLA may leave mlp_hidden split along its width over `model`.
    return {p: constrain(buf[:-1], ("capture", "batch", "seq", None)) for p, buf in buffers.items()}


def captures_by_key(plan: CapturePlan, out: dict[str, jax.Array]) -> dict[tuple[str, int], jax.Array]:
    """{(point, layer): [b, s, w]} view of forward's output."""
    return {(p, layer): out[p][j] for p, layers in plan.points for j, layer in enumerate(layers)}


REMAT_POLICIES = {
    "none": None,
    "layer": jax.checkpoint_policies.nothing_saveable,  # keep only each layer's input; recompute the rest
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,  # keep weight matmuls, redo the rest
}


def decode(
    params: Params,
    tokens: jax.Array,
    segment_ids: jax.Array,
    *,
    cfg: ModelConfig,
    compute_dtype=None,
    remat: str = "none",
    constrain=None,
    attention: str = "dense",
    mesh=None,
) -> jax.Array:
    """Every layer, then the final norm: hidden states [batch, seq, hidden] (what the LM head reads).

    Training's forward: params are cast to `compute_dtype` here (fp32 masters stay as they are), and each
    layer is rematerialized in the backward pass by `remat` (a REMAT_POLICIES name).
    """
    constrain = constrain or (lambda x, axes: x)
    dtype = jnp.dtype(compute_dtype or params["embed"].dtype)
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    cos, sin, attend_of = attention_inputs(cfg, segment_ids, cfg.num_layers, dtype, attention, mesh)

    def step(h, xs):
        lp, i = xs
        return constrain(layer(cfg, lp, h, cos, sin, attend_of(i))["resid_post"], ("batch", "seq", None)), None

    if remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[remat])
    h, _ = jax.lax.scan(step, embed(params["embed"], tokens, constrain),
                        (params["layers"], jnp.arange(cfg.num_layers)))
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def lm_head(params: Params, cfg: ModelConfig) -> jax.Array:
    """The [hidden, vocab] output projection: its own matrix, or the embedding's transpose when tied."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits(params: Params, tokens: jax.Array, segment_ids: jax.Array, *, cfg: ModelConfig, compute_dtype=None,
           remat: str = "none", constrain=None, attention: str = "dense", mesh=None) -> jax.Array:
    """[batch, seq, vocab] next-token logits, in the compute dtype."""
    h = decode(params, tokens, segment_ids, cfg=cfg, compute_dtype=compute_dtype, remat=remat, constrain=constrain,
               attention=attention, mesh=mesh)
    return jnp.einsum("bsd,dv->bsv", h, lm_head(params, cfg).astype(h.dtype))
