"""The attention kernels (harvest.model.attention) equal the dense masked reference on packed rows, whole
models with them equal HF transformers (extraction) and the dense step (training), and the splash training
step holds no [seq, seq] array. The kernels run in Pallas interpret mode here: the same program as on
their chips, slowly."""

import json
import os
import shutil
import subprocess
import sys

import hf_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stored_values import assert_equal_to_hf, extract, stored_samples, write_jsonl

from harvest.demo import demo_checkpoint
from harvest.model.attention import (BLOCKS_ENV, AttentionError, attention_of, blocks_override, pallas_blocks,
                                     resolve)
from harvest.runtime.mesh import make_mesh


def packed_segments(lengths: list[list[int]], seq: int) -> np.ndarray:
    """Segment ids [rows, seq]: samples of `lengths` back to back (1, 2, ...), padding (0) after them."""
    segments = np.zeros((len(lengths), seq), np.int32)
    for row, lens in enumerate(lengths):
        segments[row, : sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
    return segments


def attend(kind, segments, window, mesh=None, softcap=None):
    return lambda q, k, v: attention_of(kind, jnp.asarray(segments), (window,), q.shape[-1] ** -0.5, mesh,
                                        softcap=softcap)(0)(q, k, v)


def assert_close(ours, theirs, what):
    scale = float(np.max(np.abs(theirs))) or 1.0
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5 * scale, err_msg=what)


SIXTEEN = [[8] * 15 + [5]]  # 16 samples in a row of 128 and 3 padding tokens

CASES = {  # kind, rows' sample lengths, seq, query heads, kv heads, window, mesh
    "splash-gqa8/2": ("splash", [[50, 40, 30], [128], [3, 60]], 128, 8, 2, None, None),
    "splash-mha4/4-16-samples-and-a-padding-row": ("splash", [*SIXTEEN, [], [100]], 128, 4, 4, None, None),
    "splash-window-40": ("splash", [[50, 90, 70, 30], [256], [3, 140]], 256, 8, 2, 40, None),
    "splash-row-200-padded-to-256": ("splash", [[120, 70], [200]], 200, 4, 4, None, None),
    "splash-mesh-heads-in-kv-groups": ("splash", [[50, 40, 30], [128], [3, 60], [70]], 128, 8, 2, None,
                                       "data=2,model=4"),
    "splash-mesh-kv-split": ("splash", [[50, 40, 30], [128], [3, 60], [70]], 128, 8, 2, 30, "data=2,fsdp=2,model=2"),
    "pallas-gpu-mha4/4-16-samples": ("pallas-gpu", [*SIXTEEN, [], [100]], 128, 4, 4, None, None),
    "pallas-gpu-mesh": ("pallas-gpu", [[120, 70], [200], [5], [190]], 200, 4, 4, None, "data=4,model=2"),
    "splash-2048": ("splash", [[300, 700, 48, 1000]], 2048, 2, 1, None, None),
}


# Gemma 2's score softcap (50 there; 2 here, where scores of unit-normal q and k reach it), with a window.
SOFTCAPPED = {
    "splash-softcap-window-40": ("splash", [[50, 90, 70, 30], [256], [3, 140]], 256, 8, 2, 40, None, 2.0),
    "splash-mesh-softcap": ("splash", [[50, 40, 30], [128], [3, 60], [70]], 128, 8, 2, None, "data=2,model=4", 2.0),
}


@pytest.mark.parametrize("case", list(CASES) + list(SOFTCAPPED))
def test_kernel_equals_the_dense_reference_values_and_gradients(case):
    """Values everywhere (padding attends to earlier padding in both), and the gradients of q, k and v for a
    loss over the real tokens only (padding outputs are never read: their cotangent is 0)."""
    kind, lengths, seq, heads, groups, window, mesh_spec, *softcap = {**CASES, **SOFTCAPPED}[case]
    softcap = softcap[0] if softcap else None
    segments = packed_segments(lengths, seq)
    mesh = make_mesh(mesh_spec) if mesh_spec else None
    rng = np.random.default_rng(seq + heads)
    q, k, v = (jnp.asarray(rng.standard_normal((len(lengths), seq, n, 16)), jnp.float32)
               for n in (heads, groups, groups))
    weights = jnp.asarray(rng.standard_normal(q.shape) * (segments != 0)[:, :, None, None], jnp.float32)

    def values_and_grads(kind):
        fn = attend(kind, segments, window, mesh, softcap)
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(weights)

    (out, grads), (want, want_grads) = (jax.jit(values_and_grads, static_argnums=0)(name) for name in (kind, "dense"))
    assert not np.isnan(np.asarray(out)).any()
    assert_close(out, want, "values")
    for name, ours, theirs in zip("qkv", grads, want_grads):
        assert_close(ours, theirs, f"d{name}")


