"""The fleet examples of the README and the docs pages: every YAML block parses, every fleet in them plans with
the real `harvest fleet plan`, and the plan output they show (`text` blocks) is what plan prints today.

The fleets plan as written: their buckets are fake-gcs-server's, holding what plan reads (the four-region
fleet's streams.json, made by `harvest streams create`; a TRM's dataset marker, absent here, so its build is
planned), so no URL is swapped and the printed tables compare as they are. The group
fragments ("A pod and a multi-node GPU group are groups too") plan as the groups of the first fleet.
"""

from __future__ import annotations

import contextlib
import json
import re
import urllib.error
from pathlib import Path

import pytest
import yaml
from readme_blocks import Block, blocks
from storage_servers import create_gcs_bucket

from harvest.cli import main
from harvest.data.streams import create_streams

NUM_STREAMS = 32  # the four-region fleet's (harvest streams create ... --num-streams 32)


def _fleets() -> list[Block]:
    """The YAML blocks that are whole fleets (train.yaml and the like are not)."""
    return [b for b in blocks("yaml") if isinstance(parsed := yaml.safe_load(b.text), dict) and "groups" in parsed]


def _fragments() -> list[Block]:
    """Groups shown on their own: a YAML list."""
    return [b for b in blocks("yaml") if isinstance(yaml.safe_load(b.text), list)]


def _bucket(server, name: str) -> None:
    with contextlib.suppress(urllib.error.HTTPError):  # made by an earlier test of the session
        create_gcs_bucket(server, name)


@pytest.fixture(scope="module")
def buckets(gcs_server, tmp_path_factory) -> None:
    """The buckets the examples' fleets name, in fake-gcs-server, and the streams plan reads there."""
    source = tmp_path_factory.mktemp("readme-fleet") / "tasks.jsonl"
    source.write_text("".join(json.dumps({"text": f"task {i}"}) + "\n" for i in range(2 * NUM_STREAMS)))
    urls = {url for b in _fleets() for url in re.findall(r"gs://[\w.-]+", b.text)}
    for url in urls:
        _bucket(gcs_server, url.removeprefix("gs://"))
    first = yaml.safe_load(_fleets()[0].text)
    create_streams(str(source), NUM_STREAMS, first["data"])


def plan(fleet: dict, path: Path, capsys) -> tuple[int, str, str]:
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    code = main(["fleet", "plan", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_yaml_block_parses():
    for block in blocks("yaml"):
        assert yaml.safe_load(block.text) is not None, block.where()


@pytest.mark.parametrize("block", _fleets(), ids=lambda b: b.where())
def test_every_fleet_plans(block, buckets, tmp_path, capsys):
    fleet = yaml.safe_load(block.text)
    assert "install" not in fleet and "image" not in fleet  # the examples' fleets carry the checkout
    code, out, err = plan(fleet, tmp_path / f"{fleet['name']}.yaml", capsys)
    assert code == 0, f"{block.where()}: {err}"
    assert out.startswith(f"fleet {fleet['name']}: ")


def test_the_group_fragments_plan_inside_the_first_fleet(buckets, tmp_path, capsys):
    (fragment,) = _fragments()
    fleet = {**yaml.safe_load(_fleets()[0].text), "groups": yaml.safe_load(fragment.text)}
    code, out, err = plan(fleet, tmp_path / "fleet.yaml", capsys)
    assert code == 0, f"{fragment.where()}: {err}"
    for text in ("tpu-v5litepod-64 (spot)", "16 x 4", "data=16,model=4", "H100:8 (spot)", "2 x 8", "data=2,model=8"):
        assert text in out, out
    unquoted = fragment.text.replace('mesh: "data=16,model=4"', "mesh: data=16,model=4")
    fleet["groups"] = yaml.safe_load(unquoted)
    code, out, err = plan(fleet, tmp_path / "fleet.yaml", capsys)
    assert code == 2 and err.strip().endswith(
        'groups[0]: unknown key model=4: a value with commas inside {...} needs quotes: mesh: "data=16,model=4"'), err


def _shown_plans() -> list[tuple[Block, str, str]]:
    """The `text` blocks of plan output: (block, the fleet file named, what plan printed)."""
    shown = []
    for block in blocks("text"):
        first, _, rest = block.text.partition("\n")
        if first.startswith("$ harvest fleet plan "):
            shown.append((block, first.split()[-1], rest))
        elif first.startswith("fleet "):  # the four-region fleet's, after "`harvest fleet plan fleet.yaml` prints:"
            shown.append((block, "fleet.yaml", block.text))
    return shown


def _named_fleets() -> dict[str, dict]:
    """The examples' fleets by the file name the line before each gives it ("... `decoder-fleet.yaml`:")."""
    named = {}
    for block in _fleets():
        found = re.findall(r"`([\w-]+\.yaml)`:$", block.path.read_text().splitlines()[block.line - 2])
        assert found, f"{block.where()}: the line before names no fleet file"
        assert found[0] not in named, f"{block.where()}: {found[0]} is shown twice"
        named[found[0]] = yaml.safe_load(block.text)
    return named


def test_the_plan_output_the_readme_shows_is_what_plan_prints(buckets, tmp_path, capsys):
    named = _named_fleets()
    shown = _shown_plans()
    assert len(shown) == 5, [b.where() for b, *_ in shown]
    for block, name, expected in shown:
        fleet = named.get(name)
        if name == "decoder-fleet-v4-32.yaml":  # "The same file on a v4-32 (16 chips) is refused"
            fleet = {**named["decoder-fleet.yaml"]}
            fleet["groups"] = [{**fleet["groups"][0], "accelerator": "tpu-v4-32"}]
        assert fleet is not None, f"{block.where()}: no fleet named {name}"
        code, out, err = plan(fleet, tmp_path / name, capsys)
        printed = out if code == 0 else err.replace(str(tmp_path / name), name)
        assert _lines(printed) == _lines(expected), f"{block.where()}:\n{printed}"


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]  # rich pads a title to the table's width
