"""What a features pass reads, settled (and refused in one line) before anything is written: the SAE run's
params, the runs and streams, the ordered list of committed shards every rank agrees on, and the tokens left
out as the SAE's training left them out (the tokenizer's special tokens, each sample's first `skip_first`, and,
on the runs it trained on, those over its recorded norm limit)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from harvest.config import str_list
from harvest.errors import UserError
from harvest.ranges import parse_ranges
from harvest.read.run import Run, open_run
from harvest.sae import model as M
from harvest.sae.export import load_sae_run, spec_of
from harvest.sae.features.config import FeaturesConfig
from harvest.sae.features.state import PER_OCTAVE, STATE_VERSION
from harvest.storage import Storage
from harvest.store.records import Sidecar
from harvest.training.record import RunMismatch


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard of the pass, by its ordinal in `Plan.shards`."""

    run: int
    sidecar: Sidecar


@dataclasses.dataclass
class Plan:
    cfg: FeaturesConfig
    info: dict[str, Any]  # the SAE run's run.json
    step: int
    params: dict[str, dict[str, np.ndarray]]  # per tensor, at the raw input scale
    specs: dict[str, M.Spec]
    runs: list[Run]
    streams: list[list[int]]  # per run
    shards: list[Shard]  # every rank's, in order: a position's ordinal indexes it
    exclude: list[tuple[int, ...]]  # per run: token ids left out
    skip_first: int
    norm_limits: list[tuple[tuple[str, float], ...]]  # per run: ((tensor, L2 limit), ...)

    @property
    def tensors(self) -> list[str]:
        return list(self.specs)

    def mine(self) -> list[int]:
        """The ordinals this rank reads: every `world`-th shard from `rank`."""
        return list(range(self.cfg.rank, len(self.shards), self.cfg.world))

    def listing(self) -> list[dict[str, int]]:
        return [{str(s): len(run.shards_of(s)) for s in streams} for run, streams in zip(self.runs, self.streams)]

    def pinned(self, listing: list[dict[str, int]]) -> Plan:
        """The plan over the shards `listing` names (a saved state's: a resume reads what it read)."""
        return _pinned(self, listing)

    def settings(self) -> dict[str, Any]:
        """What decides a rank's state: a resume (and the merge) must find the same."""
        c = self.cfg
        return {"sae": Storage(c.sae).url, "step": self.step, "runs": [r.url for r in self.runs],
                "streams": self.streams, "tensors": self.tensors, "top": c.top, "bins x per_bin": c.bins * c.per_bin,
                "batch_tokens": c.batch_tokens, "tokens": c.tokens, "world": c.world,
                "exclude": [list(e) for e in self.exclude], "skip_first": self.skip_first,
                "norm_limits": [[list(x) for x in n] for n in self.norm_limits], "per_octave": PER_OCTAVE,
                "version": STATE_VERSION}


def make_plan(cfg: FeaturesConfig) -> Plan:
    """The pass's inputs, every check made (one-line errors), nothing written."""
    try:
        info, step, params = load_sae_run(cfg.sae, cfg.step)
    except RunMismatch:  # its words are for a trainer's --out
        raise UserError(f"{Storage(cfg.sae).url} is not an SAE run (its run.json is not `harvest sae train`'s): give "
                        "the SAE run's URL, the --out of `harvest sae train`") from None
    specs = {name: spec_of(sae) for name, sae in info["saes"].items()}
    trained = [Storage(u).url for u in str_list(info["config"]["run"])]
    urls = [cfg.run] if cfg.run else trained
    runs = [open_run(u) for u in urls]
    first = next(iter(info["saes"].values()))
    streams, exclude, limits = [], [], []
    for r, run in enumerate(runs):
        missing = [t for t in specs if t not in run.tensors]
        if missing:
            raise UserError(f"{run.url} holds no {', '.join(missing)} (the SAE's tensors); it holds "
                            f"{', '.join(run.tensors)}")
        wrong = [t for t in specs if run.tensors[t] != specs[t].width]
        if wrong:
            raise UserError(f"{run.url}: {wrong[0]} is {run.tensors[wrong[0]]} wide, the SAE's input "
                            f"{specs[wrong[0]].width}")
        at = trained.index(run.url) if run.url in trained else None
        streams.append(_streams(cfg, run, None if at is None else first["holdout_streams"][at]))
        exclude.append(tuple(int(t) for t in (run.info.special_token_ids or [])))
        limits.append(tuple((t, float(s["norm_limit"][at])) for t, s in info["saes"].items()
                            if at is not None and s.get("norm_limit")))
    plan = Plan(cfg, info, step, params, specs, runs, streams, [], exclude, int(info["config"].get("skip_first", 0)),
                limits)
    return plan.pinned(plan.listing())


def _pinned(plan: Plan, listing: list[dict[str, int]]) -> Plan:
    runs = [Run(run.storage, run.view.limited({int(s): n for s, n in counts.items()}))
            for run, counts in zip(plan.runs, listing)]
    shards = [Shard(r, sc) for r, run in enumerate(runs) for s in plan.streams[r] for sc in run.shards_of(s)
              if sc.tokens]
    if not shards:
        raise UserError(f"no committed shard in the streams read ({_described(runs, plan.streams)}): nothing to read")
    return dataclasses.replace(plan, runs=runs, shards=shards)


def _streams(cfg: FeaturesConfig, run: Run, holdout: list[int] | None) -> list[int]:
    if cfg.streams == "all":
        return list(run.streams)
    if cfg.streams == "held-out":
        if holdout is None:
            raise UserError(f"--streams held-out: {run.url} is not a run the SAE trained on, so none of its streams "
                            "is held out; give --streams all or a list such as 0-3")
        if not holdout:
            raise UserError(f"--streams held-out: {cfg.sae} was trained with no --holdout-streams, so every stream "
                            "was trained on; give --streams all (or a list such as 0-3), or --run another run")
        return list(holdout)
    chosen = parse_ranges(cfg.streams, "--streams")
    absent = [s for s in chosen if s not in run.streams]
    if absent:
        raise UserError(f"--streams {cfg.streams}: {run.url} has no committed shard in stream(s) "
                        f"{', '.join(map(str, absent))}; it has {', '.join(map(str, run.streams))}")
    return chosen


def _described(runs: list[Run], streams: list[list[int]]) -> str:
    return "; ".join(f"{run.url} streams {', '.join(map(str, s)) or 'none'}" for run, s in zip(runs, streams))
