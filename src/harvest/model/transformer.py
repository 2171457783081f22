"""The decoder forward pass: pure functions over a params pytree, with capture points and early exit.

Layers are stacked on a leading axis and run under `lax.scan`, so compile time does not grow with
depth. Captures land in per-point buffers [n_captured, batch, seq, width] carried through the scan
(one dynamic_update_slice per layer; layers that are not captured write to a spare index that is
dropped), so memory holds only what was asked for. Only layers up to the last captured one run.

A row of the batch may pack several samples: `segment_ids` (0 = padding) keep each one attending to
itself only, with positions restarting at 0, so each sample gets the values it would get alone.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from harvest.model.attention import attention_of
from harvest.model.config import ModelConfig, RopeConfig
from harvest.model.points import CapturePlan

Params = dict


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies as transformers computes them (float32), with default/linear/llama3/yarn scaling, for
    `head_dim` rotated dims."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
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


def _yarn_inv_freq(rope: RopeConfig, dim: int, extrapolated: np.ndarray) -> np.ndarray:
    """YaRN: frequencies kept above the ramp, divided by the factor below it, blended linearly between."""
    def correction(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / np.float32((high + 0.001 if low == high else high)
                                                                               - low), 0, 1).astype(np.float32)
    kept = (np.float32(1) - ramp).astype(np.float32)
    interpolated = (extrapolated / np.float32(rope.factor)).astype(np.float32)
    return (interpolated * (np.float32(1) - kept) + extrapolated * kept).astype(np.float32)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its (contiguous) segment: restarts at 0 where the segment changes."""
    idx = jnp.arange(segment_ids.shape[-1], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[..., :1], bool), segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=segment_ids.ndim - 1)


def norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, cfg: ModelConfig) -> jax.Array:
    """The family's norm (ModelConfig.norm), rounded as transformers rounds it: statistics in float32, then
    Llama casts back before scaling by w, OLMo 2 scales by w and Gemma by (1 + w) in float32 before casting,
    LayerNorm adds its bias in float32."""
    x32 = x.astype(jnp.float32)
    if cfg.norm == "layer":
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        normed = centered * jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + cfg.norm_eps)
        return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + cfg.norm_eps)
    if cfg.norm == "rms":
        return weight * normed.astype(x.dtype)
    scale = weight.astype(jnp.float32) + (1.0 if cfg.norm == "rms_one_plus" else 0.0)
    return (normed * scale).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [b, s, h, d] with cos/sin [b, s, r/2]: the rotate-half form of HF checkpoints on the first r dims of each
    head (all of them but with partial rotary), the rest passed through."""
    rotated_dims = 2 * cos.shape[-1]
    part, rest = x[..., :rotated_dims], x[..., rotated_dims:]
    half = rotated_dims // 2
    cos = jnp.concatenate([cos, cos], -1)[:, :, None, :]
    sin = jnp.concatenate([sin, sin], -1)[:, :, None, :]
    turned = jnp.concatenate([-part[..., half:], part[..., :half]], axis=-1)
    out = part * cos + turned * sin
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)


def _proj(x: jax.Array, w: jax.Array, b: jax.Array | None, spec: str) -> jax.Array:
    y = jnp.einsum(spec, x, w)
    return y if b is None else y + b


ACTIVATIONS = {"silu": jax.nn.silu, "gelu": partial(jax.nn.gelu, approximate=False),
               "gelu_tanh": partial(jax.nn.gelu, approximate=True)}


def layer(cfg: ModelConfig, lp: Params, h: jax.Array, rotary, attend) -> dict[str, jax.Array]:
    """One decoder layer, every family's (ModelConfig's switches); returns every capture point (unused ones are
    dead code to XLA). `rotary` is (cos, sin) of the layer's rope, None with learned positions."""
    def normed(x: jax.Array, name: str) -> jax.Array:
        return norm(x, lp[name], lp.get(name + "_bias"), cfg)

    post_normed = cfg.block in ("sandwich", "post")
    x = h if cfg.block == "post" else normed(h, "attn_norm")
    q = _proj(x, lp["q_proj"], lp.get("q_bias"), "bsd,dhk->bshk")
    k = _proj(x, lp["k_proj"], lp.get("k_bias"), "bsd,dhk->bshk")
    v = _proj(x, lp["v_proj"], lp.get("v_bias"), "bsd,dhk->bshk")
    if cfg.qk_norm == "head":
        q, k = normed(q, "q_norm"), normed(k, "k_norm")
    elif cfg.qk_norm == "full":  # over all heads of the projection at once (OLMo 2)
        q = normed(q.reshape(*q.shape[:2], -1), "q_norm").reshape(q.shape)
        k = normed(k.reshape(*k.shape[:2], -1), "k_norm").reshape(k.shape)
    if rotary is not None:
        q, k = apply_rope(q, *rotary), apply_rope(k, *rotary)
    attn_z = attend(q, k, v)
    attn_out = _proj(attn_z, lp["o_proj"], lp.get("o_bias"), "bshk,hkd->bsd")
    if post_normed:
        attn_out = normed(attn_out, "attn_post_norm")
    resid_mid = h + attn_out
    if cfg.block == "post":
        mlp_in = resid_mid
    else:
        mlp_in = normed(h if cfg.block == "parallel" else resid_mid, "mlp_norm")
    up = _proj(mlp_in, lp["up_proj"], lp.get("up_bias"), "bsd,df->bsf")
    act = ACTIVATIONS[cfg.act]
    mlp_hidden = act(_proj(mlp_in, lp["gate_proj"], lp.get("gate_bias"), "bsd,df->bsf")) * up if cfg.gated_mlp \
        else act(up)
    mlp_out = _proj(mlp_hidden, lp["down_proj"], lp.get("down_bias"), "bsf,fd->bsd")
    if post_normed:
        mlp_out = normed(mlp_out, "mlp_post_norm")
    return {
        "resid_pre": h,
        "attn_z": attn_z.reshape(*attn_z.shape[:2], -1),
        "attn_out": attn_out,
        "resid_mid": resid_mid,
        "mlp_in": mlp_in,
        "mlp_hidden": mlp_hidden,
        "mlp_out": mlp_out,
        "resid_post": (mlp_out + attn_out) + h if cfg.block == "parallel" else resid_mid + mlp_out,
    }