@pytest.mark.parametrize("mesh_spec,window,softcap", [("data=8", None, None), ("data=2,model=4", 40, None),
                                                     ("data=2,fsdp=2,model=2", None, None), ("data=8", 30, 2.0)])
def test_blocks_on_a_mesh_equal_the_dense_reference(mesh_spec, window, softcap):
    """CPU extraction's blocks under shard_map (each device its own rows' block pairs; heads over `model`,
    within one kv group or with the groups split): the dense values on every real token (blocks' padding is
    never read, and holds other values), and every value the same bits as blocks on one device."""
    segments = packed_segments([[50, 40, 30], [128], [3, 60], [], [70, 58], [8] * 16, [100], [1]], 128)
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((8, 128, n, 16)), jnp.float32) for n in (8, 2, 2))
    mesh = make_mesh(mesh_spec)
    out = np.asarray(jax.jit(attend("blocks", segments, window, mesh, softcap))(q, k, v))
    real = segments != 0
    assert_close(out[real], np.asarray(jax.jit(attend("dense", segments, window, softcap=softcap))(q, k, v))[real],
                 mesh_spec)
    np.testing.assert_array_equal(out, np.asarray(jax.jit(attend("blocks", segments, window, softcap=softcap))(q, k, v)))


def pallas_calls(jaxpr) -> list:
    """The pallas_call equations in `jaxpr` and its sub-jaxprs (custom_vjp, pjit, ...)."""
    found = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"]
    return found + [eqn for sub in jax.extend.core.subjaxprs(jaxpr) for eqn in pallas_calls(sub)]


TILES = {  # head_dim, pallas-gpu tiles ($HARVEST_PALLAS_BLOCKS; None: the table's), rows' sample lengths, seq
    "d64-table": (64, None, [[100, 50, 100], [256]], 256),
    "d64-jax-defaults": (64, "128x128w4s2b32x32", [[100, 50, 100], [256]], 256),
    "d128-table-short-row": (128, None, [[70, 58], [3, 120]], 128),
}


@pytest.mark.parametrize("case", list(TILES))
def test_pallas_gpu_tiles_give_the_dense_values_and_gradients(case):
    """The tiles of the table and of a GPU sweep (bench/forward.py --pallas-blocks) at Qwen2.5-0.5B's head size
    (64) and 7B's (128), GQA 4/2: values and gradients equal the dense ones, and the forward kernel reads the
    kv heads themselves (never a copy repeated to the query heads)."""
    dim, spec, lengths, seq = TILES[case]
    segments = packed_segments(lengths, seq)
    rng = np.random.default_rng(dim)
    q, k, v = (jnp.asarray(rng.standard_normal((len(lengths), seq, n, dim)), jnp.float32) for n in (4, 2, 2))
    weights = jnp.asarray(rng.standard_normal(q.shape) * (segments != 0)[:, :, None, None], jnp.float32)

    def values_and_grads(kind, q, k, v, weights):
        out, pull = jax.vjp(attend(kind, segments, None), q, k, v)
        return out, pull(weights)

    with blocks_override(spec):
        traced = jax.make_jaxpr(attend("pallas-gpu", segments, None))(q, k, v)
        (out, grads), (want, want_grads) = (jax.jit(values_and_grads, static_argnums=0)(name, q, k, v, weights)
                                            for name in ("pallas-gpu", "dense"))
    (kernel,) = pallas_calls(traced.jaxpr)
    assert [tuple(x.aval.shape) for x in kernel.invars[1:3]] == [k.shape, v.shape]
    assert_close(out, want, "values")
    for name, ours, theirs in zip("qkv", grads, want_grads):
        assert_close(ours, theirs, f"d{name}")


def test_pallas_gpu_tiles_override_fills_in_from_the_table_and_bad_ones_are_one_line_errors(monkeypatch):
    table = pallas_blocks(64, 2048)
    monkeypatch.setenv(BLOCKS_ENV, "256x32w8")
    tiles = pallas_blocks(64, 128)  # blocks longer than the row are cut to it, as the kernel does
    assert (tiles.block_q, tiles.block_k, tiles.warps) == (128, 32, 8)
    assert (tiles.stages, tiles.back_q, tiles.back_k) == (table.stages, min(table.back_q, 128), min(table.back_k, 128))
    for spec, seq, words in (("256x32", 384, "block_q 256 does not divide the kernel's rows of 384"),
                             ("128", 2048, "write QxK"), ("128x48", 2048, "blocks are 16, 32"),
                             ("64x64w3", 2048, "warps are 1, 2, 4")):
        monkeypatch.setenv(BLOCKS_ENV, spec)
        with pytest.raises(AttentionError, match=words) as refused:
            pallas_blocks(64, seq)
        assert "\n" not in str(refused.value)


