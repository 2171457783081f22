"""A small `harvest sae features` output to test against: the SAE tests' run (sae_helpers), an SAE trained a
few steps on it, and the features pass over its held-out stream, with every Latent the writers were given."""

from __future__ import annotations

import json
from pathlib import Path

from extract_helpers import run_harvest
from sae_helpers import extracted_source, train_args


def features_source(root: Path) -> dict:
    """sae_helpers.extracted_source's run and an SAE trained on it (12 steps, 256 latents, one held-out stream):
    {"run", "sae", "checkpoint", "env", "root"}."""
    source = extracted_source(root)
    sae = str(root / "sae")
    done = run_harvest(*train_args(source, sae), env=source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    return {**source, "sae": sae}


class Collect:
    """A writer that keeps the blocks it is given: {tensor: [Latent, ...]} in order."""

    def __init__(self, latents: dict):
        self.latents = latents

    def add(self, tensor: str, block: list) -> None:
        self.latents.setdefault(tensor, []).extend(block)

    def close(self) -> None:
        pass


def build_features(sae: str, out: Path, site: bool = True, **settings) -> tuple[Path, object, dict]:
    """`harvest sae features SAE --out OUT` in this process (`settings`: FeaturesConfig's), with the site's writer
    (and the Neuronpedia one with neuronpedia=True) unless `site` is False: (out, the FeaturesRecord read back
    from features.json, {tensor: [Latent, ...]} as the writers got them)."""
    from harvest.sae.features.build import default_writers, run_features
    from harvest.sae.features.config import FeaturesConfig
    from harvest.sae.features.record import FEATURES_JSON, FeaturesRecord

    cfg = FeaturesConfig(sae=sae, out=str(out), **settings).validate()
    latents: dict = {}

    def writers(storage, record):
        return [*(default_writers(cfg.neuronpedia)(storage, record) if site else []), Collect(latents)]

    done = run_features(cfg, writers)
    assert done["built"], done
    record = FeaturesRecord.from_json(json.loads((Path(out) / FEATURES_JSON).read_text()))
    return Path(out), record, latents