def _width(cfg: ModelConfig, point: str) -> int:
    return {"mlp_hidden": cfg.intermediate_size, "attn_z": cfg.num_heads * cfg.head_dim}.get(point, cfg.hidden_size)


def attention_inputs(cfg: ModelConfig, segment_ids: jax.Array, n_run: int, dtype, attention: str, mesh):
    """`rotary_of(layer)`: rotary cos/sin from each token's position in its segment, by the layer's rope (the
    local one on sliding layers where the family has one; None with learned positions), and `attend_of(layer)`:
    attention that is causal, within the segment and inside the layer's sliding window if it has one
    (model.attention)."""
    windows = cfg.sliding_windows[:n_run]
    attend_of = attention_of(attention, segment_ids, windows, cfg.scale, mesh, softcap=cfg.attn_softcap)
    if cfg.rope is None:
        return (lambda i: None), attend_of
    positions = segment_positions(segment_ids).astype(jnp.float32)[..., None]
    ropes = [cfg.rope] + ([cfg.local_rope] if cfg.local_rope else [])
    angles = jnp.stack([positions * jnp.asarray(rope_inv_freq(r, cfg.rotated)) for r in ropes])
    factor = jnp.asarray([r.attention_factor for r in ropes], jnp.float32)[:, None, None, None]
    cos, sin = (jnp.cos(angles) * factor).astype(dtype), (jnp.sin(angles) * factor).astype(dtype)
    if len(ropes) == 1:
        return (lambda i: (cos[0], sin[0])), attend_of
    which = jnp.asarray([int(w is not None) for w in windows], jnp.int32)
    return (lambda i: (cos[which[i]], sin[which[i]])), attend_of


def embed(params: Params, tokens: jax.Array, segment_ids: jax.Array, cfg: ModelConfig, constrain) -> jax.Array:
    """Token embeddings (times sqrt(hidden) where the family scales them, in their dtype as transformers does),
    plus learned positions (restarting in each segment) where the family has them."""
    # Gather the table's fsdp-split dim first: a lookup from a table split on both dims is replicated.
    table = constrain(params["embed"], ("vocab", None))
    h = table[tokens]
    if cfg.embed_scale:
        h = h * jnp.asarray(cfg.hidden_size**0.5, h.dtype)
    if cfg.rope is None:
        h = h + constrain(params["pos_embed"], (None, None))[segment_positions(segment_ids)]
    return constrain(h, ("batch", "seq", None))


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
    rotary_of, attend_of = attention_inputs(cfg, segment_ids, n_run, dtype, attention, mesh)

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

    h = embed(params, tokens, segment_ids, cfg, constrain)

    def step(carry, i):
        h, buffers = carry
        lp = jax.tree.map(lambda a: a[i], stacked)
        out = layer(cfg, lp, h, rotary_of(i), attend_of(i))
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
    rotary_of, attend_of = attention_inputs(cfg, segment_ids, cfg.num_layers, dtype, attention, mesh)

    def step(h, xs):
        lp, i = xs
        return constrain(layer(cfg, lp, h, rotary_of(i), attend_of(i))["resid_post"], ("batch", "seq", None)), None

    if remat != "none":
        step = jax.checkpoint(step, policy=REMAT_POLICIES[remat])
    h, _ = jax.lax.scan(step, embed(params, tokens, segment_ids, cfg, constrain),
                        (params["layers"], jnp.arange(cfg.num_layers)))
    return final_norm(params, cfg, h)


def final_norm(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """The norm after the last layer (what the LM head reads)."""
    return norm(h, params["final_norm"], params.get("final_norm_bias"), cfg)


def final_norm_scale(params: Params, cfg: ModelConfig) -> jax.Array:
    """The final norm's per-dim scale as it multiplies (Gemma's 1 + w): a latent's logit effect is its decoder
    direction times this, through the unembedding."""
    return params["final_norm"] + (1.0 if cfg.norm == "rms_one_plus" else 0.0)


def unembed(params: Params, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """Logits of final-normed hidden states, softcapped where the family caps them (Gemma 2)."""
    out = jnp.einsum("bsd,dv->bsv", h, lm_head(params, cfg).astype(h.dtype))
    if cfg.final_softcap:
        out = jnp.tanh(out / cfg.final_softcap) * cfg.final_softcap
    return out


def lm_head(params: Params, cfg: ModelConfig) -> jax.Array:
    """The [hidden, vocab] output projection: its own matrix, or the embedding's transpose when tied."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits(params: Params, tokens: jax.Array, segment_ids: jax.Array, *, cfg: ModelConfig, compute_dtype=None,
           remat: str = "none", constrain=None, attention: str = "dense", mesh=None) -> jax.Array:
    """[batch, seq, vocab] next-token logits, in the compute dtype."""
    h = decode(params, tokens, segment_ids, cfg=cfg, compute_dtype=compute_dtype, remat=remat, constrain=constrain,
               attention=attention, mesh=mesh)
    return unembed(params, cfg, h)
