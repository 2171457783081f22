"""Which of SAELens's published SAEs are on models harvest extracts: docs/extracting.md holds the table, counted
from the installed registry (`sae_lens/pretrained_saes.yaml`, read as YAML without importing sae_lens) and
harvest's own list of supported `model_type`s; saelens_models.py gives each registry model its type.

Out of date (a new sae-lens, a newly supported family)? Regenerate the section in place:

    python tests/model/test_saelens_coverage.py
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
from collections import defaultdict
from pathlib import Path

import yaml
from saelens_models import MODELS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "extracting.md"
START, END = "<!-- saelens-table:start -->", "<!-- saelens-table:end -->"
REGENERATE = "python tests/model/test_saelens_coverage.py"


def supported_types() -> tuple[str, ...]:
    """The HF model_types harvest extracts, from harvest itself: harvest.model.families.SUPPORTED, or
    harvest.model.config.SUPPORTED where there is no families package (yet)."""
    try:
        families = importlib.import_module("harvest.model.families")
    except ModuleNotFoundError as e:
        if e.name != "harvest.model.families":
            raise
        families = None
    if families is not None and hasattr(families, "SUPPORTED"):
        return tuple(families.SUPPORTED)
    import harvest.model.config as config

    assert hasattr(config, "SUPPORTED"), "harvest names no SUPPORTED model_types (harvest.model.families.SUPPORTED)"
    return tuple(config.SUPPORTED)


@functools.cache
def registry() -> dict:
    spec = importlib.util.find_spec("sae_lens")  # a top-level spec: sae_lens itself is not imported
    path = Path(next(iter(spec.submodule_search_locations))) / "pretrained_saes.yaml"
    with open(path) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def per_model(releases: dict) -> dict[str, tuple[int, int]]:
    """model -> (releases, SAEs)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for release in releases.values():
        counts[release["model"]][0] += 1
        counts[release["model"]][1] += len(release["saes"])
    return {model: (r, s) for model, (r, s) in counts.items()}


def section(releases: dict, supported: tuple[str, ...]) -> str:
    """What docs/extracting.md holds between the markers (the newlines around it included)."""
    counts = per_model(releases)
    rows = sorted(counts.items(), key=lambda item: (-item[1][1], item[0]))
    lines = ["| model | releases | SAEs | HF model_type | harvest extracts |", "|---|--:|--:|---|---|"]
    extracted = total = 0
    for model, (n_releases, n_saes) in rows:
        model_type = MODELS[model].model_type
        yes = model_type in supported
        extracted += n_saes if yes else 0
        total += n_saes
        lines.append(f"| `{model}` | {n_releases} | {n_saes:,} | `{model_type}` | {'yes' if yes else 'no'} |")
    version = importlib.metadata.version("sae-lens")
    return "\n".join([
        "", "", *lines, "",
        f"harvest extracts the models of {extracted:,} of {total:,} published SAEs ({100 * extracted / total:.2f}%), "
        f"counted from the registry of sae-lens {version}.",
        "", "",
    ])


def split_doc(text: str) -> tuple[str, str, str]:
    """(before and the start marker, the section, the end marker and after)."""
    assert text.count(START) == 1 and text.count(END) == 1, f"{DOC}: expected one {START} and one {END}"
    head, rest = text.split(START)
    body, tail = rest.split(END)
    return head + START, body, END + tail


def test_every_registry_model_has_a_model_type():
    unmapped = sorted(set(per_model(registry())) - set(MODELS))
    where = "tests/model/saelens_models.py"
    assert not unmapped, f"add these registry models, with their HF model_type, to {where}: {unmapped}"


def test_the_docs_hold_the_table_of_published_saes():
    releases = registry()
    assert not set(per_model(releases)) - set(MODELS), "test_every_registry_model_has_a_model_type names them"
    want = section(releases, supported_types())
    _, have, _ = split_doc(DOC.read_text())
    diff = "\n".join(difflib.unified_diff(have.splitlines(), want.splitlines(), "docs", "registry", lineterm=""))
    assert have == want, (
        f"docs/extracting.md's table of SAELens's published SAEs is not what the installed registry and harvest's "
        f"SUPPORTED give; regenerate it with `{REGENERATE}`:\n{diff}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Rewrite the SAELens table in docs/extracting.md in place.")
    parser.add_argument("--supported", help="comma-separated model_types instead of harvest's SUPPORTED")
    args = parser.parse_args()
    supported = tuple(args.supported.split(",")) if args.supported else supported_types()
    releases = registry()
    unmapped = sorted(set(per_model(releases)) - set(MODELS))
    if unmapped:
        raise SystemExit(f"add these registry models to tests/model/saelens_models.py first: {unmapped}")
    head, _, tail = split_doc(DOC.read_text())
    want = section(releases, supported)
    DOC.write_text(head + want + tail)
    print(f"{DOC}: {want.strip().splitlines()[-1]}")


if __name__ == "__main__":
    main()
