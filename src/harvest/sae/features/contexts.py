"""Each latent's examples as contexts: the top-K tokens and the quantile bins' samples, fetched at the end by
(stream, shard, offset) from the run, a shard at a time, with +/- `window` tokens within the token's sample.

The window's activations come from encoding its rows whole on the devices, as the pass encoded them (rows
split over the devices in batches of `batch_tokens`: a row's latents have the same bits in any batch), and
picking the example's latent: a TopK SAE's latent depends on the whole row, not on its encoder column alone."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from harvest.read.layout import checked_layout, checked_offsets
from harvest.read.shuffle import Piece
from harvest.sae.features import running as R
from harvest.sae.features.plan import Plan
from harvest.sae.features.record import Bin, Context
from harvest.sae.features.scan import reader, values
from harvest.sae.features.state import NO_KEY, TensorState
from harvest.sae.features.vocab import Vocab
from harvest.store import format as fmt
from harvest.store.snapshot import shard_path

PAIRS = 8192  # (row, latent) activations picked per call


@dataclasses.dataclass(frozen=True)
class Example:
    latent: int
    ordinal: int
    offset: int
    value: float


def examples(state: TensorState, lo: int, hi: int, bins: int, per_bin: int
             ) -> tuple[dict[int, list[Example]], dict[int, list[list[Example]]]]:
    """Latents [lo, hi)'s top examples (largest first) and quantile bins (the sample by value, lowest first, in
    groups of `per_bin`: fewer groups when it fired fewer times)."""
    top, binned = {}, {}
    for latent in range(lo, hi):
        v, p = state.top_value[latent], state.top_pos[latent]
        top[latent] = [Example(latent, int(p[j, 0]), int(p[j, 1]), float(v[j])) for j in np.flatnonzero(v > -np.inf)]
        held = np.flatnonzero(state.sample_key[latent] != NO_KEY)
        sv, sp = state.sample_value[latent][held], state.sample_pos[latent][held]
        order = np.lexsort((sp[:, 1], sp[:, 0], sv))
        drawn = [Example(latent, int(sp[j, 0]), int(sp[j, 1]), float(sv[j])) for j in order]
        binned[latent] = [drawn[g:g + per_bin] for g in range(0, len(drawn), per_bin)][:bins]
    return top, binned


class Contexts:
    """Fetches and encodes examples' windows for one SAE tensor."""

    def __init__(self, plan: Plan, tensor: str, vocab: Vocab):
        self.plan, self.tensor, self.vocab = plan, tensor, vocab
        self.spec = plan.specs[tensor]
        self.mesh = R.device_mesh()
        self.params = R.place(plan.params[tensor], self.spec, self.mesh)
        self._encode = R.make_encode(self.spec, self.mesh)
        self._pick = jax.jit(lambda a, r, c: a[r, c])

    def build(self, wanted: list[Example]) -> dict[Example, Context]:
        """Every example's context, reading each shard they lie in once."""
        by_shard: dict[int, list[Example]] = defaultdict(list)
        for e in wanted:
            by_shard[e.ordinal].append(e)
        out = {}
        for ordinal in sorted(by_shard):
            out.update(self._shard(ordinal, by_shard[ordinal]))
        return out

    def _shard(self, ordinal: int, wanted: list[Example]) -> dict[Example, Context]:
        plan, window = self.plan, self.plan.cfg.window
        shard = plan.shards[ordinal]
        run, sc = plan.runs[shard.run], shard.sidecar
        rel = shard_path(sc)
        stored = np.dtype(fmt.STORED_DTYPES.get(run.dtype, np.float32))
        layout = checked_layout(run.storage, rel, sc, {self.tensor: self.spec.width}, stored, run.dtype)
        offsets = checked_offsets(run.storage, rel, layout, sc, True)
        spans = {}
        for e in wanted:
            sample = int(np.searchsorted(offsets, e.offset, side="right")) - 1
            spans[e] = (max(int(offsets[sample]), e.offset - window), min(int(offsets[sample + 1]), e.offset + window + 1))
        first, last = min(a for a, _ in spans.values()), max(b for _, b in spans.values())
        cols = reader(plan, shard.run).read(Piece(sc.stream, sc.shard, first, last), sc, (), 0, ()).cols
        rows = np.unique(np.concatenate([np.arange(a, b) for a, b in spans.values()]))
        pairs = [(row, e.latent) for e, (a, b) in spans.items() for row in range(a, b)]
        acts = self._acts(cols, rows - first, first, pairs, run.dtype)
        ids = cols["tokens"].view(np.int32)
        out = {}
        for e, (a, b) in spans.items():
            tokens = self.vocab(ids[a - first:b - first])
            out[e] = Context(tokens, [acts[(row, e.latent)] for row in range(a, b)], e.offset - a, e.value,
                             (sc.stream, sc.shard, e.offset))
        return out

    def _acts(self, cols: dict, local: np.ndarray, first: int, pairs: list[tuple[int, int]], dtype: str
              ) -> dict[tuple[int, int], float]:
        """{(row, latent): activation} for `pairs`, encoding the rows (`local`: indices into `cols`) a batch at
        a time."""
        batch = self.plan.cfg.batch_tokens
        by_row = defaultdict(list)
        for row, latent in set(pairs):
            by_row[row].append(latent)
        found = {}
        for lo in range(0, len(local), batch):
            take = local[lo:lo + batch]
            x = np.zeros((batch, self.spec.width), np.float32)
            x[:len(take)] = values(dtype, cols, self.tensor, take)
            acts = self._encode(self.params, jax.device_put(x, R.whole(self.mesh)))
            asked = [(i, row + first, latent) for i, row in enumerate(take) for latent in by_row[row + first]]
            for at in range(0, len(asked), PAIRS):
                part = asked[at:at + PAIRS]
                r = np.zeros(PAIRS, np.int32)
                c = np.zeros(PAIRS, np.int32)
                r[:len(part)] = [i for i, _, _ in part]
                c[:len(part)] = [latent for _, _, latent in part]
                got = np.asarray(self._pick(acts, jnp.asarray(r), jnp.asarray(c)))
                found.update({(row, latent): float(v) for (_, row, latent), v in zip(part, got)})
        return found


def contexts_of(top: list[Example], binned: list[list[Example]], made: dict[Example, Context]
                ) -> tuple[list[Context], list[Bin]]:
    return ([made[e] for e in top],
            [Bin(group[0].value, group[-1].value, [made[e] for e in group]) for group in binned if group])
