"""Compressed storage (int8 and float8_e4m3fn codes with a float32 absmax scale per token) and leaving out each
sample's first tokens (attention sinks): round trips within the stated bounds, real `extract --dtype` runs read
back through every reading path equal to the float32 run's values within them, stats equal to the float32
run's, verify passing and failing on a corrupted scale."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
from quant_helpers import CODES, NAMES, assert_float32_stats, bound, texts
from safetensors.numpy import save

import harvest
from harvest.config import ExtractConfig
from harvest.demo import demo_checkpoint
from harvest.extract.job import run_extract
from harvest.store import encoding, format as fmt, quant
from harvest.store.records import Sidecar
from harvest.store.verify import verify


@pytest.mark.parametrize("dtype", CODES)
def test_round_trip_within_the_formats_bound(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 64)).astype(np.float32) * rng.lognormal(0, 2, (300, 1)).astype(np.float32)
    x[0, 3] = 29_250.0  # an attention sink's outlier dimension
    x[1] = 0.0  # a row of zeros: scale 0, codes 0, back to zeros
    x[2, :5] = [1e-30, -1e-30, 0.0, 1.0, -1.0]  # subnormal-range values beside a large one
    codes, scale = quant.quantize(x, dtype)
    assert codes.dtype == quant.CODES[dtype] and scale.dtype == np.float32 and scale.shape == (300,)
    back = quant.dequantize(codes, scale)
    assert np.all(np.abs(back - x) <= bound(x, scale, dtype))
    np.testing.assert_array_equal(back[1], 0.0)
    np.testing.assert_array_equal(np.abs(codes.astype(np.float32)).max(axis=1)[scale > 0], quant.QMAX[dtype])
    assert quant.scale_problem(codes, scale, dtype) is None
    assert quant.dequantize(codes, scale, ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("dtype", CODES)
def test_quantized_shard_parts_are_the_bytes_safetensors_writes(dtype):
    rng = np.random.default_rng(1)
    blocks = quant.quantize_blocks({"resid_post.3": [rng.standard_normal((4, 6)), rng.standard_normal((7, 6))]},
                                   dtype)
    tokens, lengths = np.arange(11, dtype=np.int32), np.array([4, 7])
    sample_ids, variants = np.array([5, 9]), np.array([0, 2], np.int32)
    parts = encoding.shard_parts(blocks, tokens, lengths, sample_ids, variants, metadata={"stream": "0", "shard": "1"})
    fields = {"format": "harvest", "format_version": str(fmt.FORMAT_VERSION), "shard": "1", "stream": "0"}
    whole = {name: np.concatenate(b) for name, b in blocks.items()}
    expected = save({**whole, "tokens": tokens, "offsets": np.array([0, 4, 11], np.int64),
                     "sample_ids": sample_ids.astype(np.int64), "variants": variants},
                    metadata={"harvest": json.dumps(fields, sort_keys=True)})
    assert b"".join(parts) == expected
    decoded = encoding.decode_shard(expected)
    np.testing.assert_array_equal(decoded["resid_post.3.scale"], whole["resid_post.3.scale"])
    assert decoded["resid_post.3"].dtype == quant.CODES[dtype]

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same texts extracted in float32, int8 and float8_e4m3fn (several shards each)."""
    root = tmp_path_factory.mktemp("quant")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in texts()))
    model = demo_checkpoint(root / "model")
    out = {"model": model, "data": data}
    for dtype in ("float32", *CODES):
        out[dtype] = root / dtype
        run_extract(ExtractConfig(model=str(model), data=str(data), out=str(out[dtype]), dtype=dtype,
                                  points="resid_pre:0,resid_post:1", max_seq_len=64, batch_size=2,
                                  shard_size="16KB").validate())
    return out


def _truth(run) -> dict[tuple[int, int], object]:
    return {(s.sample_id, s.variant): s for s in run.iter_samples()}


