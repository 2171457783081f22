"""Sparse autoencoders as pure functions over a params dict: init, encode, decode, the losses.

params: W_enc [d, L], b_enc [L], W_dec [L, d], b_dec [d] (SAELens's layout), for jumprelu log_threshold [L],
for batchtopk its inference threshold (a scalar). encode(x) = act((x - b_dec) @ W_enc + b_enc),
decode(a) = a @ W_dec + b_dec.

topk keeps each token's k largest ReLU pre-activations (sparsify's recipe: decoder rows at unit norm, the
gradient's part along them removed, loss = FVU + aux_coeff x AuxK on dead latents); batchtopk keeps the
batch's B x k largest and learns the threshold used at inference; jumprelu thresholds each latent at
exp(log_threshold) with straight-through gradients and an L0 penalty; relu has an L1 penalty weighted by
the decoder norms (SAELens's standard SAE).

Latents are "sparse" (values and indices, [B, k]) where they can be: a topk SAE decodes by gathering k
decoder rows per token (B k d work, not B L d), and its backward scatters into the k chosen encoder
columns alone (the forward's [B, L] matmul is the only dense one). With latents sharded over a mesh's
`model` axis (`mesh` given), it encodes and decodes by masked matmuls instead, which partition along the
latents, and its top-k thresholds come from sae/topk.py's two stages (no [B, L] array is gathered).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from harvest.sae import cpu_kernels
from harvest.sae.topk import kth_largest, kth_value

SPARSE = ("topk",)
UNIT_DECODER = ("topk", "batchtopk")
RELU_DECODER_NORM = 0.1  # SAELens's decoder_init_norm (Anthropic's 2024 heuristic)


class Spec(NamedTuple):
    """What the functions need to know about one SAE (static under jit)."""

    architecture: str
    width: int
    latents: int
    k: int
    aux_k: int
    aux_coeff: float = 0.0
    l1_coeff: float = 0.0
    bandwidth: float = 0.001


def init_params(key: jax.Array, spec: Spec, b_dec: jax.Array, init_threshold: float = 0.001) -> dict:
    """sparsify's init: encoder rows uniform in +-1/sqrt(d) (torch's Linear), decoder = encoder rows at unit
    norm, zero encoder bias; b_dec as given (the first batch's mean or median). relu: SAELens's, decoder rows
    at norm 0.1 and the encoder their transpose."""
    bound = 1 / np.sqrt(spec.width)
    rows = jax.random.uniform(key, (spec.latents, spec.width), jnp.float32, -bound, bound)
    w_dec = unit_rows(rows) * (RELU_DECODER_NORM if spec.architecture == "relu" else 1.0)
    params = {"W_enc": w_dec.T if spec.architecture == "relu" else rows.T,
              "b_enc": jnp.zeros(spec.latents, jnp.float32), "W_dec": w_dec, "b_dec": b_dec.astype(jnp.float32)}
    if spec.architecture == "jumprelu":
        params["log_threshold"] = jnp.full(spec.latents, np.log(init_threshold), jnp.float32)
    if spec.architecture == "batchtopk":
        params["threshold"] = jnp.zeros((), jnp.float32)  # learned from the batches, used at inference
    return params


def unit_rows(w: jax.Array) -> jax.Array:
    return w / (jnp.linalg.norm(w, axis=-1, keepdims=True) + jnp.finfo(w.dtype).eps)


def without_parallel_part(grad: jax.Array, w: jax.Array) -> jax.Array:
    """The decoder gradient less its component along each (unit) decoder row."""
    return grad - jnp.sum(grad * w, axis=-1, keepdims=True) * w


def pre_activations(params: dict, x: jax.Array) -> jax.Array:
    return (x - params["b_dec"]) @ params["W_enc"] + params["b_enc"]


@jax.custom_jvp
def _step(x, threshold, bandwidth):
    return (x > threshold).astype(x.dtype)


@_step.defjvp
def _step_jvp(primals, tangents):
    """Heaviside(x - t): zero gradient in x, a rectangle-kernel estimate in t (Rajamanoharan et al. 2024)."""
    x, threshold, bandwidth = primals
    _, t_dot, _ = tangents
    inside = (jnp.abs(x - threshold) < bandwidth / 2).astype(x.dtype)
    return _step(x, threshold, bandwidth), -inside / bandwidth * t_dot


@jax.custom_jvp
def _jumprelu(x, threshold, bandwidth):
    return x * (x > threshold).astype(x.dtype)


@_jumprelu.defjvp
def _jumprelu_jvp(primals, tangents):
    x, threshold, bandwidth = primals
    x_dot, t_dot, _ = tangents
    gate = (x > threshold).astype(x.dtype)
    inside = (jnp.abs(x - threshold) < bandwidth / 2).astype(x.dtype)
    return _jumprelu(x, threshold, bandwidth), gate * x_dot - threshold * inside / bandwidth * t_dot


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _top_acts(centred: jax.Array, w_enc: jax.Array, b_enc: jax.Array, k: int):
    """(values [B, k], indices [B, k], ReLU pre-activations [B, L]) of the k largest; `pre` carries no
    gradient (AuxK takes its own through `gathered_acts`)."""
    pre = jax.nn.relu(centred @ w_enc + b_enc)
    values, indices = jax.lax.top_k(pre, k)
    return values, indices, pre


def _top_acts_fwd(centred, w_enc, b_enc, k):
    values, indices, pre = _top_acts(centred, w_enc, b_enc, k)
    return (values, indices, pre), (centred, w_enc, values, indices)


def _top_acts_bwd(k, saved, cotangents):
    """Only the k chosen latents of a row have a gradient: scatter k columns (B k d), not a dense [B, L]
    matmul (B L d) for W_enc, and gather k columns for the input's (b_dec's) gradient."""
    centred, w_enc, values, indices = saved
    g = jnp.where(values > 0, cotangents[0], 0.0)
    flat = indices.reshape(-1)
    rows = w_enc.T
    d_centred = jnp.einsum("bk,bkd->bd", g, rows[indices])
    d_rows = jnp.zeros_like(rows).at[flat].add((g[..., None] * centred[:, None, :]).reshape(-1, centred.shape[-1]))
    d_bias = jnp.zeros(w_enc.shape[1], g.dtype).at[flat].add(g.reshape(-1))
    return d_centred, d_rows.T, d_bias


_top_acts.defvjp(_top_acts_fwd, _top_acts_bwd)


def encode_sparse(params: dict, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(values [B, k], indices [B, k], ReLU pre-activations [B, L], without gradient) of a topk SAE."""
    return _top_acts(x - params["b_dec"], params["W_enc"], params["b_enc"], k)


