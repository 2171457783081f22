"""8-bit codes made on the device (harvest.model.quantize): equal to harvest.store.quant's on XLA's CPU for the
same float32 values and within its documented bounds, and an `extract --dtype int8|float8_e4m3fn` run on a
sharded mesh storing exactly the host quantization of a float32 run's values, with that run's stats, the same
records and readers that dequantize them."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from quant_helpers import CODES, NAMES, assert_float32_stats, bound, texts

import harvest
from harvest.config import ExtractConfig
from harvest.data.streams import create_streams
from harvest.demo import demo_checkpoint
from harvest.extract.job import run_extract
from harvest.model import load_decoder
from harvest.model.moments import SLOTS
from harvest.model.quantize import quantize
from harvest.runtime.mesh import make_mesh
from harvest.store import encoding, quant
from harvest.store.verify import verify

MESH = "data=4,model=2"
POINTS = "resid_pre:0,resid_post:1"


def hard_values(seed: int) -> np.ndarray:
    """[2, 3, 50, 64] float32 rows of every kind a residual stream has: lognormal norms over 6 decades, an
    attention sink's outlier, rows of zeros, all-negative rows, subnormal-range values beside large ones, ties."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 50, 64)).astype(np.float32) * rng.lognormal(0, 3, (2, 3, 50, 1)).astype(np.float32)
    x[0, 0, 3, 5] = 29_250.0
    x[0, 1, :4] = 0.0
    x[1, 2, 7] = -np.abs(x[1, 2, 7])
    x[1, 0, 9, :5] = [1e-30, -1e-30, 0.0, 1.0, -1.0]
    x[1, 1, 11] = np.arange(-32, 32, dtype=np.float32) / 2  # halves: rounding ties of int8 codes
    return x


def bits(codes: np.ndarray) -> np.ndarray:
    """Codes compared by their bytes (float8 -0 and 0 differ)."""
    return codes.view(np.uint8)


@pytest.mark.parametrize("code", CODES)
def test_device_codes_and_scales_equal_the_hosts(code):
    for seed in range(3):
        x = hard_values(seed)
        codes, scales = jax.jit(quantize, static_argnums=1)(x, code)
        codes, scales = np.asarray(codes), np.asarray(scales)
        assert codes.dtype == quant.CODES[code] and codes.shape == x.shape
        assert scales.dtype == np.float32 and scales.shape == x.shape[:-1]
        want_codes, want_scales = quant.quantize(x.reshape(-1, 64), code)
        np.testing.assert_array_equal(scales.reshape(-1), want_scales)
        np.testing.assert_array_equal(bits(codes.reshape(-1, 64)), bits(want_codes))
        flat = codes.reshape(-1, 64)
        back, values = quant.dequantize(flat, scales.reshape(-1)), x.reshape(-1, 64)
        assert np.all(np.abs(back - values) <= bound(values, want_scales, code))
        assert quant.scale_problem(flat, scales.reshape(-1), code) is None
        np.testing.assert_array_equal(back[np.abs(values).max(axis=1) == 0], 0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return demo_checkpoint(tmp_path_factory.mktemp("device-quant-model"))


def test_quantizing_step_hands_codes_scales_and_the_values_moments(model):
    """Decoder.step with `quantize`: codes and scales sharded alike along the batch, and the float32 decoder's
    moments, plus each piece's first token in float32."""
    mesh = make_mesh(MESH)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 200, (8, 32)).astype(np.int32)
    segments = np.repeat(np.arange(1, 5, dtype=np.int32), 8)[None].repeat(8, axis=0)
    segments[1, 20:] = 0  # padding
    plain = load_decoder(model, POINTS, mesh, "float32", out_dtype="float32", moment_slots=SLOTS)
    values, moments = plain.step(tokens, segments)
    for code in CODES:
        captures, own = load_decoder(model, POINTS, mesh, "float32", moment_slots=SLOTS, quantize=code).step(
            tokens, segments)
        assert sorted(captures) == sorted([*values, *map(quant.scale_name, values)])
        for point, x in values.items():
            codes, scales = captures[point], captures[quant.scale_name(point)]
            assert codes.dtype == quant.CODES[code] and scales.dtype == np.float32
            assert scales.shape == x.shape[:3]
            assert scales.sharding.spec[1] == codes.sharding.spec[1] == x.sharding.spec[1] is not None
            want_codes, want_scales = quant.quantize(np.asarray(x).reshape(-1, x.shape[-1]), code)
            np.testing.assert_array_equal(np.asarray(scales).reshape(-1), want_scales)
            np.testing.assert_array_equal(bits(np.asarray(codes).reshape(want_codes.shape)), bits(want_codes))
            mean, m2, first = own[point]
            np.testing.assert_array_equal(np.asarray(mean), np.asarray(moments[point][0]))
            np.testing.assert_array_equal(np.asarray(m2), np.asarray(moments[point][1]))
            first, x = np.asarray(first), np.asarray(x)
            want_first = np.zeros_like(first)
            want_first[:, :, :4] = x[:, :, 0:32:8]  # pieces start every 8 tokens
            want_first[:, 1, 3] = 0.0  # row 1's 4th piece is padding
            np.testing.assert_array_equal(first, want_first)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model):
    """The same texts, in 4 streams, extracted on 8 devices (data=4 x model=2) as float32, int8 and fp8."""
    root = tmp_path_factory.mktemp("device-quant")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in texts(60)))
    streams = root / "streams"
    create_streams(str(data), 4, str(streams))
    out = {}
    for dtype in ("float32", *CODES):
        out[dtype] = root / dtype
        run_extract(ExtractConfig(model=str(model), data=str(streams), out=str(out[dtype]), dtype=dtype,
                                  points=POINTS, max_seq_len=64, batch_size=2, shard_size="8KB", mesh=MESH).validate())
    return out


