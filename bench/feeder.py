"""bench/host.py's feeder: jsonl text -> render -> tokenize -> pack (the job's data.batching) with a byte-level
BPE of ~150k tokens like Qwen2.5's, trained here on generated text."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from harvest.data import prompts, streams
from harvest.data.batching import pack_stream, stream_pieces

SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]


def corpus(megabytes: float) -> list[str]:
    """Zipf-distributed pseudo-words over many syllables: enough distinct words to train a ~150k vocabulary."""
    rng = np.random.default_rng(3)
    vocabulary = ["".join(rng.choice(SYLLABLES, size=int(k))) for k in rng.integers(1, 5, 400_000)]
    ranks = np.minimum(rng.zipf(1.1, int(megabytes * 1e6 / 6)), len(vocabulary)) - 1
    words = np.asarray(vocabulary)[ranks]
    texts, at = [], 0
    for n in np.clip(rng.lognormal(np.log(300), 1.0, len(words)), 10, 4000).astype(int):
        if at >= len(words):
            break
        texts.append(" ".join(words[at : at + n]))
        at += n
    return texts


def train_tokenizer(texts: list[str], vocab: int, directory: Path) -> tuple[Path, int, float]:
    """A byte-level BPE (as GPT-2/Qwen2.5), saved as a transformers checkpoint's tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    t = time.perf_counter()
    tokenizer.train_from_iterator(texts, trainer)
    seconds = time.perf_counter() - t
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    return directory, tokenizer.get_vocab_size(), seconds


def feeder(texts: list[str], checkpoint: Path, root: Path, seq: int) -> tuple[float, int]:
    data = root / "feeder.jsonl"
    with data.open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    tokenizer = prompts.load_tokenizer(checkpoint)
    t = time.perf_counter()
    events = stream_pieces(streams.open_data(str(data)).records(0), prompts.make_renderer("text", tokenizer),
                           prompts.encoder(tokenizer, "text"), first_index=0, max_seq_len=seq, long="chunk",
                           strict=False, sample_error=prompts.SampleError)
    tokens = sum(row.used for row in pack_stream(events, seq))
    return time.perf_counter() - t, tokens