def gathered_acts(params: dict, x: jax.Array, indices: jax.Array) -> jax.Array:
    """ReLU pre-activations of the latents `indices` [B, n] only (B n d work), with their gradient."""
    columns = params["W_enc"].T[indices]
    return jax.nn.relu(jnp.einsum("bd,bnd->bn", x - params["b_dec"], columns) + params["b_enc"][indices])


def encode(params: dict, x: jax.Array, spec: Spec, inference: bool = False, mesh: Mesh | None = None) -> jax.Array:
    """Dense latents [B, L]. batchtopk: in training the batch's B x k largest; at inference those above its
    learned threshold. `mesh`: the latents are split over its `model` axis."""
    pre = pre_activations(params, x)
    if spec.architecture == "topk":
        pre = jax.nn.relu(pre)
        kth = kth_value(jax.lax.stop_gradient(pre), spec.k, mesh)
        return jnp.where(pre >= kth, pre, 0.0)
    if spec.architecture == "batchtopk":
        pre = jax.nn.relu(pre)
        if inference:
            return jnp.where(pre > params["threshold"], pre, 0.0)
        threshold = kth_largest(jax.lax.stop_gradient(pre), spec.k * pre.shape[0], mesh)
        return jnp.where(pre >= threshold, pre, 0.0)
    if spec.architecture == "jumprelu":
        return _jumprelu(pre, jnp.exp(params["log_threshold"]), spec.bandwidth)
    return jax.nn.relu(pre)


def decode(params: dict, latents: jax.Array) -> jax.Array:
    return latents @ params["W_dec"] + params["b_dec"]


def decode_sparse(params: dict, values: jax.Array, indices: jax.Array, bias: bool = True) -> jax.Array:
    out = jnp.einsum("bk,bkd->bd", values, params["W_dec"][indices])
    return out + params["b_dec"] if bias else out


def geometric_median(x: jax.Array, iterations: int = 50) -> jax.Array:
    """The point minimizing the summed distances to x's rows (Weiszfeld's iterations from the mean)."""

    def update(_, point):
        weights = 1 / jnp.maximum(jnp.linalg.norm(x - point, axis=-1), 1e-8)
        return weights @ x / jnp.sum(weights)

    return jax.lax.fori_loop(0, iterations, update, jnp.mean(x, axis=0))


def total_variance(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x - jnp.mean(x, axis=0)))


def fvu(x: jax.Array, reconstruction: jax.Array) -> jax.Array:
    """Fraction of variance unexplained: ||x - x_hat||^2 / ||x - mean(x)||^2 over the batch."""
    return jnp.sum(jnp.square(x - reconstruction)) / total_variance(x)