@pytest.mark.parametrize("dtype", CODES)
def test_extract_reads_back_within_the_bound_on_every_path(runs, dtype):
    ref, run = harvest.open(str(runs["float32"])), harvest.open(str(runs[dtype]))
    assert run.dtype == dtype and run.info.quantization == quant.record(dtype)
    assert all(sc.quantization == quant.record(dtype) for sc in run.shards)
    assert len(run.shards) > 2
    truth = _truth(ref)
    scales = {}  # per (sample, variant, tensor): the stored scales, to state the bound with
    for sample in run.iter_samples():
        want = truth[(sample.sample_id, sample.variant)]
        np.testing.assert_array_equal(sample.tokens, want.tokens)
        for name in NAMES:
            got, x = sample.activations[name], want.activations[name]
            assert got.dtype == np.float32
            scale = np.abs(x).max(axis=1) / quant.QMAX[dtype]
            assert np.all(np.abs(got - x) <= bound(x, scale, dtype) * 1.0001)
            scales[(sample.sample_id, name)] = scale
    one = run.sample(7)
    np.testing.assert_array_equal(one.activations["resid_post.1"],
                                  next(s for s in run.iter_samples() if s.sample_id == 7).activations["resid_post.1"])

    def check(batch: dict, tokens_in_order: np.ndarray, values: dict[str, np.ndarray]) -> None:
        for name in NAMES:
            got = np.asarray(batch[name], np.float32)
            x = values[name]
            scale = np.abs(x).max(axis=1) / quant.QMAX[dtype]
            assert np.all(np.abs(got - x) <= bound(x, scale, dtype) * 1.0001), name

    flat = {name: np.concatenate([truth[k].activations[name] for k in sorted(truth)]) for name in NAMES}
    tokens = np.concatenate([truth[k].tokens for k in sorted(truth)])
    order = sorted(truth)  # round-robin ids of one stream: shard order is id order
    assert [(s.sample_id, s.variant) for s in ref.iter_samples()] == order
    whole = next(iter(run.token_batches(10**6, list(NAMES), shuffle=False, exclude=[])))
    np.testing.assert_array_equal(whole["tokens"], tokens)
    check(whole, tokens, flat)
    assert whole[NAMES[0]].dtype == np.float32
    bf16 = next(iter(run.token_batches(10**6, list(NAMES), shuffle=False, exclude=[], dtype="bfloat16")))
    assert bf16[NAMES[0]].dtype == ml_dtypes.bfloat16

    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(run.torch_dataset(10**6, list(NAMES), shuffle=False, exclude=[]),
                                         batch_size=None)
    check({k: v.numpy() for k, v in next(iter(loader)).items()}, tokens, flat)

    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    rows = len(tokens) // 4 * 4
    batch = next(run.jax_batches(rows, list(NAMES), mesh=mesh, shuffle=False, exclude=[], epochs=1))
    check({k: np.asarray(v) for k, v in batch.items()}, tokens[:rows], {n: v[:rows] for n, v in flat.items()})


@pytest.mark.parametrize("dtype", CODES)
def test_stats_are_the_float32_values_stats(runs, dtype):
    """Stats come from the values before quantization: the float32 run's, to float64 merge order (the shards
    split elsewhere: 8-bit rows are smaller)."""
    assert_float32_stats(harvest.open(str(runs["float32"])), harvest.open(str(runs[dtype])))

@pytest.mark.parametrize("dtype", CODES)
def test_verify_checks_the_scales(runs, dtype, tmp_path):
    assert verify(str(runs[dtype])).ok
    copy = tmp_path / "run"
    shutil.copytree(runs[dtype], copy)
    sidecar_path = sorted(copy.glob("stream_*/shard_*.json"))[1]
    sidecar = Sidecar.from_bytes(sidecar_path.read_bytes())
    data = sidecar_path.parent / sidecar.file
    raw = bytearray(data.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8:8 + header_len])["resid_post.1.scale"]
    at = 8 + header_len + entry["data_offsets"][0] + 4  # the second token's scale
    raw[at:at + 4] = np.float32(-np.frombuffer(raw[at:at + 4], np.float32)[0]).tobytes()
    data.write_bytes(bytes(raw))
    report = verify(str(copy))
    assert not report.ok
    text = "\n".join(report.problems)
    assert "checksum mismatch in tensor resid_post.1.scale" in text
    assert "resid_post.1.scale holds 1 scales that are negative, inf or nan" in text
    with pytest.raises(Exception, match="resid_post.1.scale"):
        list(harvest.open(str(copy)).token_batches(64, ["resid_post.1"], verify="sha256"))


