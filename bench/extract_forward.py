"""bench/extract.py's forward-only columns: harvest's Decoder on the rows harvest packs and HF's model(...) on
the HF loop's padded batches, no I/O, compile excluded, interleaved so that both see the same background load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

from harvest.data import prompts, streams
from harvest.data.batching import pack_stream, stream_pieces
from harvest.model import load_decoder, moments
from harvest.runtime import cores
from harvest.runtime.mesh import make_mesh


def run_forward(args, model_dir: Path, data: Path, seq: int) -> dict:
    """Seconds of each side's forwards, the real tokens each saw, and the samples' lengths (for the FLOP rate)."""
    tokenizer = prompts.load_tokenizer(model_dir)
    events = stream_pieces(streams.open_data(str(data)).records(0), prompts.make_renderer("text", tokenizer),
                           prompts.encoder(tokenizer, "text"), first_index=0, max_seq_len=seq,
                           long="truncate", strict=False, sample_error=prompts.SampleError)
    rows = list(pack_stream(events, seq))
    # As the job runs on this host: one slot, each batch split over the cores' devices (runtime.cores).
    devices = cores.core_devices(0)
    decoder = load_decoder(model_dir, args.points, make_mesh(f"data={len(devices)}", devices), "float32",
                           out_dtype="bfloat16", moment_slots=moments.SLOTS)
    B = args.batch_size * len(devices)
    packed = []
    for at in range(0, len(rows), B):
        tokens, segments = np.zeros((B, seq), np.int32), np.zeros((B, seq), np.int32)
        for i, row in enumerate(rows[at : at + B]):
            tokens[i], segments[i] = row.tokens, row.segments
        packed.append((tokens, segments))
    with data.open() as f:
        texts = [json.loads(line)["text"] for line in f]
    padded = [tokenizer(texts[at : at + args.hf_batch_size], padding="longest", truncation=True,
                        max_length=seq, return_tensors="pt")
              for at in range(0, len(texts), args.hf_batch_size)]

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=args.attn).eval()
    jax.block_until_ready(decoder.step(*packed[0]))  # compiled before timing

    def harvest_call(batch):
        jax.block_until_ready(decoder.step(*batch))

    @torch.no_grad()
    def hf_call(enc):
        model(**enc, output_hidden_states=True)

    work = [(harvest_call, packed), (hf_call, padded)]
    done, wall = [0, 0], [0.0, 0.0]
    while any(d < len(items) for d, (_, items) in zip(done, work)):
        e = min((k for k in (0, 1) if done[k] < len(work[k][1])), key=lambda k: done[k] / len(work[k][1]))
        fn, items = work[e]
        t = time.perf_counter()
        fn(items[done[e]])
        wall[e] += time.perf_counter() - t
        done[e] += 1
    lengths = np.asarray([len(p.tokens) for row in rows for p, _ in row.events])
    return {"harvest": wall[0], "hf": wall[1], "tokens": int(lengths.sum()), "lengths": lengths,
            "hf_tokens": sum(int(enc["attention_mask"].sum()) for enc in padded)}
