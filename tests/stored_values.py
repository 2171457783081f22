"""A small `harvest extract` in this process and the values it stored, read with safetensors and compared with
HF transformers' own (tests/extract/test_extract.py, tests/model/test_attention.py)."""

import json

import hf_reference as ref
import numpy as np
from extract_helpers import data_of
from safetensors.numpy import load_file

from harvest.config import ExtractConfig
from harvest.extract.job import run_extract

POINTS = "resid_pre:0,attn_out:1,mlp_hidden:0,resid_post:0-2"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def extract(model_dir, data, out, **settings):
    config = ExtractConfig(model=str(model_dir), data=data, out=str(out), points=POINTS, dtype="float32",
                           max_seq_len=settings.pop("max_seq_len", 96), batch_size=2,
                           shard_size=settings.pop("shard_size", "20KB"),
                           **settings).validate()
    return run_extract(config)


def stored_samples(out):
    """(sample_id, variant) -> (tokens, {tensor: values}) from every committed shard, via safetensors."""
    samples = {}
    for sidecar in sorted(out.glob("stream_*/shard_*.json")):
        shard = load_file(data_of(sidecar))
        offsets = shard["offsets"]
        names = [k for k in shard if "." in k]
        for i, (sid, var) in enumerate(zip(shard["sample_ids"], shard["variants"])):
            a, b = offsets[i], offsets[i + 1]
            assert (int(sid), int(var)) not in samples
            samples[int(sid), int(var)] = (shard["tokens"][a:b], {n: shard[n][a:b] for n in names})
    return samples


def assert_equal_to_hf(model_dir, samples):
    for (sid, var), (tokens, values) in samples.items():
        theirs = ref.hf_captures(model_dir, tokens[None].astype(np.int64))
        for name, got in values.items():
            point, layer = name.split(".")
            want = theirs[point, int(layer)][0]
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{sid}/{var} {name}")