def stored(run) -> dict[str, np.ndarray]:
    """Every tensor of a run's shards as stored (codes, scales or values), concatenated in stream and shard
    order, with each piece's length in place of the offsets."""
    shards = sorted(run.glob("stream_*/shard_*.json"))
    decoded = [encoding.decode_shard((p.parent / json.loads(p.read_text())["file"]).read_bytes()) for p in shards]
    for d in decoded:
        d["lengths"] = np.diff(d.pop("offsets"))
    return {name: np.concatenate([d[name] for d in decoded]) for name in decoded[0]}


@pytest.mark.parametrize("code", CODES)
def test_sharded_run_stores_the_host_quantization_of_the_float32_values(runs, code):
    ref, got = stored(runs["float32"]), stored(runs[code])
    assert len(list(runs[code].glob("stream_*/shard_*.json"))) > 8  # 4 streams, several shards each
    for name in ("tokens", "sample_ids", "variants"):
        np.testing.assert_array_equal(got[name], ref[name])
    for name in NAMES:
        codes, scales = quant.quantize(ref[name], code)
        np.testing.assert_array_equal(got[quant.scale_name(name)], scales)
        np.testing.assert_array_equal(bits(got[name]), bits(codes))
        back = quant.dequantize(got[name], got[quant.scale_name(name)])
        assert np.all(np.abs(back - ref[name]) <= bound(ref[name], scales, code))


