"""sae/cpu_kernels: the TopK step's own CPU kernels give what XLA's formulation gives (top-k bit for bit, gradients
to float32 rounding), a run trained through them reaches sparsify's FVU and resumes bit for bit, and without a
compiler the step falls back to XLA's, with one warning."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from extract_helpers import run_harvest
from sae_helpers import against_sparsify, train_args
from training_helpers import metrics

from harvest.sae import cpu_kernels as K
from harvest.sae import model as M

ONE_DEVICE = "--xla_force_host_platform_device_count=1"  # a CPU user's jax: one device

pytestmark = pytest.mark.skipif(not K.available(), reason="no C++ compiler here to build sae/cpu_kernels.cc")


def rows_with_ties(rng, rows: int, width: int) -> np.ndarray:
    """Pre-activations with many ties (a few levels), exact zeros, -0.0 and rows with fewer than k positives."""
    pre = rng.integers(-6, 4, (rows, width)).astype(np.float32) / 4
    pre[::3] = -np.abs(pre[::3])  # rows whose positives (if any) are fewer than k: zeros are chosen, lowest id first
    pre[1::5, ::7] = -0.0
    return pre


@pytest.mark.parametrize("width,k", [(4096, 32), (1000, 7), (37, 37), (64, 1), (16 * 40, 40)])
def test_top_k_equals_lax_top_k_bit_for_bit(width, k):
    """Values and indices equal lax.top_k's of ReLU(pre + bias), ties (lower id first) and zeros included, for
    widths that are and are not multiples of the kernel's groups of 16, and k up to the whole row."""
    rng = np.random.default_rng(width + k)
    for pre in (rng.standard_normal((64, width)).astype(np.float32), rows_with_ties(rng, 64, width)):
        bias = (rng.integers(-2, 2, width) / 8).astype(np.float32)
        values, indices = jax.jit(lambda p, b: K.top_k_relu(p, b, k))(pre, bias)
        want_values, want_indices = jax.lax.top_k(jax.nn.relu(pre + bias), k)
        np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


@pytest.mark.parametrize("aux_coeff,blocks", [(0.0, 1), (1 / 32, 1), (0.0, 4)])
def test_gradients_equal_xlas_formulation(aux_coeff, blocks, monkeypatch):
    """The loss, its metrics and every param's gradient (and x's, which the step never asks for) through the kernels
    equal XLA's sparse formulation to float32 rounding, with AuxK on dead latents and without, the rows encoded
    whole and in blocks, on one device and with the rows over 8."""
    from harvest.runtime.mesh import make_mesh

    monkeypatch.setattr(K, "PRE_BLOCK_BYTES", 256 // blocks * 520 * 4)
    spec = M.Spec("topk", 48, 520, 8, 24, aux_coeff=aux_coeff)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, spec.width)).astype(np.float32))
    params = M.init_params(jax.random.key(0), spec, jnp.mean(x, 0))
    params["b_enc"] = jnp.asarray(rng.standard_normal(spec.latents).astype(np.float32) / 20)
    dead = jnp.asarray(rng.random(spec.latents) < 0.3)

    def through(kernels):
        return jax.jit(jax.value_and_grad(lambda p, x: M.loss(p, x, spec, dead, None, kernels), argnums=(0, 1),
                                          has_aux=True))(params, x)

    (want_loss, want_metrics), (want_grads, want_d_x) = through(None)
    for mesh in (make_mesh("data=1", jax.devices()[:1]), make_mesh("data=8")):
        (loss, metrics), (grads, d_x) = through(mesh)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
        for name in want_metrics:
            np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-6)
        for name in want_grads:
            np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-4, atol=1e-6 * float(
                jnp.abs(want_grads[name]).max()), err_msg=name)
        np.testing.assert_allclose(d_x, want_d_x, rtol=1e-4, atol=1e-6 * float(jnp.abs(want_d_x).max()))


def test_an_index_outside_the_sae_is_refused():
    """The backward kernel checks every latent id before it touches memory: an id past the SAE is an error."""
    indices = jnp.asarray([[0, 5]], jnp.int32)
    ones = jnp.ones((1, 2), jnp.float32)
    with pytest.raises(Exception, match="outside the SAE"):
        jax.block_until_ready(K.backward(indices, ones, ones, jnp.ones((1, 4)), jnp.ones((1, 4)), jnp.ones((5, 4))))


def one_device_env(source: dict, **more) -> dict:
    return {**source["env"], "XLA_FLAGS": ONE_DEVICE, **more}


def test_a_run_through_the_kernels_reaches_sparsifys_fvu(sae_source, tmp_path):
    """`harvest sae train` on one CPU device (the kernels' path) and sparsify's trainer, the same rows in the same
    order (test_sae_references' settings): harvest's FVU on all the run's tokens is within 2% of sparsify's."""
    steps = 40
    out = str(tmp_path / "kernels")
    done = run_harvest(*train_args(sae_source, out, holdout_streams=0, tokens=64 * steps, checkpoint_every=100,
                                   log_every=10), env=one_device_env(sae_source))
    assert done.returncode == 0, done.stderr[-3000:]
    found = against_sparsify(sae_source, out, steps)
    assert found["ours_fvu"] <= found["theirs_fvu"] * 1.02, found


def test_a_run_through_the_kernels_resumes_bit_for_bit(sae_source, tmp_path):
    """A one-device run SIGKILLed at a random step, then SIGTERMed at the last but one, then rerun to the end
    (preemption.kill_hold_resume), ends with the params of one never interrupted, bit for bit: the kernels add in a
    fixed order, whatever the threads."""
    from preemption import kill_hold_resume
    from sae_helpers import STEPS
    from training_helpers import restored_params

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    env = one_device_env(sae_source)
    done = run_harvest(*train_args(sae_source, straight), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    kill_hold_resume(train_args(sae_source, resumed), env, STEPS)
    jax.tree.map(np.testing.assert_array_equal, restored_params(resumed), restored_params(straight))


def test_without_a_compiler_the_step_keeps_xlas_formulation(sae_source, tmp_path):
    """With a compiler that fails (and an empty cache), `harvest sae train` warns once in one line, trains through
    XLA's formulation, and ends where the kernels' run ends (float32 rounding apart)."""
    outs = {}
    for name, more in (("kernels", {}), ("xla", {"CXX": "/bin/false", "HARVEST_CACHE": str(tmp_path / "cache")})):
        outs[name] = str(tmp_path / name)
        done = run_harvest(*train_args(sae_source, outs[name]), env=one_device_env(sae_source, **more))
        assert done.returncode == 0, done.stderr[-3000:]
        warned = [line for line in done.stderr.splitlines() if "did not build" in line]
        assert len(warned) == (name == "xla"), done.stderr[-3000:]
    assert not os.listdir(tmp_path / "cache" / "kernels")  # nothing half-built left behind
    assert metrics(outs["xla"])[-1]["fvu"] == pytest.approx(metrics(outs["kernels"])[-1]["fvu"], rel=1e-3)
