"""CE loss recovered: the model's next-token cross-entropy on texts with an SAE's reconstruction spliced
in at its point, against the clean model and against that point zeroed:
(CE_zero - CE_sae) / (CE_zero - CE_clean), 1 for a perfect SAE, 0 for one no better than zeros.

The forward is harvest's own decoder (model.transformer's layer, embedding and head), run as two scans
over the stacked layers: up to the point, the replacement, then the rest. Residual points only
(resid_pre.L, resid_post.L): there the stream between layers is the activation. Every token of a text is
spliced (one text a row, cut at `max_seq_len`) but its first `skip_first` and (`norm_limit`) those whose
activation's L2 norm exceeds the limit (an SAE trained without the attention sinks or the massive
activations keeps them clean, in the zero baseline too); the loss counts every next-token prediction within
a text.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from harvest.data.prompts import SampleError, encoder, load_tokenizer, make_renderer
from harvest.data.sources import iter_records
from harvest.errors import UserError
from harvest.model import transformer as T
from harvest.model.config import ModelConfig
from harvest.model.weights import load_params, resolve_checkpoint
from harvest.sae import model as M

POINTS = ("resid_pre", "resid_post")


def split_point(tensor: str, cfg: ModelConfig) -> tuple[str, int]:
    """('resid_post', 12) from 'resid_post.12'; refuses a point the splice cannot replace."""
    point, _, layer = tensor.rpartition(".")
    if point not in POINTS or not layer.isdigit() or int(layer) >= cfg.num_layers:
        raise UserError(f"--model: cannot splice {tensor} (CE loss recovered takes {' or '.join(POINTS)}.L with "
                        f"L < {cfg.num_layers})")
    return point, int(layer)


@partial(jax.jit, static_argnames=("cfg", "split", "mode", "spec", "skip_first"))
def losses(params: dict, tokens: jax.Array, segments: jax.Array, sae: dict, *, cfg: ModelConfig, split: int,
           mode: str, spec: M.Spec, skip_first: int = 0, norm_limit: jax.Array | float = jnp.inf
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(summed next-token cross-entropy, predictions counted, real tokens past `skip_first` left clean for their
    norm) of a batch [rows, seq]; the residual stream after `split` layers is kept (clean), replaced by the SAE's
    reconstruction (sae) or zeroed (zero), but at each row's first `skip_first` tokens and where its L2 norm
    exceeds `norm_limit`."""
    dtype = params["embed"].dtype
    rotary_of, attend_of = T.attention_inputs(cfg, segments, cfg.num_layers, dtype, "dense", None)

    def run(h, lo, hi):
        def step(h, xs):
            lp, i = xs
            return T.layer(cfg, lp, h, rotary_of(i), attend_of(i))["resid_post"], None

        layers = jax.tree.map(lambda a: a[lo:hi], params["layers"])
        return jax.lax.scan(step, h, (layers, jnp.arange(lo, hi)))[0] if hi > lo else h

    h = run(T.embed(params, tokens, segments, cfg, lambda x, axes: x), 0, split)
    later = jnp.arange(h.shape[1])[None, :] >= skip_first
    massive = jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1) > jnp.square(norm_limit)
    spliced = (later & ~massive)[..., None]
    left_clean = jnp.sum(later & massive & (segments > 0))
    if mode == "sae":
        rows = h.reshape(-1, h.shape[-1]).astype(jnp.float32)
        h = jnp.where(spliced, M.decode(sae, M.encode(sae, rows, spec, inference=True)).reshape(h.shape).astype(dtype),
                      h)
    elif mode == "zero":
        h = jnp.where(spliced, 0, h)
    logits = T.unembed(params, cfg, T.final_norm(params, cfg, run(h, split, cfg.num_layers))).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    counted = (segments[:, 1:] > 0) & (segments[:, 1:] == segments[:, :-1])
    return jnp.sum(jnp.where(counted, nll, 0.0)), jnp.sum(counted), left_clean


def text_batches(model_dir, data: str, text_field: str, rows: int, max_seq_len: int,
                 tokens: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, segment ids) [rows, max_seq_len]: one text a row, cut at max_seq_len, padding segment 0;
    records that are not a usable text are skipped; stops past `tokens` tokens."""
    tokenizer = load_tokenizer(model_dir)
    render, encode = make_renderer("text", tokenizer, text_field=text_field), encoder(tokenizer, "text")
    ids, seen = [], 0
    for record in iter_records(data):
        try:
            text = render(record)[0]
        except SampleError:
            continue
        ids.append(encode([text])[0][:max_seq_len])
        seen += len(ids[-1])
        if len(ids) == rows or seen >= tokens:
            yield _pack(ids, rows, max_seq_len)
            ids = []
        if seen >= tokens:
            return
    if ids:
        yield _pack(ids, rows, max_seq_len)


def _pack(ids: list[list[int]], rows: int, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, segments = np.zeros((rows, max_seq_len), np.int32), np.zeros((rows, max_seq_len), np.int32)
    for r, row in enumerate(ids):
        tokens[r, :len(row)], segments[r, :len(row)] = row, 1
    return tokens, segments


def ce_loss_recovered(model: str, data: str, tensor: str, sae: dict[str, np.ndarray], spec: M.Spec, *,
                      text_field: str = "text", tokens: int = 100_000, rows: int = 8,
                      max_seq_len: int = 256, skip_first: int = 0, norm_limit: float | None = None) -> dict[str, Any]:
    """{ce_clean, ce_sae, ce_zero, ce_loss_recovered, tokens, massive_left_clean} of one SAE (params at the raw
    input scale), each text's first `skip_first` tokens left clean, and (`norm_limit`) every token whose
    activation's L2 norm exceeds it."""
    model_dir = resolve_checkpoint(model)
    cfg = ModelConfig.from_dir(model_dir)
    point, layer = split_point(tensor, cfg)
    if spec.width != cfg.hidden_size:
        raise UserError(f"--model {model}: hidden size {cfg.hidden_size}, but the {tensor} SAE is {spec.width} wide")
    params = load_params(model_dir, cfg, dtype=np.float32, head=True)
    split = layer + 1 if point == "resid_post" else layer
    device_sae = jax.device_put({k: jnp.asarray(v) for k, v in sae.items()})
    sums, count, massive = {"clean": 0.0, "sae": 0.0, "zero": 0.0}, 0, 0
    limit = jnp.float32(np.inf if not norm_limit else norm_limit)
    for batch_tokens, segments in text_batches(model_dir, data, text_field, rows, max_seq_len, tokens):
        for mode in sums:
            total, n, clean = losses(params, batch_tokens, segments, device_sae, cfg=cfg, split=split, mode=mode,
                                     spec=spec, skip_first=skip_first, norm_limit=limit)
            sums[mode] += float(total)
        count, massive = count + int(n), massive + int(clean)
    if not count:
        raise UserError(f"--data {data}: no texts with two tokens or more (field {text_field!r}) to score")
    ce = {mode: value / count for mode, value in sums.items()}
    gap = ce["zero"] - ce["clean"]
    return {"ce_clean": ce["clean"], "ce_sae": ce["sae"], "ce_zero": ce["zero"],
            "ce_loss_recovered": (ce["zero"] - ce["sae"]) / gap if gap else float("nan"), "tokens": count,
            "massive_left_clean": massive}