def auxk_loss(params: dict, x: jax.Array, pre: jax.Array, residual: jax.Array, dead: jax.Array, aux_k: int,
              variance: jax.Array) -> jax.Array:
    """The top `aux_k` dead latents' reconstruction of the residual the live ones left (OpenAI's AuxK), scaled
    down while fewer than aux_k latents are dead; 0 when none is. The dead latents are picked from `pre`; their
    values (and gradients) are recomputed for those latents alone."""
    num_dead = jnp.sum(dead)
    picked, indices = jax.lax.top_k(jnp.where(dead, jax.lax.stop_gradient(pre), -jnp.inf), aux_k)
    values = jnp.where(jnp.isfinite(picked), gathered_acts(params, x, indices), 0.0)
    estimate = decode_sparse(params, values, indices, bias=False)
    scale = jnp.minimum(num_dead / aux_k, 1.0)
    return scale * jnp.sum(jnp.square(estimate - jax.lax.stop_gradient(residual))) / variance


def auxk_loss_dense(params: dict, pre: jax.Array, residual: jax.Array, dead: jax.Array, aux_k: int,
                    variance: jax.Array, mesh: Mesh | None) -> jax.Array:
    """auxk_loss with the top `aux_k` dead latents as a mask over [B, L] (a masked matmul decodes them), for
    latents split over `mesh`'s `model` axis; `pre` is the ReLU pre-activations, with their gradient."""
    candidates = jnp.where(dead, jax.lax.stop_gradient(pre), -jnp.inf)
    kth = kth_value(candidates, aux_k, mesh)
    estimate = jnp.where((candidates >= kth) & jnp.isfinite(candidates), pre, 0.0) @ params["W_dec"]
    scale = jnp.minimum(jnp.sum(dead) / aux_k, 1.0)
    return scale * jnp.sum(jnp.square(estimate - jax.lax.stop_gradient(residual))) / variance


@partial(jax.jit, static_argnames=("spec",))
def infer(params: dict, x: jax.Array, spec: Spec) -> tuple[jax.Array, jax.Array]:
    """(latents [B, L], reconstruction [B, d]) at inference (batchtopk: its learned threshold)."""
    latents = encode(params, x, spec, inference=True)
    return latents, decode(params, latents)


def loss(params: dict, x: jax.Array, spec: Spec, dead: jax.Array, mesh: Mesh | None = None,
         kernels: Mesh | None = None) -> tuple[jax.Array, dict]:
    """(the loss to minimize, metrics: fvu, l0, aux_loss, and for batchtopk the batch's smallest firing value).
    `mesh`: the latents are split over its `model` axis (the dense masked formulation). `kernels`: topk's sparse
    step through sae/cpu_kernels, x's rows over this mesh's data axes (cpu_kernels.usable)."""
    variance = total_variance(x)
    aux = jnp.zeros((), jnp.float32)
    extra = {}
    if spec.architecture in SPARSE and mesh is None:
        if kernels is not None:
            decoded, values, indices = cpu_kernels.reconstruct_rows(kernels, x, params["b_dec"], params["W_enc"],
                                                                    params["b_enc"], params["W_dec"], spec.k)
            out = decoded + params["b_dec"]
            pre = jax.lax.stop_gradient(jax.nn.relu(pre_activations(params, x)))  # for AuxK alone (else unused)
        else:
            values, indices, pre = encode_sparse(params, x, spec.k)
            out = decode_sparse(params, values, indices)
        # fired: active (> 0) on a token, as every other path and `sae eval` count it (a latent top-k picked at 0 is not)
        fired = jnp.zeros(spec.latents, bool).at[indices.reshape(-1)].max(values.reshape(-1) > 0)
        l0 = jnp.mean(jnp.sum(values > 0, axis=-1).astype(jnp.float32))
    else:
        pre = pre_activations(params, x)
        latents = encode(params, x, spec, mesh=mesh)
        out = decode(params, latents)
        fired = jnp.any(latents > 0, axis=0)
        l0 = jnp.mean(jnp.sum(latents > 0, axis=-1).astype(jnp.float32))
        pre = jax.nn.relu(pre) if spec.architecture in UNIT_DECODER else pre
        if spec.architecture == "batchtopk":
            extra["min_active"] = jnp.min(jnp.where(latents > 0, latents, jnp.inf))
    unexplained = fvu(x, out)
    if spec.architecture in UNIT_DECODER:
        total = unexplained
        if spec.aux_coeff > 0:
            aux = (auxk_loss(params, x, pre, x - out, dead, spec.aux_k, variance) if mesh is None else
                   auxk_loss_dense(params, pre, x - out, dead, spec.aux_k, variance, mesh))
            total = total + spec.aux_coeff * aux
    else:
        mse = jnp.mean(jnp.sum(jnp.square(out - x), axis=-1))
        if spec.architecture == "relu":
            norms = jnp.linalg.norm(params["W_dec"], axis=-1)
            aux = jnp.mean(jnp.sum(jax.nn.relu(pre) * norms, axis=-1))
        else:
            aux = jnp.mean(jnp.sum(_step(pre, jnp.exp(params["log_threshold"]), spec.bandwidth), axis=-1))
        total = mse + spec.l1_coeff * aux
    return total, {"fvu": unexplained, "l0": l0, "aux_loss": aux, "fired": fired, **extra}
