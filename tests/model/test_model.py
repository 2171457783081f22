"""harvest's forward equals HF transformers' own values at every capture point, for every family."""

import hf_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest.model.blocks import block_pairs
from harvest.model.config import ModelConfig
from harvest.model.points import parse_points
from harvest.model.transformer import captures_by_key, forward
from harvest.model.weights import load_params
from harvest.runtime.mesh import constrainer, make_mesh

ALL_POINTS = ",".join(f"{p}:all" for p in ref.POINTS)
fwd = jax.jit(forward, static_argnames=("cfg", "plan", "constrain", "attention"))


def run(ckpt, ids, segments=None, dtype=np.float32, points=ALL_POINTS, mesh=None, block_sparse=False):
    cfg = ModelConfig.from_dir(ckpt)
    plan = parse_points(points, cfg.num_layers)
    params = load_params(ckpt, cfg, dtype=dtype, mesh=mesh, num_layers=plan.num_layers)
    segments = np.ones_like(ids) if segments is None else segments
    out = fwd(params, jnp.asarray(ids, jnp.int32), jnp.asarray(segments, jnp.int32),
              cfg=cfg, plan=plan, constrain=constrainer(mesh), attention="blocks" if block_sparse else "dense")
    return {k: np.asarray(v, np.float32) for k, v in captures_by_key(plan, out).items()}


# attn_z, each head's softmax-weighted mean of values before the output projection mixes them, shows the summation
# order of long rows (a block-sparse fold over 256 tokens) at up to 2e-5 of its scale.
LOOSER = {"attn_z": 3}


def assert_close(ours, theirs, rtol):
    """Relative to each tensor's scale: elementwise relative error blows up near zero."""
    for key, want in theirs.items():
        scale, tol = float(np.max(np.abs(want))), rtol * LOOSER.get(key[0], 1)
        np.testing.assert_allclose(ours[key], want, rtol=tol, atol=tol * scale, err_msg=str(key))


def assert_bf16_rounding(ours, theirs, exact):
    """bf16 rounds; ours may be no further from the exact (fp32) values than HF's own bf16 is (x1.5, plus 2^-8 of
    the tensor's scale). (Ours is often the closer: the dense attention keeps its scores in float32.)"""
    for key, want in theirs.items():
        scale = float(np.max(np.abs(want)))
        hf_rounding = float(np.max(np.abs(want - exact[key])))
        ours_rounding = float(np.max(np.abs(ours[key] - exact[key])))
        assert ours_rounding <= 1.5 * hf_rounding + 2**-8 * scale, (key, ours_rounding, hf_rounding)


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, 211, (2, 19))


@pytest.mark.parametrize("dialect", ["v5", "v4"])
@pytest.mark.parametrize("family", ref.FAMILIES)
def test_fp32_every_point_equals_hf(family, dialect, tokens, tmp_path):
    ckpt = ref.build_checkpoint(family, tmp_path)
    if dialect == "v4":
        ref.to_v4_dialect(ckpt)
    ours = run(ckpt, tokens)
    theirs = ref.hf_captures(ckpt, tokens)
    assert set(ours) == set(theirs)
    assert_close(ours, theirs, rtol=1e-5)


@pytest.mark.parametrize("family", ref.ALL_FAMILIES)
def test_bf16_is_as_close_to_fp32_as_hf_bf16_is(family, tokens, tmp_path):
    ckpt = ref.build_checkpoint(family, tmp_path, dtype="bfloat16")
    ours = run(ckpt, tokens, dtype=jnp.bfloat16)
    assert_bf16_rounding(ours, ref.hf_captures(ckpt, tokens, dtype="bfloat16"),
                         ref.hf_captures(ckpt, tokens, dtype="float32"))


@pytest.mark.parametrize(
    "family,overrides",
    [("mistral", {"sliding_window": 5}),
     ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1})],
    ids=["mistral-all-layers", "qwen2-upper-layers"],
)
def test_sliding_window_attention_equals_hf(family, overrides, tokens, tmp_path):
    ckpt = ref.build_checkpoint(family, tmp_path, overrides=overrides)
    windows = ModelConfig.from_dir(ckpt).sliding_windows
    assert any(windows) and (family == "mistral" or windows[0] is None)
    assert_close(run(ckpt, tokens), ref.hf_captures(ckpt, tokens), rtol=1e-5)


def test_untied_qwen2_and_tied_llama(tokens, tmp_path):
    for family, tie in (("qwen2", False), ("llama", True)):
        ckpt = ref.build_checkpoint(family, tmp_path / family, tie=tie)
        assert_close(run(ckpt, tokens), ref.hf_captures(ckpt, tokens), rtol=1e-5)