def test_auto_picks_by_backend_and_refusals_are_one_line_errors():
    windows = (None, 100)
    assert jax.default_backend() == "cpu"
    assert resolve("auto", windows, 256) == "blocks"
    assert resolve("auto", windows, 256, backward=True) == "dense"  # blocks has no backward pass
    assert resolve("pallas-gpu", windows, 100) == "pallas-gpu"  # a window as long as the row hides nothing
    for kind, seq, backward, words in (("pallas-gpu", 256, False, "sliding window of 100 tokens"),
                                       ("blocks", 256, True, "no backward pass"), ("flash", 256, False, "choose")):
        with pytest.raises(AttentionError, match=words) as refused:
            resolve(kind, windows, seq, backward=backward)
        assert "\n" not in str(refused.value) and refused.value.exit_code == 2
    with pytest.raises(AttentionError, match=r"softcap \(50\), which the Pallas GPU kernel lacks") as refused:
        resolve("pallas-gpu", (None,), 256, softcap=50.0)
    assert "\n" not in str(refused.value)
    assert resolve("splash", windows, 256, softcap=50.0) == "splash" == resolve("auto", windows, 256, softcap=50.0,
                                                                                 backend="tpu")


def test_auto_on_a_gpu_runs_a_softcapped_or_windowed_model_dense_and_says_so_in_one_line(caplog):
    assert resolve("auto", (None,), 256, backend="gpu") == "pallas-gpu"
    with caplog.at_level("WARNING", logger="harvest.model.attention"):
        assert resolve("auto", (None,), 256, softcap=50.0, backend="gpu") == "dense"
    assert [r.getMessage() for r in caplog.records] == [
        "attention: this model needs an attention score softcap (50), which the Pallas GPU kernel lacks; it runs "
        "dense attention (seq^2 memory per row)"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny random Qwen2s (GQA 6/2) with the demo's tokenizer: plain, and with sliding windows of 20 on
    layers 1 and up."""
    root = tmp_path_factory.mktemp("models")
    demo = demo_checkpoint(root / "demo")
    made = {}
    for name, overrides in (("plain", {}), ("windowed", {"use_sliding_window": True, "sliding_window": 20,
                                                         "max_window_layers": 1})):
        ckpt = ref.build_checkpoint("qwen2", root / name, overrides={"vocab_size": 320, **overrides})
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / file, ckpt / file)
        made[name] = ckpt
    return made


@pytest.mark.parametrize("kind,model", [("splash", "plain"), ("splash", "windowed"), ("pallas-gpu", "plain")])
def test_extraction_with_a_kernel_equals_hf(kind, model, checkpoints, tmp_path):
    """Rows of 96 tokens (padded to 128 inside the kernel) packing several texts, on an 8-device data mesh:
    every captured point of every sample equals HF's, and run.json records the kernel."""
    rng = np.random.default_rng(7)
    texts = ["".join(rng.choice(list("abcdefgh ij.,"), rng.integers(3, 90))) for _ in range(10)]
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out"
    extract(checkpoints[model], data, out, attention=kind, mesh="data=8")
    samples = stored_samples(out)
    assert sorted(sid for sid, _ in samples) == list(range(10))
    assert_equal_to_hf(checkpoints[model], samples)
    assert json.loads((out / "run.json").read_text())["config"]["attention"] == kind


def loss_and_grads(ckpt, kind: str, mesh, shape=(4, 128)):
    """The training step's loss and its gradients (train.loss.loss_sum, remat by layer, as make_step takes
    them) on packed rows, some padded. Gradients, not params after AdamW: Adam's first update is about
    lr * sign(g), so a gradient within rounding of 0 may move its param by 2 lr either way."""
    from functools import partial

    from harvest.model.config import ModelConfig
    from harvest.model.weights import load_params
    from harvest.runtime.mesh import constrainer
    from harvest.decoder.loss import loss_sum
    from harvest.decoder.step import batch_sharding

    model = ModelConfig.from_dir(ckpt)
    params = load_params(ckpt, model, mesh=mesh, head=True)
    tokens = np.random.RandomState(5).randint(0, 320, shape).astype(np.int32)
    segments = packed_segments([[30, 60, 38], [128], [10, 20, 30], [90]][: shape[0]], shape[1])
    loss = partial(loss_sum, cfg=model, compute_dtype="float32", remat="layer", constrain=constrainer(mesh),
                   attention=kind, mesh=mesh)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, *(jax.device_put(a, batch_sharding(shape, mesh))
                                                               for a in (tokens, segments)))
    return float(value), jax.device_get(grads)


