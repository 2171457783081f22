"""SAE latents over the mesh's `model` axis: the two-stage top-k equals lax.top_k, the loss and gradients equal
one device's, the compiled step all-gathers no [rows, latents] array, and 2 processes x 4 devices with
model=8 train to one device's params and held-out metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import harvest_cmd, run_harvest
from processes import free_port, run_processes, two_process_env
from sae_helpers import train_args
from training_helpers import assert_trees_close, restored_params


def test_two_stage_top_k_equals_the_global_one():
    """Latents over model=4 (rows over data=2): the two-stage top-k gives lax.top_k's values and ids, ties
    (values on a coarse grid) broken alike, and the bisected batch threshold lax.top_k's n-th value."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from harvest.runtime.mesh import make_mesh
    from harvest.sae.topk import kth_largest, top_k

    mesh = make_mesh("data=2,model=4")
    x = jnp.round(jax.nn.relu(jax.random.normal(jax.random.key(0), (16, 64))) * 4) / 4  # many ties, many zeros
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "model")))
    for k in (1, 5, 16, 20):
        values, ids = jax.jit(lambda a, k=k: top_k(a, k, mesh))(placed)
        want_values, want_ids = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(ids, want_ids)
    for n in (1, 37, 16 * 8, 16 * 64):
        got = float(jax.jit(lambda a, n=n: kth_largest(a, n, mesh))(placed))
        assert got == float(jax.lax.top_k(x.ravel(), n)[0][-1]), n


@pytest.mark.parametrize("architecture", ["topk", "batchtopk"])
def test_latents_over_model_give_the_one_device_loss_and_gradients(architecture):
    """One process, 8 devices, latents over model (data=2 x model=4): the loss, metrics and gradients of the
    masked formulation with the two-stage top-k equal one device's (topk: its sparse backward), AuxK on."""
    import jax
    import jax.numpy as jnp

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M

    spec = M.Spec(architecture, 16, 128, 4, 8, 1 / 32)
    x = jax.random.normal(jax.random.key(1), (64, 16))
    params = {**M.init_params(jax.random.key(0), spec, x.mean(0)),
              "b_enc": 0.1 * jax.random.normal(jax.random.key(2), (128,))}
    dead = jnp.arange(128) % 3 == 0
    results = [jax.jit(jax.value_and_grad(lambda p, m=m: M.loss(p, x, spec, dead, m), has_aux=True))(params)
               for m in (None, make_mesh("data=2,model=4"))]
    assert_trees_close(results[1], results[0], rtol=1e-5)


def test_latents_over_model_gather_no_rows_by_latents_array():
    """The compiled step (topk and batchtopk, AuxK on, data=2 x model=4) all-gathers nothing the size of the
    [rows, latents] pre-activations, not even one data slot's share: only the k x model candidates per row."""
    import re

    import jax
    import jax.numpy as jnp

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M
    from harvest.sae.step import make_optimizer, make_step, state_shardings

    mesh = make_mesh("data=2,model=4")
    rows, latents = 64, 1024
    specs = {a: M.Spec(a, 16, latents, 4, 8, 1 / 32) for a in ("topk", "batchtopk")}
    optimizers = {a: make_optimizer(1e-3, 1, 10, "linear") for a in specs}
    shapes = {a: jax.eval_shape(lambda s=s: M.init_params(jax.random.key(0), s, jnp.zeros(16)))
              for a, s in specs.items()}
    shardings = state_shardings(specs, optimizers, mesh, shapes)
    step = make_step(specs, optimizers, shardings, mesh, dead_tokens=100, scales=dict.fromkeys(specs, 1.0),
                     compute_dtype="float32")
    state = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                                      "opt_state": {a: optimizers[a].init(p[a]) for a in specs},
                                      "idle": {a: jnp.zeros(latents, jnp.int32) for a in specs}}, shapes)
    batch = {a: jax.ShapeDtypeStruct((rows, 16), jnp.float32) for a in specs}
    hlo = step.lower(state, batch).compile().as_text()
    gathered = [math.prod(int(d) for d in dims.split(",") if d) for dims in
                re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)]
    assert gathered, "expected the candidates' all-gathers"
    assert max(gathered) < rows // 2 * latents // 4, sorted(gathered)[-5:]


def test_two_processes_with_latents_over_model_equal_one_device(sae_source, tmp_path):
    """2 processes x 4 devices, mesh model=8 (latents split 8 ways: masked matmuls, the two-stage top-k) against
    one device (the gathered sparse decode): the params after 4 steps agree to 1e-5, and so do the held-out
    metrics (--eval-every 2)."""
    settings = ["--tokens", str(64 * 4), "--checkpoint-every", "100", "--eval-every", "2"]
    address = f"127.0.0.1:{free_port()}"
    two = str(tmp_path / "two")
    codes = run_processes([harvest_cmd(*train_args(sae_source, two), *settings, "--mesh", "model=8", "--coordinator",
                                       address, "--num-processes", "2", "--process-id", str(pid))
                           for pid in range(2)], two_process_env(tmp_path), tmp_path)
    assert codes == [0, 0], [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    one = str(tmp_path / "one")
    done = run_harvest(*train_args(sae_source, one), *settings, env={**sae_source["env"], "XLA_FLAGS":
                                                                 "--xla_force_host_platform_device_count=1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_close(restored_params(two), restored_params(one), rtol=1e-5)
    evals = [{r["step"]: [r[k] for k in ("eval_fvu", "eval_l0", "eval_dead_fraction")]
              for r in map(json.loads, Path(out, "metrics.jsonl").read_text().splitlines()) if "eval_fvu" in r}
             for out in (two, one)]
    assert list(evals[0]) == [2, 4]
    np.testing.assert_allclose(np.array(list(evals[0].values())), np.array(list(evals[1].values())), rtol=1e-5)
