"""8-bit codes made on the device: the compiled forward hands the host each captured token as codes and one
float32 scale (harvest.store.quant's absmax-per-token scheme, its QMAX and CODES, the same bounds) instead of
float32 values, a quarter of the bytes across the device->host copy and through the host stage.

The host keeps only the codes, so what the sidecars' stats need of the values comes from the device too: each
piece's moments (harvest.model.moments) and its first token in float32 (`piece_firsts`), computed from the
values before they become codes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from harvest.store.quant import CODES, QMAX, scale_name


def quantize(values: jax.Array, code: str) -> tuple[jax.Array, jax.Array]:
    """values [..., width] -> (codes [..., width] of `code`, scales [...] float32), as store.quant.quantize:
    scale = max|x| / QMAX, codes = x * (1 / scale) (0 where the scale is 0) rounded to nearest even (int8) or
    cast (float8_e4m3fn), clipped to +-QMAX. Equal to the host's codes where the backend's float32 arithmetic is
    IEEE's (XLA on CPU); elsewhere a code may differ by one step, within the documented bounds."""
    x = values.astype(jnp.float32)
    qmax = QMAX[code]
    absmax = jnp.max(jnp.abs(x), axis=-1)
    # A true division, as numpy's: XLA turns one by a broadcast scalar into a product with its (rounded) inverse.
    scale = absmax / jax.lax.optimization_barrier(jnp.full_like(absmax, qmax))
    inverse = jnp.where(scale > 0, 1 / jnp.where(scale > 0, scale, 1), 0)[..., None]
    scaled = x * inverse
    if code == "int8":
        scaled = jnp.rint(scaled)
    return jnp.clip(scaled, -qmax, qmax).astype(CODES[code]), scale


def quantized(captures: dict[str, jax.Array], code: str) -> dict[str, jax.Array]:
    """{point: values} -> {point: codes, store.quant.scale_name(point): scales}."""
    out = {}
    for point, values in captures.items():
        out[point], out[scale_name(point)] = quantize(values, code)
    return out


def piece_firsts(values: jax.Array, segment_ids: jax.Array, samples: int) -> jax.Array:
    """values [layers, batch, seq, width], segment_ids [batch, seq] -> [layers, batch, samples, width] float32:
    [:, :, k] holds segment k+1's first token (zeros where a row has fewer samples), for the stats of each sample's
    first token (the host has only its codes)."""
    starts = segment_ids[:, :, None] == jnp.arange(1, samples + 1, dtype=segment_ids.dtype)  # [batch, seq, samples]
    first = jnp.argmax(starts, axis=1)  # [batch, samples]: 0 where absent
    taken = jnp.take_along_axis(values.astype(jnp.float32), first[None, :, :, None], axis=2)
    return jnp.where(starts.any(axis=1)[None, :, :, None], taken, 0.0)