def test_skip_first_serves_every_token_but_each_samples_first(runs):
    run = harvest.open(str(runs["float32"]))
    samples = list(run.iter_samples())
    for skip in (1, 3):
        batch = next(iter(run.token_batches(10**6, ["resid_post.1"], shuffle=False, exclude=[], skip_first=skip,
                                            piece_bytes=4096)))
        want = np.concatenate([s.activations["resid_post.1"][skip:] for s in samples])
        np.testing.assert_array_equal(batch["resid_post.1"], want)
    reader = run.token_batches(16, ["resid_post.1"], skip_first=1, exclude=[])
    next(iter(reader))
    state = reader.state_dict()
    with pytest.raises(Exception, match="skip_first"):
        run.token_batches(16, ["resid_post.1"], skip_first=2, exclude=[]).load_state_dict(state)


def test_inspect_and_status_show_the_first_tokens_share(runs):
    from rich.console import Console

    from harvest.store import report

    run = harvest.open(str(runs["int8"]))
    stats, first = run.stats("resid_post.1"), run.view.first_token_stats("resid_post.1")
    samples = [s.activations["resid_post.1"].astype(np.float64)  # the stats' own precision: float32 sums of
               for s in harvest.open(str(runs["float32"])).iter_samples()]  # 1e5 terms differ in the 7th digit
    x, firsts = np.concatenate(samples), np.stack([a[0] for a in samples])
    share = np.sum((firsts - x.mean(0)) ** 2) / np.sum((x - x.mean(0)) ** 2)
    assert first.share_of(stats) == pytest.approx(share, rel=1e-9)
    console = Console(width=250, record=True)
    for renderable in [*report.inspect(str(runs["int8"])), report.status_table(str(runs["int8"]))]:
        console.print(renderable)
    text = console.export_text()
    cell = f"{len(firsts) / len(x):.1%} hold {share:.0%} of variance"
    assert text.count(cell) == 2, text  # in inspect's tensors table and in status's caption


def test_sae_train_records_skip_first_and_eval_and_export_follow_it(runs, tmp_path):
    from harvest.sae.config import SaeConfig
    from harvest.sae.evaluate import evaluate
    from harvest.sae.export import export, load_sae_run, spec_of
    from harvest.training.run import train as run_sae_train
    from harvest.sae.splice import ce_loss_recovered

    out = str(tmp_path / "sae")
    run_sae_train(SaeConfig(run=[str(runs["int8"])], tensors=["resid_post.1"], out=out, expansion=2, k=4,
                            batch_tokens=64, tokens=64 * 3, warmup=1, skip_first=1, checkpoint_every=3).validate())
    info, _, params = load_sae_run(out)
    assert info["config"]["skip_first"] == 1
    truth = harvest.open(str(runs["float32"]))
    served = {skip: len(next(iter(truth.token_batches(10**6, ["resid_post.1"], skip_first=skip)))["tokens"])
              for skip in (0, 1)}
    assert served[1] < served[0]
    result = evaluate(out, str(runs["float32"]), tokens=10**6)["tensors"]["resid_post.1"]
    assert (result["skip_first"], result["tokens"]) == (1, served[1])
    assert evaluate(out, str(runs["float32"]), tokens=10**6, skip_first=0)["tensors"]["resid_post.1"]["tokens"] \
        == served[0]
    dirs = export(out, str(tmp_path / "export"), "saelens")["dirs"]
    assert json.loads((tmp_path / "export" / "resid_post.1" / "harvest.json").read_text())["skip_first"] == 1
    assert len(dirs) == 1
    # The CE splice leaves each text's first tokens clean: with all of them left out, nothing is replaced.
    spec_info = info["saes"]["resid_post.1"]
    ce = ce_loss_recovered(str(runs["model"]), str(runs["data"]), "resid_post.1", params["resid_post.1"],
                           spec_of(spec_info), tokens=500, max_seq_len=64, skip_first=64)
    assert ce["ce_sae"] == ce["ce_clean"] == ce["ce_zero"]
    spliced = ce_loss_recovered(str(runs["model"]), str(runs["data"]), "resid_post.1", params["resid_post.1"],
                                spec_of(spec_info), tokens=500, max_seq_len=64, skip_first=1)
    assert spliced["ce_sae"] != spliced["ce_clean"] and spliced["ce_zero"] != spliced["ce_clean"]
