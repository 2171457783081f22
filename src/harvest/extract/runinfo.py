"""What a run is: run.json built from the settings, the model and the data, and the settings every command
writing into the same output must agree on (a refused command shows the difference)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from harvest.config import ExtractConfig, stable_hash
from harvest.data import prompts
from harvest.errors import UserError
from harvest.model import CapturePlan, ModelConfig
from harvest.store import format as fmt, quant
from harvest.storage import Storage
from harvest.store.records import NewerFormat, RunInfo
from harvest.version import harvest_version


class RunMismatch(UserError):
    pass


def _file_hash(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        if path.exists():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def build_run_info(cfg: ExtractConfig, m: ModelConfig, plan: CapturePlan, checkpoint: Path, data,
              compute_dtype: str) -> RunInfo:
    counts = None if None in data.counts else list(data.counts)  # a plain source: length unknown
    if counts is not None and cfg.max_samples is not None:
        counts = [min(c, cfg.max_samples) for c in counts]
    info = {
        "format_version": fmt.FORMAT_VERSION,
        "harvest_version": harvest_version(),
        "model": {"source": cfg.model, "model_type": m.model_type, "config_sha256": stable_hash(m.to_dict()),
                  "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "intermediate_size": m.intermediate_size},
        "tokenizer_sha256": _file_hash([checkpoint / n for n in ("tokenizer.json", "tokenizer_config.json",
                                                                 "chat_template.jinja")]),
        "special_token_ids": prompts.special_token_ids(checkpoint),  # left out of SAE batches by the reader
        "points": [[p, list(layers)] for p, layers in plan.points],
        "tensors": {fmt.tensor_name(p, layer): (m.intermediate_size if p == "mlp_hidden" else m.hidden_size)
                    for p, layer in plan.keys()},
        "dtype": cfg.dtype,
        "quantization": quant.record(cfg.dtype),
        "compute_dtype": compute_dtype,
        "max_seq_len": cfg.max_seq_len,
        "long": cfg.long,
        "format": cfg.format,
        "data": {"source": _data_url(cfg.data), "num_streams": data.num_streams, "counts": counts,
                 "mapping": "round_robin", "sha256": getattr(data, "sha256", None)},
        "config": cfg.to_dict(),
    }
    return RunInfo(**info, config_sha256=stable_hash(agreed(RunInfo(**info, config_sha256=""))))


def _data_url(spec: str) -> str:
    """A local path made absolute: the same files named from another working directory are the same data."""
    return spec if "://" in spec else os.path.abspath(spec)


def agreed(info: RunInfo) -> dict[str, Any]:
    """What two commands writing into one run must agree on (not flags like --batch-size or --streams): the
    format version too, so that a harvest that writes another format never appends to the run. The points as
    resolved (one spelling of them), not as typed: `blocks.1.hook_resid_post` is `resid_post:1`."""
    settings = {k: info.config.get(k) for k in ExtractConfig.OUTPUT_FIELDS}
    settings["points"] = CapturePlan(tuple((p, tuple(layers)) for p, layers in info.points)).spec()
    data = dict(info.data)
    if data.get("sha256"):  # streams: their content (streams.json's sha256 per file) decides, not their URL
        data.pop("source", None)
    return {"format_version": info.format_version, "model": info.model.get("config_sha256"), "tokenizer": info.tokenizer_sha256, "data": data,
            "tensors": info.tensors, "compute_dtype": info.compute_dtype, **settings}


def check_run(out: Storage, info: RunInfo, *, partial_overwrite: bool = False) -> None:
    """Refuse to add to a run made with other settings, showing the difference (`partial_overwrite`: the
    command replaces some of the run's streams, whose others stay as run.json describes them)."""
    if not out.exists(fmt.RUN_JSON):
        return
    try:
        existing = RunInfo.from_bytes(out.read_bytes(fmt.RUN_JSON))
    except NewerFormat as e:
        raise RunMismatch(f"{out.url}/run.json: {e}") from None
    except ValueError as e:
        raise RunMismatch(f"{out.url}/run.json: not a harvest run.json ({e}); use another --out") from None
    old, new = agreed(existing), agreed(info)
    differ = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
    if differ:
        what = ("--overwrite of some streams keeps the others and run.json, so it cannot change the settings; "
                "overwrite every stream (no --streams), or use another --out") if partial_overwrite else \
            "use another --out, or --overwrite to start over"
        raise RunMismatch(f"{out.url} holds a run made with other settings ({'; '.join(differ)}); {what}")
