"""No record can crash a run: seeded, randomly mutated records of every format (text, chat, ARC;
tests/mutated_records.py) go through the real extraction; every bad one is skipped with the reason its
mutation calls for, every valid one is stored with the tokens the tokenizer gives it, and --strict stops at
the first bad one; a renderer's or tokenizer's failure no check foresaw stays one record's skip."""

import re

import numpy as np
import pytest
from mutated_records import MAX_SEQ_LEN, PER_FORMAT, SEED, generate, valid_lines, write_source

from harvest.config import ExtractConfig
from harvest.data import arc as arclib
from harvest.data.batching import SampleTokens, Skip, stream_pieces
from harvest.data.prompts import SampleError, encoder, load_tokenizer, make_renderer
from harvest.data.sources import Record, iter_records
from harvest.data.streams import create_streams
from harvest.demo import demo_checkpoint
from harvest.errors import UserError
from harvest.extract.job import run_extract
from harvest.read import open_run
from harvest.store.verify import verify


# --- the run ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo checkpoint: a tiny Qwen2 with a byte-level tokenizer and a chat template, built offline."""
    return demo_checkpoint(tmp_path_factory.mktemp("model"))


def expected_tokens(fmt, value, tokenizer):
    """What the tokenizer itself makes of a valid record (the ARC prompt as harvest renders it)."""
    if fmt == "text":
        return [tokenizer(value["text"])["input_ids"]]
    if fmt == "chat":
        ids = tokenizer.apply_chat_template(value["messages"], tokenize=True)
        return [ids if isinstance(ids, list) else ids["input_ids"]]
    prompts = arclib.render_variants(arclib.parse_task(value), arclib.ArcOptions(), 0, 0)
    return [tokenizer(p)["input_ids"] for p in prompts]


@pytest.mark.parametrize("fmt", ["text", "chat", "arc"])
def test_mutated_records_are_skipped_with_their_reason_and_valid_ones_stored(fmt, model, tmp_path):
    cases = generate(fmt, PER_FORMAT, SEED)
    assert sum(reason is None for _, reason in cases) > PER_FORMAT // 3 and \
        sum(reason is not None for _, reason in cases) > PER_FORMAT // 3
    data = write_source(tmp_path / f"{fmt}.jsonl", cases)
    # text goes through a stream set (its lines carried verbatim, bad ones as error lines), the others as is
    streams = create_streams(data, 3, str(tmp_path / "streams")).url if fmt == "text" else data
    out = tmp_path / "out"
    config = ExtractConfig(model=str(model), data=streams, out=str(out), points="resid_post:0", format=fmt,
                           max_seq_len=MAX_SEQ_LEN, long="chunk", batch_size=4, shard_size="2MB").validate()
    run_extract(config)

    run = open_run(str(out))
    skipped = {e["sample_id"]: e for sc in run.shards for e in sc.skipped}
    stored: dict[int, list] = {}
    for sample in run.iter_samples():
        stored.setdefault(sample.sample_id, []).append((sample.variant, sample.tokens))
    for sample_id, (_, reason) in enumerate(cases):
        if reason is None:
            assert sample_id not in skipped, f"valid record {sample_id} skipped: {skipped[sample_id]}"
        else:
            assert sample_id not in stored, f"bad record {sample_id} stored (should be skipped: {reason})"
            got = skipped[sample_id]
            assert re.fullmatch(reason, got["reason"]), f"record {sample_id}: {got['reason']!r} !~ {reason!r}"
            assert got["location"] == f"{data}:{sample_id + 1}"
    tokenizer = load_tokenizer(model)
    valid = valid_lines(cases)
    assert sorted(stored) == sorted(valid)
    for sample_id, value in valid.items():
        pieces = [tokens for _, tokens in sorted(stored[sample_id], key=lambda vt: vt[0])]
        want = np.concatenate([np.asarray(t, np.int32) for t in expected_tokens(fmt, value, tokenizer)])
        np.testing.assert_array_equal(np.concatenate(pieces), want, err_msg=f"record {sample_id}")
    report = verify(str(out))
    assert report.ok, report


def test_a_kept_tokenizer_encodes_every_text_as_transformers_does(model, tmp_path, monkeypatch):
    """A text or ARC job encodes with the tokenizer kept under $HARVEST_CACHE (data.tokenizer_cache: built by a
    child process the first time, no transformers import in the job): the ids transformers gives, with and
    without special tokens, on every valid fuzzed text and on text transformers' own normalizer changes (not
    NFC), special tokens written out, nothing."""
    monkeypatch.setenv("HARVEST_CACHE", str(tmp_path / "cache"))
    kept = load_tokenizer(model, encode_only=True)
    assert list((tmp_path / "cache" / "tokenizers").glob("*.json")), "the child kept nothing"
    built = load_tokenizer(model)
    assert type(kept).__name__ == "BackendEncoder" and kept.built_by == type(built).__name__
    texts = [value["text"] for value in valid_lines(generate("text", PER_FORMAT, SEED)).values()]
    texts += ["e\u0301", "A\u030a ﬁ \u2163", "<|endoftext|> and <|im_start|>", "", "  two  spaces\n\ttab"]
    for special in (True, False):
        assert kept(texts, add_special_tokens=special)["input_ids"] == \
            built(texts, add_special_tokens=special)["input_ids"]
    assert type(load_tokenizer(model)).__name__ == type(built).__name__  # a chat job still gets transformers'