@pytest.mark.parametrize("kind", ["splash", "pallas-gpu"])
def test_training_loss_and_gradients_with_a_kernel_equal_the_dense_ones(kind, checkpoints):
    """On a data=2 x fsdp=2 x model=2 mesh (heads split over model), remat by layer: the kernel's VJP under
    jax.checkpoint, scan and shard_map (splash on the windowed model: a switch between two kernels)."""
    mesh = make_mesh("data=2,fsdp=2,model=2")
    ckpt = checkpoints["windowed" if kind == "splash" else "plain"]
    (loss, grads), (want_loss, want) = loss_and_grads(ckpt, kind, mesh), loss_and_grads(ckpt, "dense", mesh)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, ours), theirs in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        assert_close(ours, theirs, jax.tree_util.keystr(path))


def square_arrays(jaxpr, seq: int) -> list[str]:
    """Every array in `jaxpr` and its sub-jaxprs whose last two dims are [seq, seq]; a pallas_call's kernel
    body is not entered (what it holds lives in the kernel's blocks, not in memory)."""
    found = []
    for var in [*jaxpr.invars, *jaxpr.constvars]:
        if getattr(var.aval, "shape", ())[-2:] == (seq, seq):
            found.append(f"input {var.aval}")
    for eqn in jaxpr.eqns:
        found += [f"{eqn.primitive.name} -> {v.aval}" for v in eqn.outvars
                  if getattr(v.aval, "shape", ())[-2:] == (seq, seq)]
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += square_arrays(sub.jaxpr, seq)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += square_arrays(sub, seq)
    return found


def test_splash_training_step_holds_no_seq_by_seq_array(checkpoints):
    """Read from the traced step (forward, remat and backward): the dense step has [seq, seq] masks and scores,
    the splash step none outside its kernels. Rows of 1024 (blocks of 512: no block is [seq, seq])."""
    from harvest.model.config import ModelConfig
    from harvest.model.weights import load_params
    from harvest.decoder.config import TrainConfig
    from harvest.decoder.optimizer import make_optimizer
    from harvest.decoder.step import make_step, state_shardings

    ckpt, seq = checkpoints["windowed"], 1024
    model = ModelConfig.from_dir(ckpt)
    mesh = make_mesh("data=1", jax.devices()[:1])
    optimizer = make_optimizer(TrainConfig(data="unused", out="unused", model=str(ckpt)))
    params = jax.eval_shape(lambda p: p, load_params(ckpt, model, head=True))
    shardings = state_shardings(optimizer, model, mesh, params)
    state = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": optimizer.init(p)},
                           params)
    batch = jax.ShapeDtypeStruct((2, seq), jnp.int32)
    found = {}
    for kind in ("splash", "dense"):
        step = make_step(model, mesh, optimizer, shardings, compute_dtype="float32", remat="layer", grad_accum=1,
                         batch_shape=(2, seq), lr_at=lambda s: 1e-4, attention=kind)
        traced = jax.make_jaxpr(step)(state, batch, batch)
        assert ("pallas_call" in str(traced)) == (kind == "splash")
        found[kind] = square_arrays(traced.jaxpr, seq)
    assert found["dense"], "the check finds nothing even in the dense step"
    assert found["splash"] == []


def test_cli_refuses_a_bad_attention_and_a_kernel_that_cannot_serve_the_model(checkpoints, tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": "hello"}])
    base = [sys.executable, "-m", "harvest", "extract", "--data", data, "--max-seq-len", "64"]
    for attention, model, words in (("flash", "plain", "--attention 'flash': choose one of auto, dense"),
                                    ("pallas-gpu", "windowed", "sliding window of 20 tokens")):
        out = tmp_path / attention
        result = subprocess.run([*base, "--model", str(checkpoints[model]), "--out", str(out),
                                 "--attention", attention], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 2, result.stderr
        assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not out.exists()
    # Training refuses a kernel with no backward pass before run.json or a checkpoint is written.
    out = tmp_path / "train-blocks"
    result = subprocess.run([sys.executable, "-m", "harvest", "train", "--model", str(checkpoints["plain"]),
                             "--data", data, "--out", str(out), "--seq-len", "64", "--batch-size", "1", "--steps", "1",
                             "--attention", "blocks"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--attention blocks" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()
