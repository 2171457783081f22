"""The pass's running state on the devices, updated by one jitted step per batch with no host round trip;
handed to the host (sae/features/state.py) once per shard.

The SAE's latents are split over the devices as `harvest sae train` splits them over its mesh's `model` axis
(every device on it; replicated where their count does not divide the latents); each batch's rows go whole to
every device. So each device encodes its own latents, and the per-latent state ([L, ...]) lives beside
them: no [B, L] array crosses devices. (A block of the encoder's columns multiplies apart from the rest: with
another device count a latent's value can differ in its last bit; reruns, resumes and ranks on the same count
agree bit for bit.) Top-K and the sample merge a
batch by lax.top_k over [kept, batch]: on equal values the lower index wins, and both the kept entries (ties
in position order) and the batch's (in offset order) come earlier than anything later in the pass, so
the earlier token wins, as state.merge orders them.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harvest.runtime.mesh import make_mesh
from harvest.sae import model as M
from harvest.sae.step import param_specs
from harvest.sae.features.state import NO_KEY, NUM_BINS, TensorState, add_exact, bin_index, sample_key


class Running(NamedTuple):
    """Kept across shards: max, top-K and sample; per shard (reset at each flush): count, sum, histogram."""

    max: jax.Array
    top_value: jax.Array
    top_pos: jax.Array
    sample_key: jax.Array
    sample_value: jax.Array
    sample_pos: jax.Array
    count: jax.Array
    sum: jax.Array
    hist: jax.Array


def device_mesh() -> Mesh:
    """This process's devices as harvest's (data, fsdp, model) mesh, all on `model`."""
    return make_mesh("1d", jax.local_devices())


def split(mesh: Mesh, latents: int) -> bool:
    return mesh.shape["model"] > 1 and latents % mesh.shape["model"] == 0


def latent_sharding(mesh: Mesh, latents: int) -> NamedSharding:
    """[L, ...] arrays split by latent over the devices (replicated where their count does not divide L)."""
    return NamedSharding(mesh, PartitionSpec("model") if split(mesh, latents) else PartitionSpec())


def whole(mesh: Mesh) -> NamedSharding:
    """A batch's rows (and anything else not per latent): whole on every device."""
    return NamedSharding(mesh, PartitionSpec())


def place(params: dict, spec: M.Spec, mesh: Mesh) -> dict:
    """An SAE's params on the devices, latents split as the trainer splits them (sae/step.param_specs)."""
    specs = param_specs(spec) if split(mesh, spec.latents) else {}
    return {k: jax.device_put(v, NamedSharding(mesh, specs.get(k, PartitionSpec()))) for k, v in params.items()}


def start(state: TensorState, mesh: Mesh) -> Running:
    """The device state from a host one (kept fields as saved; per-shard ones at zero)."""
    latents = len(state.count)
    put = partial(jax.device_put, device=latent_sharding(mesh, latents))
    return Running(put(state.max), put(state.top_value), put(state.top_pos), put(state.sample_key),
                   put(state.sample_value), put(state.sample_pos), put(np.zeros(latents, np.int32)),
                   put(np.zeros(latents, np.float32)), put(np.zeros((latents, NUM_BINS), np.int32)))


def flush(running: Running, state: TensorState, mesh: Mesh) -> Running:
    """Add the shard's counts, sum and histogram into the host `state` (in place); the running state with
    them at zero again."""
    count, total, hist = jax.device_get((running.count, running.sum, running.hist))
    state.count += count
    add_exact(state.sum_hi, state.sum_lo, total)
    state.hist += hist
    put = partial(jax.device_put, device=latent_sharding(mesh, len(count)))
    return running._replace(count=put(np.zeros_like(count)), sum=put(np.zeros_like(total)),
                            hist=put(np.zeros_like(hist)))


