"""What `harvest sae features` found, per SAE tensor and per latent: the typed records the site
(sae/features/site.py) and the SAEDashboard/Neuronpedia export (sae/features/dashboard.py) are written from,
and the run's summary (features.json), read in one place.

A latent's examples are `Context`s: a window of decoded tokens around one token of the run, the latent's
activation on each token of the window, and where the token lies in the run (stream, shard, offset), so any
example can be found again with `harvest inspect`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FEATURES_JSON = "features.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Context:
    """One example: `tokens` (decoded, one string per token, as the tokenizer renders each id), the latent's
    activation on each (`acts`, 0 where it did not fire), `at`: the index in `tokens` of the example's token,
    whose activation is `value`; `where`: (stream, shard, offset of the token in the shard)."""

    tokens: list[str]
    acts: list[float]
    at: int
    value: float
    where: tuple[int, int, int]

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "acts": self.acts, "at": self.at, "value": self.value,
                "where": list(self.where)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Context:
        return cls(list(data["tokens"]), [float(a) for a in data["acts"]], int(data["at"]), float(data["value"]),
                   tuple(int(w) for w in data["where"]))


@dataclasses.dataclass(frozen=True)
class Bin:
    """Examples of one quantile bin of a latent's firings: activations in [lo, hi], drawn uniformly from the
    tokens it fired on (SAEDashboard's "interval" examples)."""

    lo: float
    hi: float
    examples: list[Context]

    def to_json(self) -> dict[str, Any]:
        return {"lo": self.lo, "hi": self.hi, "examples": [c.to_json() for c in self.examples]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Bin:
        return cls(float(data["lo"]), float(data["hi"]), [Context.from_json(c) for c in data["examples"]])


@dataclasses.dataclass(frozen=True)
class Latent:
    """One latent: how often it fired (> 0) over the tokens read, its largest and mean activation (over the
    tokens it fired on), its top examples (largest first), its quantile bins (lowest first), the histogram of
    its activations where it fired (`edges` n+1, `counts` n), and the tokens its decoder direction promotes and
    suppresses through the model's unembedding (empty without a model)."""

    index: int
    count: int
    density: float
    max: float
    mean: float
    top: list[Context]
    bins: list[Bin]
    edges: list[float]
    counts: list[int]
    top_logits: list[tuple[str, float]]
    bottom_logits: list[tuple[str, float]]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "count": self.count, "density": self.density, "max": self.max,
                "mean": self.mean, "top": [c.to_json() for c in self.top], "bins": [b.to_json() for b in self.bins],
                "edges": self.edges, "counts": self.counts,
                "top_logits": [list(t) for t in self.top_logits],
                "bottom_logits": [list(t) for t in self.bottom_logits]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Latent:
        return cls(int(data["index"]), int(data["count"]), float(data["density"]), float(data["max"]),
                   float(data["mean"]), [Context.from_json(c) for c in data["top"]],
                   [Bin.from_json(b) for b in data["bins"]], [float(e) for e in data["edges"]],
                   [int(c) for c in data["counts"]], [(str(t), float(v)) for t, v in data["top_logits"]],
                   [(str(t), float(v)) for t, v in data["bottom_logits"]])


@dataclasses.dataclass(frozen=True)
class TensorSummary:
    """One SAE's pass: its tensor, latents, the tokens read, and the density limits its latents are marked by
    (dead: fired on none of them; dense: on more than `dense` of them)."""

    tensor: str
    latents: int
    tokens: int
    dead: int
    dense: int
    dense_above: float
    architecture: str
    width: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorSummary:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class FeaturesRecord:
    """features.json: what made the pass (the SAE run and step, the runs and streams read, the settings) and
    each tensor's summary."""

    sae_run: str
    step: int
    runs: list[str]
    streams: list[list[int]]  # per run, the streams read
    model: str | None  # the checkpoint whose tokenizer decoded the tokens (and unembedding gave the logits)
    settings: dict[str, Any]  # top, window, bins, per_bin, dense_above, ...
    tensors: list[TensorSummary]
    format_version: int = FORMAT_VERSION
    model_name: str | None = None  # the model as people name it (a hub id's name, a GGUF file's), for titles

    def to_json(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "sae_run": self.sae_run, "step": self.step,
                "runs": self.runs, "streams": self.streams, "model": self.model, "model_name": self.model_name,
                "settings": self.settings,
                "tensors": [t.to_json() for t in self.tensors]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FeaturesRecord:
        return cls(str(data["sae_run"]), int(data["step"]), list(data["runs"]),
                   [[int(s) for s in r] for r in data["streams"]], data.get("model"), dict(data["settings"]),
                   [TensorSummary.from_json(t) for t in data["tensors"]], int(data.get("format_version", 0)),
                   data.get("model_name"))