def test_a_cache_that_cannot_be_written_costs_no_child(model, tmp_path, monkeypatch):
    """$HARVEST_CACHE unwritable (here: under a regular file): the job builds the tokenizer itself, once,
    without first starting a child whose work could not be kept."""
    from harvest.data import tokenizer_cache

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HARVEST_CACHE", str(tmp_path / "file" / "cache"))

    def no_child(*args, **kwargs):
        raise AssertionError(f"a child was started: {args}")

    monkeypatch.setattr(tokenizer_cache.subprocess, "run", no_child)
    tokenizer = load_tokenizer(model, encode_only=True)
    assert type(tokenizer).__name__ != "BackendEncoder"
    assert tokenizer(["a b"], add_special_tokens=False)["input_ids"] == \
        load_tokenizer(model)(["a b"], add_special_tokens=False)["input_ids"]


def events_of(fmt, data, tokenizer, strict):
    render = make_renderer(fmt, tokenizer)
    return stream_pieces(iter_records(data), render, encoder(tokenizer, fmt), first_index=0,
                         max_seq_len=MAX_SEQ_LEN, long="chunk", strict=strict, sample_error=SampleError)


@pytest.mark.parametrize("fmt", ["text", "chat", "arc"])
def test_strict_stops_at_the_first_mutated_record(fmt, model, tmp_path):
    cases = generate(fmt, 200, SEED + 1)
    data = write_source(tmp_path / f"{fmt}.jsonl", cases)
    first = next(i for i, (_, reason) in enumerate(cases) if reason is not None)
    tokenizer = load_tokenizer(model)
    with pytest.raises(UserError) as e:
        for _ in events_of(fmt, data, tokenizer, strict=True):
            pass
    location, reason = f"{data}:{first + 1}", cases[first][1]
    assert re.fullmatch(f"{re.escape(location)}: {reason} \\(--strict stops at the first bad input\\)", str(e.value))


# --- the last resort: failures no check foresaw stay one record's skip --------------------------------------

def records(texts):
    return [Record(i, f"mem:{i + 1}", {"text": t}) for i, t in enumerate(texts)]


def plain_encode(texts):
    return [[ord(ch) % 250 + 1 for ch in t] for t in texts]


def outcome(events):
    return [(e.pos, e.reason) if isinstance(e, Skip) else (e.pos, e.tokens.tolist()) if isinstance(e, SampleTokens)
            else e.records for e in events]


def run_pieces(recs, render, encode, strict=False):
    return outcome(stream_pieces(recs, render, encode, first_index=0, max_seq_len=64, long="chunk",
                                 strict=strict, sample_error=SampleError))


def test_a_renderer_bug_on_one_record_skips_that_record_only(caplog):
    texts = ["ab", "boom", "cd"]

    def render(record):
        if record.value["text"] == "boom":
            raise RuntimeError("\ud800" + "x" * 2000)  # a huge message holding a lone surrogate, as bugs may
        return [record.value["text"]]

    events = run_pieces(records(texts), render, plain_encode)
    assert events[0] == ((0, 0), plain_encode(["ab"])[0]) and events[2] == ((2, 0), plain_encode(["cd"])[0])
    assert events[3] == 3
    (pos, reason) = events[1]
    assert pos == (1, 0) and reason.startswith("unexpected error while rendering (RuntimeError: \\ud800xxx")
    assert len(reason) <= 500 and reason.endswith("…")
    reason.encode("utf-8")  # storable in a sidecar
    assert "mem:2: unexpected error while rendering it" in caplog.text
    with pytest.raises(UserError, match=r"^mem:2: unexpected error while rendering \(RuntimeError"):
        run_pieces(records(texts), render, plain_encode, strict=True)


def test_a_tokenizer_failure_on_one_record_skips_that_record_only():
    texts = [f"record {i}" for i in range(100)]
    texts[70] = "poison"
    calls = []

    def encode(batch):
        calls.append(len(batch))
        if "poison" in batch:
            raise TypeError("cannot tokenize")
        return plain_encode(batch)

    events = run_pieces(records(texts), lambda r: [r.value["text"]], encode)
    skips = [e for e in events[:-1] if isinstance(e[1], str)]
    assert skips == [((70, 0), "unexpected error while tokenizing (TypeError: cannot tokenize)")]
    assert [e for e in events[:-1] if not isinstance(e[1], str)] == \
        [((i, 0), plain_encode([t])[0]) for i, t in enumerate(texts) if i != 70]
    assert calls == [64, 36] + [1] * 36  # one call per block; per record only in the block that failed