def kept(running: Running, state: TensorState) -> None:
    """Copy the kept fields (max, top-K, sample) into the host `state` (flush first: the per-shard ones)."""
    fields = ("max", "top_value", "top_pos", "sample_key", "sample_value", "sample_pos")
    for name, value in zip(fields, jax.device_get([getattr(running, f) for f in fields])):
        setattr(state, name, np.asarray(value))


def make_encode(spec: M.Spec, mesh: Mesh):
    """jitted (params from `place`, x [B, d] float32) -> latents [B, L] at inference (sae/model.encode's values).
    The pass and the contexts both encode with it, apart from the update: a row's latents then have the same
    bits in both (XLA fusing the encoding into the update would round it otherwise)."""
    sharded = mesh if split(mesh, spec.latents) else None

    def encode(params: dict, x: jax.Array) -> jax.Array:
        return M.encode(params, x, spec, inference=True, mesh=sharded)

    return jax.jit(encode)


def make_update(spec: M.Spec, mesh: Mesh):
    """jitted (running, acts [B, L] from make_encode, valid [B] bool, ordinal int32, offsets [B] int32) ->
    running (donated)."""
    by_latent = latent_sharding(mesh, spec.latents)

    def update(run: Running, acts: jax.Array, valid: jax.Array, ordinal: jax.Array, offsets: jax.Array) -> Running:
        acts = jnp.where(valid[:, None], acts, 0.0)
        fired = acts > 0
        count = run.count + jnp.sum(fired, axis=0, dtype=jnp.int32)
        total = run.sum + jnp.sum(acts, axis=0)
        top = jnp.maximum(run.max, jnp.max(acts, axis=0))
        acts_t = jax.lax.with_sharding_constraint(acts.T, by_latent)  # [L, B]: each latent's batch, together
        fired_t = acts_t > 0
        top_value, top_pos, _ = _merge(run.top_value, run.top_pos, jnp.where(fired_t, acts_t, -jnp.inf),
                                       ordinal, offsets)
        lat = jnp.arange(spec.latents, dtype=jnp.int32)
        skey, spos, svalue = run.sample_key, run.sample_pos, run.sample_value
        if skey.shape[1]:  # --bins 0: no sample
            keys = jnp.where(fired_t, sample_key(jnp, ordinal, offsets[None, :], lat[:, None]), NO_KEY)
            ranked, spos, chosen = _merge(_as_float(skey), spos, _as_float(keys), ordinal, offsets)
            skey = jnp.where(ranked < 0, NO_KEY, jax.lax.bitcast_convert_type(ranked, jnp.int32))
            svalue = jnp.take_along_axis(jnp.concatenate([run.sample_value, acts_t], axis=1), chosen, axis=1)
        where = jnp.where(fired, bin_index(jnp, acts) + lat[None, :] * NUM_BINS, spec.latents * NUM_BINS)
        hist = run.hist.reshape(-1).at[where.reshape(-1)].add(1, mode="drop").reshape(run.hist.shape)
        return Running(top, top_value, top_pos, skey, svalue, spos, count, total, hist)

    return jax.jit(update, donate_argnums=0)


def _as_float(keys: jax.Array) -> jax.Array:
    """Sample keys as floats of the same order (state.sample_key); no key as -1."""
    return jnp.where(keys == NO_KEY, -1.0, jax.lax.bitcast_convert_type(keys, jnp.float32))


def _merge(kept, kept_pos, batch, ordinal, offsets):
    """The kept [L, n] entries and a batch's [L, B] merged: the n largest (on ties the lower index: kept first),
    their positions, and the indices chosen in [kept, batch]."""
    n = kept.shape[1]
    both = jnp.concatenate([kept, batch], axis=1)
    value, chosen = jax.lax.top_k(both, n)
    old = jnp.take_along_axis(kept_pos, jnp.clip(chosen, 0, n - 1)[..., None], axis=1)
    new = jnp.stack([jnp.broadcast_to(ordinal, chosen.shape), offsets[jnp.clip(chosen - n, 0, len(offsets) - 1)]],
                    axis=-1)
    return value, jnp.where((chosen < n)[..., None], old, new), chosen
