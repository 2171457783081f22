"""`harvest sae eval SAE_RUN [--run RUN]`: FVU, L0, dead fraction and the latents' firing histogram on
tokens the training did not read: the SAE run's held-out streams (chosen by its seed), or another run.
With `--model MODEL --data TEXTS`, also CE loss recovered (sae/splice.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harvest.config import str_list
from harvest.errors import UserError
from harvest.read.run import open_run
from harvest.sae import model as M
from harvest.sae.export import load_sae_run, spec_of, trained_max_norm
from harvest.sae.splice import ce_loss_recovered

BINS = np.arange(-8, 1)  # log10 of the firing frequency: 1e-8 ... 1 (and "never")


def evaluate(url: str, run_url: str | None = None, *, tokens: int = 100_000, batch: int = 1024,
             step: int | None = None, model: str | None = None, data: str | None = None,
             max_seq_len: int = 256, skip_first: int | None = None, max_norm: float | None = None) -> dict[str, Any]:
    """Per tensor: fvu, l0, dead_fraction (latents that fired on none of the tokens read: dead over a window of
    `dead_window` tokens, as training counts them over its last ones), the firing histogram (latents per decade
    of frequency) and the tokens read; with `model` and `data`, CE loss recovered on those texts.
    Each sample's first `skip_first` tokens are left out of both, and (`max_norm` R) every token whose norm
    exceeds R x its run's median token norm (default for both: as the SAE was trained; the medians its training
    recorded, or, for another run or an SAE trained without the rule, the run's own). The CE splice leaves
    clean the tokens over R x the first run's median."""
    if (model is None) != (data is None):
        raise UserError("harvest sae eval: --model and --data go together (CE loss recovered on those texts)")
    info, step, params = load_sae_run(url, step)
    if skip_first is None:
        skip_first = int(info["config"].get("skip_first", 0))
    by_default = max_norm is None
    urls = [run_url] if run_url else str_list(info["config"]["run"])
    results = {}
    for name, p in params.items():
        sae = info["saes"][name]
        spec = spec_of(sae)
        ratio = trained_max_norm(info, name) if by_default else float(max_norm)
        streams = None if run_url else sae["holdout_streams"]
        if streams is not None and not any(streams):
            raise UserError(f"{url} was trained with no --holdout-streams: give --run RUN (tokens it did not read)")
        sq_err = var = 0.0
        counts = np.zeros(spec.latents, np.int64)
        l0 = seen = massive = considered = 0
        medians = []
        device_params = jax.device_put(p)
        for r, run_url_r in enumerate(urls):
            run = open_run(run_url_r)
            if name not in run.tensors:
                raise UserError(f"{run.url} holds no {name}; it holds {', '.join(run.tensors)}")
            recorded = sae.get("median_norm") if not run_url else None
            rule = {} if not ratio else {"max_norm": ratio, "median_norm": recorded[r] if recorded else None}
            reader = run.token_batches(batch, [name], seed=info["config"]["seed"], dtype="float32",
                                       streams=None if streams is None else streams[r], skip_first=skip_first,
                                       **rule)
            medians.append(reader.median_norms.get(name))
            for rows in reader:
                x = rows[name]
                latents, out = M.infer(device_params, jnp.asarray(x), spec)
                latents, out = np.asarray(latents), np.asarray(out)
                sq_err += float(np.sum((x - out) ** 2))
                var += float(np.sum((x - x.mean(0)) ** 2))
                fired = latents > 0
                counts += fired.sum(0)
                l0 += int(fired.sum())
                seen += len(x)
                if seen >= tokens:
                    break
            massive, considered = massive + reader.massive_left_out, considered + reader.tokens_considered
        if not seen:
            raise UserError(f"no tokens of {name} to evaluate on in {', '.join(urls)}")
        frequency = counts / seen
        histogram = np.histogram(np.log10(frequency[frequency > 0]), bins=BINS)[0] if counts.any() else np.zeros(8)
        results[name] = {"fvu": sq_err / max(var, 1e-12), "l0": l0 / seen, "dead_fraction": float(np.mean(counts == 0)),
                         "dead_window": seen, "tokens": seen, "skip_first": skip_first,
                         "firing_histogram": {f"1e{lo}..1e{lo + 1}": int(n) for lo, n in zip(BINS[:-1], histogram)}}
        if ratio:
            results[name].update(max_norm=ratio, median_norm=medians, massive_left_out=massive,
                                 massive_share=massive / max(considered, 1))
        if model is not None:
            results[name]["downstream"] = ce_loss_recovered(model, data, name, p, spec, tokens=tokens,
                                                            max_seq_len=max_seq_len, skip_first=skip_first,
                                                            norm_limit=ratio * medians[0] if ratio else None)
    return {"step": step, "tensors": results}
