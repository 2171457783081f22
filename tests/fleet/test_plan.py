"""`harvest fleet plan`: the users' four-region fleet (its streams in a GCS bucket, fake-gcs-server here)
planned worker by worker; the accelerator table against Google's documents; every refusal one line, local
paths included; job names of different fleets never meet; a GGUF URL is a model every worker reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from fleet_helpers import FOUR_REGIONS, RecordedJobs, edit_fleet, run_cli, write_fleet
from rich.console import Console

from harvest.fleet import launch, status
from harvest.fleet.plan import make_plan, task_config
from harvest.fleet.spec import FleetError, load_fleet
from harvest.fleet.topology import topology


@pytest.mark.parametrize("accelerator, nodes, hosts, chips, devices", [
    ("tpu-v5litepod-8", 1, 1, 8, 8), ("tpu-v5litepod-64", 1, 16, 64, 64), ("tpu-v5litepod-4", 1, 1, 4, 4),
    ("tpu-v6e-8", 1, 1, 8, 8), ("tpu-v6e-256", 1, 64, 256, 256), ("tpu-v4-8", 1, 1, 4, 4),
    ("tpu-v4-32", 1, 4, 16, 16), ("tpu-v4-64", 1, 8, 32, 32), ("tpu-v5p-8", 1, 1, 4, 4),
    ("tpu-v3-8", 1, 1, 4, 8), ("H100:8", 2, 2, 16, 16), ("A100-80GB:4", 1, 1, 4, 4), ("cpu", 2, 2, 2, 2),
])
def test_topology_table(accelerator, nodes, hosts, chips, devices):
    shape = topology(accelerator, nodes)
    assert (shape.hosts, shape.chips, shape.devices) == (hosts, chips, devices)


def test_plan_of_the_four_region_fleet(users_fleet, tmp_path, capsys):
    code, out, err = run_cli(capsys, "fleet", "plan", str(users_fleet), "--emit", str(tmp_path / "tasks"))
    assert code == 0, err
    plan = make_plan(load_fleet(users_fleet))
    assert len(plan.workers) == 32 and plan.num_streams == 32
    assert sorted(s for w in plan.workers for s in w.streams) == list(range(32))  # each stream once
    assert all(len(w.streams) == 1 for w in plan.workers)
    assert [w.streams[0] for w in plan.group_workers("us-east5-v6e")] == list(range(16, 24))  # auto, by chips
    assert [w.streams[0] for w in plan.group_workers("europe-west4-v6e")] == list(range(24, 32))
    for text in ("arc-qwen05", "us-central1-v5e", "tpu-v5litepod-8", "1 x 8", "data=8", "gs://activations-eu"):
        assert text in out
    assert "wrote 32 SkyPilot task files" in out
    assert len(list((tmp_path / "tasks").glob("*.yaml"))) == 32


@pytest.mark.parametrize("changes, message", [
    ({"g1_streams": "6-15"}, "group us-west4-v5e: streams 6-7 are also in group us-central1-v5e"),
    ({"g2_streams": "16-23", "g3_streams": "24-30"}, "streams 31 of 32 are in no group"),
    ({"g3_streams": "24-40"}, "group europe-west4-v6e: streams 24-40 reach past the data's 32 streams"),
    ({"g0_accelerator": "tpu-v4-32", "g0_mesh": "data=4,model=4,fsdp=2"},
     "group us-central1-v5e: mesh data=4,model=4,fsdp=2 does not fit tpu-v4-32 (4 hosts x 4 chips, 16 devices)"),
    ({"g0_accelerator": "tpu-v5e-8"}, "unknown accelerator 'tpu-v5e-8' (did you mean tpu-v5litepod-8?)"),
    ({"g0_accelerator": "tpu-v5litepod-12"}, "unknown accelerator 'tpu-v5litepod-12'"),
    ({"extract": {"model": "o/m", "layers": "12-23"}}, "extract: unknown setting 'layers'"),
    ({"extract": {"model": "o/m", "format": "arcx"}}, "extract: --format 'arcx': choose one of text, chat, arc"),
    ({"extract": {"model": "o/m", "max_seq_len": "long"}}, "extract: setting: max_seq_len must be int"),
    ({"extract": {"model": "o/m", "streams": "0-3"}}, "extract: streams is set per worker"),
    ({"extract": {"model": "o/m", "overwrite": True}}, "extract: overwrite is refused in a fleet"),
    ({"extract": {"format": "arc"}}, "extract: missing --model"),
    ({"g2_workers": 20}, "group us-east5-v6e: 20 workers but only 11 streams"),
    ({"g0_regions": []}, "group us-central1-v5e: regions must be a non-empty list"),
    ({"g0_colour": "red"}, "groups[0]: unknown key colour"),
    ({"image": "reg/harvest:1", "install": "pip install harvest-activations"}, "give at most one of install"),
    # the index's `harvest` is another project
    ({"install": "pip install 'harvest[tpu,gcs]==0.2.0'"},
     "install: 'harvest[tpu,gcs]==0.2.0' is the package index's harvest, an unrelated project; this one is "
     "harvest-activations"),
    ({"install": "pip install harvest"}, "install: 'harvest' is the package index's harvest"),
    ({"install": "uv pip install -U harvest"}, "install: 'harvest' is the package index's harvest"),
    # {..., mesh: data=4,model=2} in a flow mapping reads as mesh: data=4 and a key model=2
    ({"g0_mesh": "data=4", "g0_model=2": None},
     'groups[0]: unknown key model=2: a value with commas inside {...} needs quotes: mesh: "data=4,model=2"'),
    ({"name": "Arc_Qwen"}, "name 'Arc_Qwen': use lowercase letters"),
    ({"name": "arc--qwen"}, "name 'arc--qwen': use lowercase letters, digits and single dashes"),
    ({"g0_name": "5e"}, "groups[0].name '5e': use lowercase letters, digits and single dashes, starting with a letter"),
    # the workers are cloud VMs: they see buckets and the hub, not this machine's files
    ({"data": "/data/arc-streams"}, "data '/data/arc-streams' is not in object storage, and the fleet's workers"),
    ({"g1_out": "out/arc"}, "group us-west4-v5e: out 'out/arc' is not in object storage"),
    ({"extract": {"model": ".", "format": "arc"}}, "extract: model '.' is a path on this machine"),
    ({"extract": {"model": "hf://Qwen/Qwen2.5-0.5B"}}, "extract: model 'hf://Qwen/Qwen2.5-0.5B' is not a hub id"),
    ({"envs": {"HF_HOME": None}}, "envs: HF_HOME needs a value; list a secret's name under secrets"),
    ({"envs": {"HARVEST_WORKER_ID": "x"}}, "envs: HARVEST_WORKER_ID is set by the plan"),
    ({"secrets": ["hf-token"]}, "secrets: 'hf-token' is not an environment variable name"),
    ({"envs": {"HF_TOKEN": "x"}, "secrets": ["HF_TOKEN"]}, "secrets: HF_TOKEN given twice"),
])
def test_plan_refuses_with_one_line(tmp_path, streams32, capsys, changes, message):
    path = write_fleet(tmp_path / "fleet.yaml", edit_fleet({**FOUR_REGIONS, "data": streams32}, **changes))
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err and str(path) in err, err
    assert not (tmp_path / "tasks").exists()  # nothing written


def test_job_names_of_different_fleets_never_meet(tmp_path, streams32):
    """Fleet `a` with group `b-c` and fleet `a-b` with group `c` once both named their jobs `a-b-c-0`: `down`
    of one cancelled the other's. Now each fleet's `status`, `up` and `down` see only their own jobs."""
    def fleet(name: str, group: str) -> Path:
        groups = [{"name": group, "accelerator": "tpu-v5litepod-8", "regions": ["us-central1"], "workers": 2,
                   "streams": "auto", "out": f"{streams32}-out/{name}"}]
        return write_fleet(tmp_path / f"{name}.yaml", {**FOUR_REGIONS, "name": name, "data": streams32,
                                                       "groups": groups})
    a, ab = make_plan(load_fleet(fleet("a", "b-c"))), make_plan(load_fleet(fleet("a-b", "c")))
    names_a, names_ab = [w.job_name for w in a.workers], [w.job_name for w in ab.workers]
    assert names_a == ["a.b-c.0", "a.b-c.1"] and names_ab == ["a-b.c.0", "a-b.c.1"]
    jobs = RecordedJobs()
    launch.up(a, jobs)
    assert launch.up(ab, jobs)[0] == list(ab.workers)  # a's jobs are not taken for ab's
    assert [w.job_name for w in launch.down(a, jobs)] == names_a
    assert jobs.cancelled == names_a
    console = Console(record=True, width=200)
    status.show(ab, jobs, console=console)
    assert console.export_text().count("PENDING") == 2  # ab's own jobs, untouched


def test_a_gguf_url_is_a_model_every_worker_reads(tmp_path, streams32, wheel):
    """A llama.cpp checkpoint in the fleet's bucket (or behind https) reaches each worker's --model as given;
    a local .gguf is refused like any local path."""
    url = "gs://arc-us-central1/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    fleet = {**FOUR_REGIONS, "data": streams32, "extract": {**FOUR_REGIONS["extract"], "model": url}}
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    run = task_config(plan.workers[0], plan.spec, wheel)["run"]
    assert f"--model {url}" in run
    local = tmp_path / "m.gguf"
    local.write_bytes(b"GGUF")
    fleet["extract"]["model"] = str(local)
    with pytest.raises(FleetError, match="is a path on this machine"):
        load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet))
