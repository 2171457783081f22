"""The static site of `harvest sae features`: index.html, app.js and style.css (web/, shipped with the package)
and the data they show, written through Storage so OUT may be a bucket as well as a directory.

Browsers refuse fetch/XHR on file://, so the data are scripts that app.js loads by inserting <script> tags, each
calling `harvestRegister(path, <JSON>)`:

    data/site.js                     the record: the SAE run, its settings, each tensor's summary
    data/<tensor>/index.js           per latent a few numbers and its top tokens, column by column (the index
                                     page sorts, searches and pages these; ~60 bytes a latent)
    data/<tensor>/block_NNNN.js      the full records of latents [64N, 64N + 64), loaded when one is opened

Token strings come from a tokenizer on user data: app.js puts them in the DOM as text only, and the JSON here
escapes `</`, U+2028, U+2029 and lone surrogates, so a token never ends a script or breaks its string."""

from __future__ import annotations

import json
import re
from importlib import resources
from typing import Any

from harvest.sae.features.record import FeaturesRecord, Latent
from harvest.sae.features.writer import BLOCK, BlockOrder
from harvest.storage.storage import Storage

TOP_TOKENS = 5  # firing tokens of a latent's strongest examples listed (and searched) on the index
WEB_FILES = ("index.html", "app.js", "style.css")
_TENSOR = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_UNSAFE = re.compile("[\u2028\u2029\ud800-\udfff]")
_SCRIPT = re.compile(r'harvestRegister\(("(?:[^"\\]|\\.)*"),(.*)\);\n', re.S)
_DEAD, _DENSE = 1, 2  # the index's flags (app.js reads the same)


def script(path: str, data: Any) -> bytes:
    """The data file `path`: one call registering `data` under its own path, safe whatever strings it holds."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    text = _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text.replace("</", "<\\/"))
    return f"harvestRegister({json.dumps(path)},{text});\n".encode("utf-8")


def read_script(data: bytes) -> tuple[str, Any]:
    """(path, data) of a data file `script` wrote."""
    match = _SCRIPT.fullmatch(data.decode("utf-8"))
    if match is None:
        raise ValueError("not a data file of a harvest features site (harvestRegister(path, JSON);)")
    return json.loads(match.group(1)), json.loads(match.group(2))


def clearest_latent(storage: Storage, tensor: str) -> int | None:
    """The latent a first look should open: neither dead nor dense, the fewest distinct tokens among its top
    examples' firing tokens (the most clearly about one thing), a word before digits and punctuation, then the
    most firings; None if all are dead or dense."""
    index = read_script(storage.read_bytes(index_path(tensor)))[1]
    shown = [i for i, flag in enumerate(index["flag"]) if flag == 0 and index["top"][i]]

    def word(i: int) -> bool:
        token = index["top"][i][0].strip()
        return len(token) >= 3 and token.isalpha()

    return min(shown, key=lambda i: (len(index["top"][i]), not word(i), -index["count"][i]), default=None)


def block_path(tensor: str, number: int) -> str:
    return f"data/{tensor}/block_{number:04d}.js"


def index_path(tensor: str) -> str:
    return f"data/{tensor}/index.js"


def top_tokens(latent: Latent) -> list[str]:
    """The distinct firing tokens of a latent's top examples, strongest first: the first is its top example's."""
    seen: list[str] = []
    for context in latent.top:
        token = context.tokens[context.at]
        if token not in seen:
            seen.append(token)
            if len(seen) == TOP_TOKENS:
                break
    return seen


def short(x: float) -> float:
    """Six significant digits: what a page shows, at half the bytes of a float's repr."""
    return float(f"{x:.6g}")


def _context(c: dict[str, Any]) -> dict[str, Any]:
    return {**c, "acts": [short(a) for a in c["acts"]], "value": short(c["value"])}


def _latent(latent: Latent) -> dict[str, Any]:
    """A latent's record for its page, its floats shortened."""
    data = latent.to_json()
    data["top"] = [_context(c) for c in data["top"]]
    data["bins"] = [{"lo": short(b["lo"]), "hi": short(b["hi"]), "examples": [_context(c) for c in b["examples"]]}
                    for b in data["bins"]]
    data["edges"] = [short(e) for e in data["edges"]]
    for key in ("top_logits", "bottom_logits"):
        data[key] = [[t, short(v)] for t, v in data[key]]
    for key in ("density", "max", "mean"):
        data[key] = short(data[key])
    return data


class _Index:
    """One tensor's index rows, column by column: all the writer keeps of a latent once its block is written."""

    def __init__(self, dense_above: float):
        self.dense_above = dense_above
        self.columns: dict[str, list[Any]] = {k: [] for k in ("count", "density", "max", "mean", "flag", "top")}

    def add(self, latent: Latent) -> None:
        flag = _DEAD if latent.count == 0 else _DENSE if latent.density > self.dense_above else 0
        row = (latent.count, short(latent.density), short(latent.max), short(latent.mean), flag,
               top_tokens(latent))
        for column, value in zip(self.columns.values(), row):
            column.append(value)


class SiteWriter:
    """Writes the site into `storage` as the blocks of latents come (the Writer protocol of sae/features: `add`
    each tensor's latents in order, in blocks of BLOCK, then `close`)."""

    def __init__(self, storage: Storage, record: FeaturesRecord):
        self.storage = storage
        self.record = record
        self.indexes: dict[str, _Index] = {}
        for summary in record.tensors:
            if not _TENSOR.match(summary.tensor):
                raise ValueError(f"tensor {summary.tensor!r}: the site names a directory after it; use letters, "
                                 "digits, '_', '.' and '-'")
            self.indexes[summary.tensor] = _Index(summary.dense_above)
        self.order = BlockOrder(record)

    def add(self, tensor: str, block: list[Latent]) -> None:
        path = block_path(tensor, self.order.take(tensor, block))
        self.storage.write_bytes(path, script(path, [_latent(latent) for latent in block]))
        for latent in block:
            self.indexes[tensor].add(latent)

    def close(self) -> None:
        """Writes the indexes, the record and the pages, once every tensor's latents are in."""
        self.order.check_complete()
        for summary in self.record.tensors:
            index = self.indexes[summary.tensor]
            path = index_path(summary.tensor)
            self.storage.write_bytes(path, script(path, {
                "tensor": summary.tensor, "latents": summary.latents, "tokens": summary.tokens,
                "dense_above": summary.dense_above, "block": BLOCK, "top_tokens": TOP_TOKENS, **index.columns}))
        self.storage.write_bytes("data/site.js", script("data/site.js", self.record.to_json()))
        web = resources.files("harvest.sae.features") / "web"
        for name in WEB_FILES:
            self.storage.write_bytes(name, (web / name).read_bytes())