def test_packed_samples_get_the_values_they_get_alone(tmp_path):
    ckpt = ref.build_checkpoint("qwen3", tmp_path)
    rng = np.random.RandomState(1)
    lengths = [[5, 7, 4], [11, 6]]
    seq = 18
    ids = rng.randint(0, 211, (len(lengths), seq))
    segments = np.zeros_like(ids)  # 0 = padding after the last sample
    for row, lens in enumerate(lengths):
        segments[row, : sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
    packed = run(ckpt, ids, segments)
    for row, lens in enumerate(lengths):
        start = 0
        for n in lens:
            alone = run(ckpt, ids[row : row + 1, start : start + n])
            packed_part = {k: v[row : row + 1, start : start + n] for k, v in packed.items()}
            assert_close(packed_part, alone, rtol=1e-5)
            start += n


def packed_rows(lengths: list[list[int]], seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random token rows holding samples of `lengths` back to back (segments 1, 2, ...; 0 = padding after)."""
    ids = np.random.RandomState(seed).randint(0, 211, (len(lengths), seq))
    segments = np.zeros_like(ids)
    for row, lens in enumerate(lengths):
        segments[row, : sum(lens)] = np.repeat(np.arange(1, len(lens) + 1), lens)
    return ids, segments


@pytest.mark.parametrize("family,overrides", [("qwen2", {}), ("mistral", {"sliding_window": 100})],
                         ids=["qwen2", "mistral-window-100"])
def test_block_sparse_attention_gives_each_packed_sample_hf_values_alone(family, overrides, tmp_path):
    """Rows of 256 tokens = 4 blocks of 64: samples that cross blocks, a sample of a whole row, padding."""
    ckpt = ref.build_checkpoint(family, tmp_path, overrides=overrides)
    lengths = [[50, 90, 70, 30], [256], [3, 140]]
    ids, segments = packed_rows(lengths, 256, seed=2)
    queries, _ = block_pairs(segments.astype(np.int32))
    assert (queries < 3 * 4).sum() == 8 + 10 + 7  # real pairs (the rest pad to a bucket); causal would be 3 x 10
    packed = run(ckpt, ids, segments, block_sparse=True)
    for row, lens in enumerate(lengths):
        start = 0
        for n in lens:
            alone = ref.hf_captures(ckpt, ids[row : row + 1, start : start + n])
            assert_close({k: v[row : row + 1, start : start + n] for k, v in packed.items()}, alone, rtol=1e-5)
            start += n


def test_block_sparse_row_repeats_bit_for_bit_whatever_rows_share_its_batch(tmp_path):
    """A resume batches rows differently: a row's values must not depend on its neighbours (or their
    number of block pairs, which changes the compiled shape)."""
    ckpt = ref.build_checkpoint("llama", tmp_path)
    ids, segments = packed_rows([[60, 100, 80], [256], [10, 20, 30], [200]], 256, seed=3)
    together = run(ckpt, ids, segments, block_sparse=True)
    for others in ([1], [3, 1, 2]):
        rows = [0, *others]
        apart = run(ckpt, ids[rows], segments[rows], block_sparse=True)
        for key, values in together.items():
            np.testing.assert_array_equal(apart[key][0], values[0], err_msg=f"{key} with rows {rows}")


def test_the_cores_split_a_batch_with_the_bits_of_one_device(tmp_path):
    """A one-process CPU run splits each batch over the host's cores (runtime.cores: one slot on a data mesh,
    block-sparse attention under shard_map): every row must be the same bits as on one device, and
    `compile_forward` builds the one program up front, from the params' shapes alone, so that no batch compiles
    it again."""
    from harvest.model import compile_forward, load_decoder

    ckpt = ref.build_checkpoint("qwen2", tmp_path)
    ids, segments = packed_rows([[60, 100, 80], [256], [10, 20, 30], [200, 40]], 256, seed=4)
    settings = dict(compute_dtype="float32", attention="blocks")
    points = "resid_post:all,mlp_hidden:1"
    cores = make_mesh("data=4", jax.devices()[:4])
    compile_forward(ckpt, points, cores, ids.shape, **settings).result()
    decoder = load_decoder(ckpt, points, cores, **settings)
    compiles = []

    def listener(event, seconds, **_):
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        split = jax.block_until_ready(decoder(ids, segments))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], f"{len(compiles)} compiles after compile_forward"
    assert len(next(iter(split.values())).sharding.device_set) == 4
    alone = load_decoder(ckpt, points, make_mesh("data=1", jax.devices()[:1]), **settings)(ids, segments)
    for point, values in alone.items():
        np.testing.assert_array_equal(np.asarray(split[point]), np.asarray(values), err_msg=point)


def test_early_exit_runs_only_needed_layers_and_matches(tokens, tmp_path):
    ckpt = ref.build_checkpoint("llama", tmp_path, num_layers=4)
    ours = run(ckpt, tokens, points="attn_out:0,resid_post:1")
    assert sorted(ours) == [("attn_out", 0), ("resid_post", 1)]
    theirs = ref.hf_captures(ckpt, tokens)
    assert_close(ours, {k: theirs[k] for k in ours}, rtol=1e-5)
    cfg = ModelConfig.from_dir(ckpt)
    params = load_params(ckpt, cfg, num_layers=2)
    assert params["layers"]["q_proj"].shape[0] == 2


@pytest.mark.parametrize("mesh_spec", ["1d", "2d", "3d", "data=2,fsdp=2,model=2", "data=8"])
def test_sharded_forward_equals_unsharded(mesh_spec, tmp_path):
    assert jax.device_count() == 8, "conftest sets 8 CPU devices"
    ckpt = ref.build_checkpoint("qwen2", tmp_path, num_layers=2)
    ids = np.random.RandomState(2).randint(0, 211, (8, 12))
    segments = np.repeat([[1] * 5 + [2] * 7], 8, axis=0)
    single = run(ckpt, ids, segments)
    mesh = make_mesh(mesh_spec)
    assert_close(run(ckpt, ids, segments, mesh=mesh), single, rtol=1e-5)