@pytest.mark.parametrize("code", CODES)
def test_sharded_run_keeps_the_float32_stats_records_and_readers(runs, code):
    ref, run = harvest.open(str(runs["float32"])), harvest.open(str(runs[code]))
    assert verify(str(runs[code])).ok
    assert_float32_stats(ref, run)

    # The records: the float32 run's fields, the quantization named, scales beside the codes (without stats).
    info_ref, info = (json.loads((runs[d] / "run.json").read_text()) for d in ("float32", code))
    assert sorted(info) == sorted(info_ref) and info["quantization"] == quant.record(code)
    assert info["tensors"] == info_ref["tensors"]
    for path in runs[code].glob("stream_*/shard_*.json"):
        sidecar = json.loads(path.read_text())
        some_ref = json.loads(next(runs["float32"].glob(path.parent.name + "/shard_*.json")).read_text())
        assert sorted(sidecar) == sorted(some_ref) and sidecar["quantization"] == quant.record(code)
        assert sorted(sidecar["chunk_digests"]) == sorted([*some_ref["chunk_digests"], *map(quant.scale_name, NAMES)])
        assert sorted(sidecar["stats"]) == sorted(sidecar["first_stats"]) == sorted(NAMES)

    # The readers dequantize the stored codes: the host round trip of the float32 values.
    values = stored(runs["float32"])
    want = {name: quant.dequantize(*quant.quantize(values[name], code)) for name in NAMES}
    batch = next(iter(run.token_batches(10**6, list(NAMES), shuffle=False, exclude=[])))
    np.testing.assert_array_equal(batch["tokens"], values["tokens"])  # stream by stream, shard by shard
    ends = np.cumsum(values["lengths"])
    for name in NAMES:
        np.testing.assert_array_equal(batch[name], want[name])
        for k in (0, len(ends) // 2, len(ends) - 1):
            sample = run.sample(int(values["sample_ids"][k]))
            np.testing.assert_array_equal(sample.activations[name], want[name][ends[k] - values["lengths"][k]:ends[k]])


@pytest.mark.parametrize("code", CODES)
def test_pieces_beyond_the_device_slots_get_the_dequantized_codes_stats(code):
    """A row's pieces past the device's moment slots (here 2 of 3) get their moments and first token on the host,
    from the dequantized codes; the slots' come from the device as they are. The shard holds the codes and scales
    as handed (views, not copies)."""
    from harvest.data.batching import SampleTokens, StreamEnd, pack_stream
    from harvest.extract.shards import ShardWriter
    from harvest.model import handed
    from harvest.store.commit import ResumePoint
    from harvest.store.stats import RunningStats

    lengths = [5, 6, 7]
    (row,) = pack_stream([*(SampleTokens((i, 0), i, np.full(n, 3, np.int32)) for i, n in enumerate(lengths)),
                          StreamEnd(3)], 32)
    x = hard_values(9)[0, 0, :32]
    captures, moments = jax.jit(handed, static_argnums=(2, 3))({"resid_post": x[None, None]}, row.segments[None],
                                                              2, code)
    codes, scales = (np.asarray(captures[k])[0, 0, : row.used] for k in ("resid_post", "resid_post.scale"))
    own = {"resid_post.0": tuple(np.asarray(m)[0, 0] for m in moments["resid_post"])}
    writer = ShardWriter(0, {"resid_post.0": 64}, quant.CODES[code], 1 << 20, ResumePoint(), quantize=code)
    (shard,) = writer.add_row(row, {"resid_post.0": codes, "resid_post.0.scale": scales}, own)

    assert [np.shares_memory(b, codes) for b in shard.tensors["resid_post.0"]] == [True] * 3
    assert [np.shares_memory(b, scales) for b in shard.tensors["resid_post.0.scale"]] == [True] * 3
    assert "resid_post.0.scale" not in shard.moments
    means, m2s = shard.moments["resid_post.0"]
    dequantized = quant.dequantize(codes, scales)
    for k, (start, stop) in enumerate([(0, 5), (5, 11), (11, 18)]):
        if k < 2:  # the device's, of the float32 values
            np.testing.assert_array_equal(means[k], own["resid_post.0"][0][k])
            np.testing.assert_array_equal(m2s[k], own["resid_post.0"][1][k])
        else:
            want = RunningStats.of(dequantized[start:stop])
            np.testing.assert_array_equal(means[k], want.mean)
            np.testing.assert_array_equal(m2s[k], want.m2)
    firsts = RunningStats.of(np.stack([x[0], x[5], dequantized[11]]))
    np.testing.assert_array_equal(shard.first_stats["resid_post.0"].mean, firsts.mean)
    np.testing.assert_array_equal(shard.first_stats["resid_post.0"].m2, firsts.m2)
