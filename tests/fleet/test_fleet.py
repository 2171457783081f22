"""`harvest fleet`: the users' four-region fleet (its streams in a GCS bucket, fake-gcs-server here) planned
into SkyPilot tasks that SkyPilot itself loads; every refusal one line, local paths included; an image's
command forwards the environment by name and runs under an init; job names of different fleets never meet;
`up` idempotent and `status` joined with storage, through the one SkyPilot module fed recorded job records
(no cloud is reachable here); the accelerator table against Google's documents. Training jobs: a decoder and
a TRM on a v4-64 and SAEs on two GPU nodes plan into tasks SkyPilot loads whose command, on every host, takes
its process layout from SkyPilot's env; their refusals (mesh, batch, settings, workers, a missing dataset) one
line each; a TRM's puzzles build as its own task; a stale trainer seen from its metrics in a bucket."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_helpers import DECODER_POD, FOUR_REGIONS, SAE_GPUS, TRM_POD, RecordedJobs, built_wheel, record, write_fleet
from rich.console import Console
from storage_servers import create_gcs_bucket
from test_reader_verify import COUNTS, fake_run

from harvest.cli import build_parser, main
from harvest.data.streams import create_streams
from harvest.errors import UserError
from harvest.fleet import launch, status
from harvest.fleet.container import CREDENTIAL_ENV, RUNTIME_ENV, SKYPILOT_ENV
from harvest.fleet.plan import make_plan, task_config
from harvest.fleet.sky import skypilot_python
from harvest.fleet.spec import FleetError, load_fleet
from harvest.fleet.topology import topology
from harvest.store.verify import verify, verify_all


@pytest.fixture(scope="module")
def streams32(tmp_path_factory, gcs_server) -> str:
    """32 streams in a bucket, where a cloud fleet's data lives (plan reads their streams.json there)."""
    root = tmp_path_factory.mktemp("streams32")
    source = root / "tasks.jsonl"
    source.write_text("".join(json.dumps({"text": f"task {i}"}) + "\n" for i in range(64)))
    bucket = f"fleet-streams-{os.getpid()}"
    create_gcs_bucket(gcs_server, bucket)
    create_streams(str(source), 32, f"gs://{bucket}/arc-streams")
    return f"gs://{bucket}/arc-streams"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The checkout's wheel, which the fleets here (neither install nor image) carry."""
    return built_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def users_fleet(tmp_path, streams32) -> Path:
    return write_fleet(tmp_path / "fleet.yaml", {**FOUR_REGIONS, "data": streams32})


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """The real CLI in this process (plan needs no cloud): (exit code, stdout, stderr)."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# the plan ----------------------------------------------------------------------------------------------------

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


# Run in SkyPilot's own interpreter (it cannot share harvest's environment, see harvest.fleet.sky).
_LOAD_TASKS = r"""
import json, sys
import sky
out = []
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)
    out.append({"name": task.name, "num_nodes": task.num_nodes, "setup": task.setup, "run": task.run,
                "file_mounts": task.file_mounts,
                "envs": task.envs, "secrets": [ref.name for ref in task.managed_secret_refs], "resources": [
                    {"accelerators": r.accelerators, "use_spot": r.use_spot, "region": r.region,
                     "job_recovery": r.job_recovery} for r in task.resources]})
print(json.dumps(out))
"""


def _skypilot() -> str:
    try:
        return skypilot_python()
    except UserError as e:
        pytest.skip(f"SkyPilot not installed (`make test` installs it in .venv-sky): {e}")


def _load_tasks(paths: list) -> list[dict]:
    """Task files as SkyPilot's own parser reads them."""
    loaded = subprocess.run([_skypilot(), "-c", _LOAD_TASKS, *map(str, paths)], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    return json.loads(loaded.stdout.strip().splitlines()[-1])


def test_emitted_tasks_load_in_skypilot(users_fleet, tmp_path, capsys):
    _skypilot()
    assert main(["fleet", "plan", str(users_fleet), "--emit", str(tmp_path)]) == 0
    plan = make_plan(load_fleet(users_fleet))
    tasks = _load_tasks([tmp_path / f"{w.job_name}.yaml" for w in plan.workers])
    (wheel,) = tmp_path.glob("harvest_activations-*-py3-none-any.whl")  # the checkout, carried by every task
    parser = build_parser()
    for w, task in zip(plan.workers, tasks, strict=True):
        assert task["name"] == w.job_name == f"arc-qwen05.{w.group.name}.{w.index}"
        assert task["num_nodes"] == 1
        assert task["file_mounts"] == {f"~/.harvest/dist/{wheel.name}": str(wheel)}
        assert task["setup"] == f'pip install "$HOME/.harvest/dist/{wheel.name}[gcs,tpu]"'
        assert task["envs"] == {"HARVEST_FLEET": "arc-qwen05", "HARVEST_GROUP": w.group.name,
                                "HARVEST_WORKER_ID": f"arc-qwen05/{w.group.name}/{w.index}"}
        assert {r["region"] for r in task["resources"]} == set(w.group.regions)
        for resources in task["resources"]:
            assert resources["accelerators"] == {w.group.accelerator: 1}
            assert resources["use_spot"] is True
            assert resources["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
            assert resources["job_recovery"]["recover_on_exit_codes"] == [75]
            assert resources["job_recovery"]["max_restarts_on_errors"] >= 1
        # The run command is the real CLI's: it parses, and says what this worker writes.
        argv = shlex.split(task["run"])
        assert argv[:2] == ["harvest", "extract"]
        args = parser.parse_args(argv[1:])
        assert (args.model, args.format, args.points) == ("Qwen/Qwen2.5-0.5B", "arc", "resid_post:12-23")
        assert (args.data, args.out, args.worker_id) == (plan.spec.data, w.group.out, w.worker_id)
        assert args.streams == str(w.streams[0]) and args.mesh == w.group.mesh


def test_the_sdk_calls_of_harvest_fleet_exist_in_skypilot():
    """harvest.fleet.sky's calls, checked against the installed SkyPilot (no API server needed for that)."""
    try:
        python = skypilot_python()
    except UserError as e:
        pytest.skip(f"SkyPilot not installed (`make test` installs it in .venv-sky): {e}")
    probe = ("import inspect, sky, sky.jobs.constants\n"
             "assert 'fields' in inspect.signature(sky.jobs.queue_v2).parameters\n"
             "assert 'name' in inspect.signature(sky.jobs.launch).parameters\n"
             "assert 'name' in inspect.signature(sky.jobs.cancel).parameters\n"
             "assert callable(sky.Task.from_yaml_config) and callable(sky.get)\n"
             "assert 'job_name' in sky.jobs.constants.DEFAULT_MANAGED_JOB_FIELDS\n"
             "print(sky.__version__)\n")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "0.14.1", done.stderr[-2000:]


def test_multi_node_gpu_group_derives_process_flags_from_skypilot_env(tmp_path, streams32, wheel):
    """Each node runs the same command; the shell turns SkyPilot's env into --coordinator/--num-processes
    /--process-id (node 0 coordinates). A `harvest` on PATH that prints its argv shows what the CLI gets."""
    fleet = copy.deepcopy(FOUR_REGIONS)
    fleet["groups"] = [{"name": "gpu", "accelerator": "H100:8", "num_nodes": 2, "regions": ["us-east4"],
                        "workers": 1, "streams": "0-31", "out": "s3://acts/run", "mesh": "data=2,model=8"}]
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", {**fleet, "data": streams32})))
    task = task_config(plan.workers[0], plan.spec, wheel)
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "H100:8"
    assert task["setup"].endswith(f'{wheel.name}[cuda,gcs,s3]"')  # its GPUs' jax, the data's and out's storage
    for rank in (0, 1):
        env = {"SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9\n", "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "2"}
        args = build_parser().parse_args(_run_as_host(task, "harvest", tmp_path, env))
        assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.7:8476", 2, rank)
        assert args.streams == "0-31" and args.mesh == "data=2,model=8"


def _edit(fleet: dict, **changes) -> dict:
    edited = copy.deepcopy(fleet)
    for key, value in changes.items():
        if key.startswith("g"):  # g0_streams=... edits groups[0].streams
            index, field = key[1:].split("_", 1)
            edited["groups"][int(index)][field] = value
        else:
            edited[key] = value
    return edited


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
    path = write_fleet(tmp_path / "fleet.yaml", _edit({**FOUR_REGIONS, "data": streams32}, **changes))
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err and str(path) in err, err
    assert not (tmp_path / "tasks").exists()  # nothing written


def _image_fleet(streams32: str, **top) -> dict:
    """The four-region fleet from an image, its first group on H100s (SkyPilot runs those in the image)."""
    fleet = {**_edit(FOUR_REGIONS, g0_accelerator="H100:8", g0_mesh=None), "data": streams32, **top}
    fleet["image"] = "registry.example/harvest:0.2.0"
    return fleet


def test_image_instead_of_install(tmp_path, streams32):
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", _image_fleet(streams32))))
    gpu, tpu = task_config(plan.workers[0], plan.spec), task_config(plan.workers[8], plan.spec)
    assert gpu["resources"]["image_id"] == "docker:registry.example/harvest:0.2.0" and "setup" not in gpu
    assert gpu["run"].startswith("harvest extract ")
    assert tpu["setup"] == "docker pull registry.example/harvest:0.2.0"
    assert tpu["run"].startswith("docker run --rm --init ")


def test_image_command_forwards_the_environment_by_name_and_runs_under_an_init(tmp_path, streams32):
    """A TPU host runs the container itself: the emitted command (as SkyPilot loads it) passes every variable a
    worker needs by name only, so docker copies the host's values and no value is in the task file; the
    credentials file is mounted read-only; `--init` makes SIGTERM (a cancel, a preemption) reach harvest."""
    fleet = _image_fleet(streams32, envs={"HARVEST_CACHE": "/var/cache/harvest", "XLA_PYTHON_CLIENT_MEM_FRACTION": .9},
                         secrets=["WANDB_API_KEY"])
    path = write_fleet(tmp_path / "fleet.yaml", fleet)
    assert main(["fleet", "plan", str(path), "--emit", str(tmp_path / "tasks")]) == 0
    plan = make_plan(load_fleet(path))
    worker = plan.workers[8]  # us-west4-v5e/0, a TPU
    text = (tmp_path / "tasks" / f"{worker.job_name}.yaml").read_text()
    task = _load_tasks([tmp_path / "tasks" / f"{worker.job_name}.yaml"])[0]
    assert task["envs"] == {"HARVEST_FLEET": "arc-qwen05", "HARVEST_GROUP": "us-west4-v5e",
                            "HARVEST_WORKER_ID": "arc-qwen05/us-west4-v5e/0", "HARVEST_CACHE": "/var/cache/harvest",
                            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
    assert task["secrets"] == ["WANDB_API_KEY"] and "WANDB_API_KEY: null" in text  # its value: `fleet up`'s

    # The host as SkyPilot leaves it: its own variables, credentials, the task's envs and secrets.
    creds = tmp_path / "key dir" / "sa.json"
    creds.parent.mkdir()
    creds.write_text("{}")
    secret_values = {"AWS_SECRET_ACCESS_KEY": "aws-s3cr3t", "HF_TOKEN": "hf_s3cr3t", "WANDB_API_KEY": "wandb-s3cr3t"}
    host = {**task["envs"], **secret_values, "AWS_ACCESS_KEY_ID": "AKIA", "GOOGLE_APPLICATION_CREDENTIALS": str(creds),
            "STORAGE_EMULATOR_HOST": "http://10.0.0.2:4443", "SKYPILOT_NODE_RANK": "0",
            "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9", "SKYPILOT_NUM_NODES": "1", "TPU_WORKER_ID": "0"}
    argv = _run_as_host(task, "docker", tmp_path, host)
    assert argv[:3] == ["run", "--rm", "--init"]
    forwarded = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    for name in [*SKYPILOT_ENV, *RUNTIME_ENV, *CREDENTIAL_ENV, *task["envs"], "WANDB_API_KEY"]:
        assert name in forwarded, name
    assert not [a for a in forwarded if "=" in a]  # names only: docker takes each value from the host
    for value in secret_values.values():
        assert value not in " ".join(argv) and value not in text
    mount = argv[argv.index("--mount") + 1]
    assert mount == f"type=bind,src={creds},dst={creds},readonly"
    image = argv.index("registry.example/harvest:0.2.0")
    args = build_parser().parse_args(argv[image + 1:])  # the rest is harvest's own command line
    assert (args.command, args.streams, args.worker_id) == ("extract", "8", "arc-qwen05/us-west4-v5e/0")
    # With nothing set on the host, nothing is mounted and the command still parses.
    assert "--mount" not in _run_as_host(task, "docker", tmp_path, {})


def test_shared_paths_allow_local_data_out_and_model_and_mount_them_in_the_container(tmp_path, streams32):
    """Workers that see this machine's paths (one machine, a filesystem every VM mounts): local paths are
    taken, made absolute, and a container gets them at the same place (out writable, the rest read-only)."""
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    fleet = _image_fleet(streams32, shared_paths=True)
    fleet["extract"] = {**fleet["extract"], "model": str(checkpoint)}
    fleet["groups"][1]["out"] = str(tmp_path / "out")
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    run = task_config(plan.workers[8], plan.spec)["run"]
    assert f"--volume {checkpoint}:{checkpoint}:ro" in run and f"--volume {tmp_path}/out:{tmp_path}/out " in run
    assert streams32 not in run.split("registry.example")[0]  # a bucket needs no mount


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


def test_up_passes_the_fleets_secrets_from_its_environment_and_refuses_without_them(tmp_path, streams32, wheel,
                                                                                     monkeypatch):
    path = write_fleet(tmp_path / "fleet.yaml", {**FOUR_REGIONS, "data": streams32, "secrets": ["HF_TOKEN"]})
    plan = make_plan(load_fleet(path))
    jobs = RecordedJobs()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(UserError, match=r"secrets: HF_TOKEN not set in this environment; export it") as e:
        launch.up(plan, jobs)
    assert str(path) in str(e.value) and jobs.launched == []  # nothing launched
    monkeypatch.setenv("HF_TOKEN", "hf_s3cr3t")
    launched, _ = launch.up(plan, jobs)
    assert len(launched) == 32 and all(t["secrets"] == {"HF_TOKEN": "hf_s3cr3t"} for t in jobs.tasks)
    assert task_config(plan.workers[0], plan.spec, wheel)["secrets"] == {"HF_TOKEN": None}  # what plan writes


# up, down and status through recorded job records -------------------------------------------------------------

def test_up_twice_launches_each_worker_once(users_fleet):
    plan = make_plan(load_fleet(users_fleet))
    jobs = RecordedJobs()
    launched, kept = launch.up(plan, jobs)
    assert len(launched) == 32 and not kept
    assert launch.up(plan, jobs) == ([], list(plan.workers))
    assert sorted(jobs.launched) == sorted(w.job_name for w in plan.workers)


def test_up_relaunches_only_failed_or_cancelled_workers_and_down_cancels_active_ones(users_fleet):
    plan = make_plan(load_fleet(users_fleet))
    names = [w.job_name for w in plan.workers]
    states = ["RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED", "PENDING", "STARTING"]
    jobs = RecordedJobs([*(record(i + 1, name, states[i % len(states)]) for i, name in enumerate(names)),
                         record(100, names[0], "FAILED")])  # the newest record of names[0] says FAILED
    launched, _ = launch.up(plan, jobs)
    expected = {n for i, n in enumerate(names) if states[i % len(states)] in ("FAILED", "CANCELLED")} | {names[0]}
    assert {w.job_name for w in launched} == expected
    cancelled = launch.down(plan, jobs)
    assert {w.job_name for w in cancelled} == {n for i, n in enumerate(names)
                                              if states[i % len(states)] not in ("SUCCEEDED",)}
    assert launch.down(plan, jobs) == []


def test_status_before_any_output_shows_every_worker_pending(tmp_path, streams32):
    fleet = copy.deepcopy(FOUR_REGIONS)
    for g in fleet["groups"]:
        g["out"] = str(tmp_path / g["name"])  # nothing there yet; workers on this machine see it
    fleet = {**fleet, "data": streams32, "shared_paths": True}
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    jobs = RecordedJobs([record(1, plan.workers[0].job_name, "RECOVERING", recoveries=2)])
    console = Console(record=True, width=200)
    assert status.show(plan, jobs, console=console) == 0
    text = console.export_text()
    assert "arc-qwen05/us-central1-v5e/0" in text and "RECOVERING" in text and "not launched" in text
    assert "0/32 streams done" in text and "workers 1 recovering, 31 not launched" in text


def test_verify_takes_a_fleets_outputs_as_one_run(tmp_path):
    """Outputs with one run.json config and the streams split between them are one run: each stream must be
    in exactly one of them (copies of the whole run are still verified one by one)."""
    whole = fake_run(tmp_path, "whole")
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(whole.url, a)
    shutil.copytree(whole.url, b)
    assert [r.ok for r in verify_all([str(a), str(b)])] == [True, True]  # two full copies: two runs
    shutil.rmtree(b / "stream_00000")
    for s in range(1, len(COUNTS)):
        shutil.rmtree(a / f"stream_{s:05d}")
    reports = verify_all([str(a), str(b)])
    assert [r.ok for r in reports] == [True, True, True], [r.problems for r in reports]
    assert reports[-1].summary.startswith(f"OK {a} + {b}: {len(COUNTS)} streams")
    assert reports[-1].records == verify(whole.url).records
    shutil.copytree(a / "stream_00000", b / "stream_00000")
    shutil.rmtree(b / "stream_00001")
    reports = verify_all([str(a), str(b)])
    assert reports[-1].problems == [
        f"stream_00000/: written in 2 outputs ({a}, {b}); a stream belongs to exactly one worker"]
    assert reports[-1].unfinished == ["stream_00001/: in none of the 2 outputs (never started)"]


# training jobs: a decoder and a TRM on a v4-64, SAEs on two GPU nodes -------------------------------------------

@pytest.fixture(scope="module")
def puzzles_bucket(gcs_server) -> str:
    """A bucket holding a small sudoku dataset (the TRM fleet's data), and nothing at .../missing."""
    from harvest.puzzles.build import build_puzzles
    from harvest.puzzles.config import PuzzlesConfig

    bucket = f"fleet-puzzles-{os.getpid()}"
    create_gcs_bucket(gcs_server, bucket)
    build_puzzles("sudoku", PuzzlesConfig(out=f"gs://{bucket}/sudoku4", generate=20, size=4, augment=1,
                                          test_size=5))
    return f"gs://{bucket}"


def _run_as_host(task: dict, command: str, tmp_path: Path, env: dict) -> list[str]:
    """The task's run command on one host as SkyPilot runs it (`env`: its variables there), through a `command`
    (harvest, docker) on PATH that prints the arguments it got; returns them."""
    shim = tmp_path / "bin" / command
    if not shim.exists():
        shim.parent.mkdir(exist_ok=True)
        shim.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        shim.chmod(0o755)
    done = subprocess.run(["bash", "-c", task["run"]], env={"PATH": f"{shim.parent}:/usr/bin:/bin", **env},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _per_host(task: dict, hosts: int, tmp_path: Path) -> list:
    """The task's run command on each host as SkyPilot runs it (its env per rank), each harvest argv parsed by
    harvest's own CLI parser."""
    ips = "".join(f"10.0.0.{i + 1}\n" for i in range(hosts))
    return [build_parser().parse_args(_run_as_host(task, "harvest", tmp_path, {
        "SKYPILOT_NODE_IPS": ips, "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(hosts)}))
        for rank in range(hosts)]


def _training_fleets(puzzles_bucket: str) -> dict[str, dict]:
    return {"decoder": DECODER_POD, "trm": {**TRM_POD, "data": f"{puzzles_bucket}/sudoku4"}, "sae": SAE_GPUS}


@pytest.fixture(scope="module")
def training_tasks(puzzles_bucket, tmp_path_factory) -> dict[str, tuple]:
    """Each training fleet planned by the CLI (its printed table) into a task file, all loaded by SkyPilot's
    parser in one call (its import takes seconds)."""
    planned = {}
    for kind, fleet in _training_fleets(puzzles_bucket).items():
        root = tmp_path_factory.mktemp(f"fleet-{kind}")
        path = write_fleet(root / "fleet.yaml", fleet)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["fleet", "plan", str(path), "--emit", str(root / "tasks")]) == 0
        plan = make_plan(load_fleet(path))
        planned[kind] = (fleet, plan, printed.getvalue(), root / "tasks" / f"{plan.workers[0].job_name}.yaml")
    loaded = _load_tasks([task for *_, task in planned.values()])
    return {kind: (*planned[kind][:3], task) for kind, task in zip(planned, loaded, strict=True)}


@pytest.mark.parametrize("kind, accelerator, nodes, hosts", [
    ("decoder", {"tpu-v4-64": 1}, 1, 8), ("trm", {"tpu-v4-64": 1}, 1, 8), ("sae", {"H100": 8}, 2, 2)])
def test_training_fleets_emit_tasks_skypilot_loads_that_run_one_process_per_host(
        kind, accelerator, nodes, hosts, training_tasks, tmp_path):
    """Each kind of training job on its group: one task SkyPilot's parser loads (accelerator, node count,
    recovery in the next region and on exit 75), whose command on every host is the real CLI's, with the
    coordinator (rank 0's IP), the process count and this host's rank from SkyPilot's env, and settings that
    the command's own validation accepts."""
    from harvest.fleet.jobs import config_class
    from harvest.train.job import train_config

    fleet, plan, out, task = training_tasks[kind]
    assert "wrote 1 SkyPilot task files" in out
    (worker,) = plan.workers
    assert worker.topology.hosts == hosts
    assert task["name"] == f"{fleet['name']}.{fleet['groups'][0]['name']}.0"
    assert task["num_nodes"] == nodes
    for resources in task["resources"]:
        assert resources["accelerators"] == accelerator
        assert resources["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
        assert resources["job_recovery"]["recover_on_exit_codes"] == [75]
    assert {r["region"] for r in task["resources"]} == set(fleet["groups"][0]["regions"])
    per_host = _per_host(task, hosts, tmp_path)
    prefix = "sae_" if kind == "sae" else ""  # `harvest sae`'s parser keeps its settings apart with a prefix
    for rank, args in enumerate(per_host):
        process = [getattr(args, prefix + name) for name in ("coordinator", "num_processes", "process_id")]
        assert process == ["10.0.0.1:8476", hosts, rank]
    args = per_host[0]
    if kind == "sae":
        assert (args.command, args.action) == ("sae", "train")
        assert args.sae_run == fleet["data"] and args.sae_out == fleet["groups"][0]["out"]
        assert args.sae_mesh == "data=2,model=8" and args.sae_tensors == "resid_post.12,resid_post.18"
        return
    assert args.command == "train" and args.out == fleet["groups"][0]["out"] and args.data == plan.spec.data
    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class(plan.spec))}
    cfg = train_config(None, {k: v for k, v in flags.items() if v is not None})  # as `harvest train` reads it
    for key, value in fleet["train"].items():
        assert getattr(cfg, key) == value
    if kind == "decoder":
        for text in ("decoder training on tpu-v4-64", "8 x 4", "32", "data=4,fsdp=2,model=4",
                     "256 rows, 32 per data slot"):
            assert text in out
    else:
        assert "TRM training on tpu-v4-64" in out and "768 examples, 24 per data slot" in out


_TRM_REFUSALS = [
    ({"groups": [{**DECODER_POD["groups"][0], "accelerator": "tpu-v4-32"}]},
     "group v4-pod: mesh data=4,model=4,fsdp=2 does not fit tpu-v4-32 (4 hosts x 4 chips, 16 devices): --mesh "
     "data=4,model=4,fsdp=2: data=4 x fsdp=2 x model=4 = 32 devices, but there are 16"),
    ({"train": {**DECODER_POD["train"], "batch_size": 100}},
     "batch_size 100 / grad_accum 1 = 100 does not split over the mesh's 8 data slots"),
    ({"train": {**DECODER_POD["train"], "batch_size": 256, "grad_accum": 64}},
     "batch_size 256 / grad_accum 64 = 4 does not split over the mesh's 8 data slots"),
    ({"train": {**DECODER_POD["train"], "lr": "fast"}}, "train: setting: lr must be float"),
    ({"train": {**DECODER_POD["train"], "shape": {"model_type": "qwen2"}}}, "train: give exactly one of --model"),
    ({"train": {**DECODER_POD["train"], "schedule": "step"}}, "train: --schedule 'step': choose one of"),
    ({"train": {**DECODER_POD["train"], "out": "gs://x/y"}}, "train: out is set per worker from the group's out"),
    ({"train": {**DECODER_POD["train"], "points": "resid_post:3"}}, "train: unknown setting 'points'"),
    ({"groups": [{**DECODER_POD["groups"][0], "workers": 2}]}, "group v4-pod: workers 2: a train: job runs on one"),
    ({"groups": [DECODER_POD["groups"][0], {**DECODER_POD["groups"][0], "name": "other"}]},
     "a train: job runs on one group (one pod slice or GPU group), got 2: v4-pod, other"),
    ({"extract": {"model": "o/m"}}, "give exactly one job section, extract, train, sae (its settings), got extract, "
                                    "train"),
    ({"puzzles": {"kind": "sudoku", "generate": 10}}, "puzzles: builds a TRM's dataset, but train: model is a "
                                                      "decoder"),
    ({"train": {"model": "./weights"}}, "train: model './weights' is not a hub id"),
]


@pytest.mark.parametrize("changes, message", _TRM_REFUSALS)
def test_training_plan_refuses_with_one_line(tmp_path, capsys, changes, message):
    path = write_fleet(tmp_path / "fleet.yaml", {**DECODER_POD, **changes})
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err and str(path) in err, err
    assert not (tmp_path / "tasks").exists()


@pytest.mark.parametrize("changes, message", [
    ({"data": "{bucket}/missing"}, "data gs://fleet-puzzles-{pid}/missing holds no puzzle dataset (dataset.json is "
                                   "missing): build it first"),
    ({"train": {**TRM_POD["train"], "seq_len": 81}}, "train: --seq-len: not a TRM setting"),
    ({"train": {**TRM_POD["train"], "mesh": "data=16,model=2"}}, "mesh data=16,model=2: a TRM is replicated"),
    ({"train": {**TRM_POD["train"], "batch_size": 100}}, "batch_size = 100 does not split over the mesh's 32 data "
                                                          "slots"),
    ({"train": {**TRM_POD["train"], "model": {"type": "trm", "preset": "trm-kakuro"}}}, "unknown TRM preset"),
    ({"puzzles": {"kind": "kakuro"}}, "puzzles: kind 'kakuro': choose one of sudoku, maze, arc"),
    ({"puzzles": {"kind": "sudoku"}}, "puzzles: puzzles build sudoku: give --train CSV (and --test CSV) or --generate"),
    ({"puzzles": {"kind": "sudoku", "generate": 10, "overwrite": True}}, "puzzles: overwrite is set by the plan"),
    ({"puzzles": {"kind": "sudoku", "generate": 10, "colour": 3}}, "puzzles: unknown setting 'colour'"),
])
def test_trm_plan_refuses_with_one_line(tmp_path, capsys, puzzles_bucket, changes, message):
    fleet = {**TRM_POD, "data": f"{puzzles_bucket}/sudoku4", **changes}
    fleet["data"] = fleet["data"].format(bucket=puzzles_bucket)
    path = write_fleet(tmp_path / "fleet.yaml", fleet)
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message.format(pid=os.getpid()) in err and str(path) in err, err
    assert not (tmp_path / "tasks").exists()


def test_sae_plan_refuses_a_batch_that_does_not_split_puzzles_and_a_follow_over_hosts(tmp_path, capsys):
    for changes, message in (
            ({"sae": {**SAE_GPUS["sae"], "batch_tokens": 8190}}, "batch_tokens 8190 / 2 runs = 4095 does not split "
                                                                 "over the mesh's 2 data slots"),
            ({"puzzles": {"kind": "maze"}}, "puzzles: builds a TRM's dataset; it goes with a train: job, not sae:"),
            ({"sae": {**SAE_GPUS["sae"], "follow": True}}, "sae: follow reads a run still being written with one "
                                                           "process, and H100:8 runs 2 hosts")):
        path = write_fleet(tmp_path / "fleet.yaml", {**SAE_GPUS, **changes})
        code, out, err = run_cli(capsys, "fleet", "plan", str(path))
        assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_trm_fleet_with_puzzles_plans_the_build_first_as_its_own_cpu_task(tmp_path, capsys, puzzles_bucket):
    """With `puzzles:`, a missing dataset is planned as one build job (a CPU task SkyPilot loads, the real
    `harvest puzzles build` command writing to the fleet's data); a dataset already there is left alone."""
    fleet = {**TRM_POD, "data": f"{puzzles_bucket}/sudoku6",
             "puzzles": {"kind": "sudoku", "generate": 100, "size": 6, "augment": 2}}
    path = write_fleet(tmp_path / "fleet.yaml", fleet)
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 0, err
    assert "trm-sudoku.puzzles" in out and "puzzles build sudoku (once, first)" in out
    assert "wrote 2 SkyPilot task files" in out
    build, trainer = _load_tasks([tmp_path / "tasks" / "trm-sudoku.puzzles.yaml",
                                  tmp_path / "tasks" / "trm-sudoku.v4-pod.0.yaml"])
    assert build["num_nodes"] == 1 and all(r["accelerators"] is None for r in build["resources"])
    assert {r["region"] for r in build["resources"]} == {"us-central2", "us-east1"}
    assert all(r["job_recovery"]["recover_on_exit_codes"] == [75] for r in build["resources"])
    args = build_parser().parse_args(shlex.split(build["run"])[1:])
    assert (args.command, args.kind, args.out, args.generate, args.size, args.augment) == \
        ("puzzles", "sudoku", f"{puzzles_bucket}/sudoku6", 100, 6, 2)
    assert trainer["resources"][0]["accelerators"] == {"tpu-v4-64": 1}
    present = write_fleet(tmp_path / "present.yaml", {**fleet, "data": f"{puzzles_bucket}/sudoku4"})
    code, out, err = run_cli(capsys, "fleet", "plan", str(present))
    assert code == 0 and "(done: dataset present)" in out, err


def test_a_training_job_in_an_image_on_a_tpu_slice_passes_each_hosts_rank_into_the_container(tmp_path,
                                                                                             puzzles_bucket):
    """With an image, a TPU host starts the container itself: the process flags, expanded by the host's shell
    from SkyPilot's env, reach harvest inside it (a `docker` on PATH prints what it was given)."""
    fleet = {**TRM_POD, "data": f"{puzzles_bucket}/sudoku4", "image": "registry.example/harvest:0.2.0"}
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    task = task_config(plan.workers[0], plan.spec)
    assert task["setup"] == "docker pull registry.example/harvest:0.2.0" and task["run"].startswith("docker run ")
    for rank in (0, 7):
        env = {"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n", "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "8"}
        argv = _run_as_host(task, "docker", tmp_path, env)
        harvest_args = argv[argv.index("registry.example/harvest:0.2.0") + 1:]
        args = build_parser().parse_args(harvest_args)
        assert (args.command, args.coordinator, args.num_processes, args.process_id) == \
            ("train", "10.0.0.5:8476", 8, rank)


def test_status_of_a_running_trainer_that_stopped_logging_is_stale(tmp_path, gcs_server):
    """The trainer's own metrics writer (harvest.train.runlog.MetricsFile) in a bucket: a RUNNING job whose
    newest record is older than the stale limit makes `fleet status` say so and exit 1; a fresh one exits 0."""
    import time

    from harvest.fleet.progress import STALE_AFTER_S
    from harvest.storage import Storage
    from harvest.train.runlog import MetricsFile

    bucket = f"fleet-train-{os.getpid()}"
    create_gcs_bucket(gcs_server, bucket)
    fleet = {**DECODER_POD, "groups": [{**DECODER_POD["groups"][0], "out": f"gs://{bucket}/qwen"}]}
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    jobs = RecordedJobs([record(1, plan.workers[0].job_name, "RUNNING", recoveries=1, region="us-central2")])
    metrics = MetricsFile(Storage(f"gs://{bucket}/qwen"), 0)
    for step, age in ((10, STALE_AFTER_S + 600), (20, STALE_AFTER_S + 60)):
        metrics.append({"step": step, "loss": 3.25 - step / 100, "tokens_per_s": 51_234.0, "time": time.time() - age})
    console = Console(record=True, width=200)
    assert status.show(plan, jobs, console=console) == 1
    text = console.export_text()
    row = next(line for line in text.splitlines() if "qwen-pretrain.v4-pod.0" in line)
    for cell in ("running", "RUNNING", "us-central2", "20/20000", "3.05", "51.2K", "31m ago STALE"):
        assert cell in row, text
    assert "stale: qwen-pretrain.v4-pod.0 is running but has logged no metrics" in text
    metrics.append({"step": 30, "loss": 2.95, "tokens_per_s": 50_000.0, "time": time.time()})
    assert status.show(plan, jobs, console=Console(record=True, width=200)) == 0


def test_up_and_down_of_a_training_fleet_launch_and_cancel_its_one_job(tmp_path, puzzles_bucket, wheel):
    """`up` launches the slice's one job (its task as plan writes it), a second `up` none; a recovered job is
    left alone; `down` cancels it and a running puzzles build."""
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", DECODER_POD)))
    jobs = RecordedJobs()
    launched, kept = launch.up(plan, jobs)
    assert [w.job_name for w in launched] == ["qwen-pretrain.v4-pod.0"] and not kept
    # as plan writes it, with the wheel `up` built (and SkyPilot uploaded) in a directory of its own
    (task,) = jobs.tasks
    (source,) = task["file_mounts"].values()
    assert list(task["file_mounts"]) == [f"~/.harvest/dist/{wheel.name}"] and not Path(source).exists()
    assert {**task, "file_mounts": None} == {**task_config(plan.workers[0], plan.spec, wheel), "file_mounts": None}
    assert "--process-id \"$SKYPILOT_NODE_RANK\"" in jobs.tasks[0]["run"]
    jobs.records[-1]["status"] = "RECOVERING"
    assert launch.up(plan, jobs) == ([], list(plan.workers))
    assert [w.job_name for w in launch.down(plan, jobs)] == ["qwen-pretrain.v4-pod.0"]
    fleet = {**TRM_POD, "data": f"{puzzles_bucket}/not-yet", "puzzles": {"kind": "sudoku", "generate": 10}}
    trm = make_plan(load_fleet(write_fleet(tmp_path / "trm.yaml", fleet)))
    jobs = RecordedJobs([record(1, "trm-sudoku.puzzles", "RUNNING")])
    assert launch.down(trm, jobs) == [] and jobs.cancelled == ["trm-sudoku.puzzles"]


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


# status before, during and after a launch ------------------------------------------------------------------------

@pytest.fixture
def half_done_fleet(tmp_path) -> Path:
    """8 streams on this machine; group a's two (0, 1) are complete in storage, group b's six not started."""
    source = tmp_path / "records.jsonl"
    source.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(sum(COUNTS) * 4)))
    create_streams(str(source), 8, str(tmp_path / "streams"))
    done = fake_run(tmp_path, "a-out")
    return write_fleet(tmp_path / "fleet.yaml", {
        "name": "st", "data": str(tmp_path / "streams"), "shared_paths": True,
        "extract": {"model": "Qwen/Qwen2.5-0.5B"},
        "groups": [{"name": "a", "accelerator": "cpu", "regions": ["r1"], "workers": 2, "streams": "0-1",
                    "out": done.url},
                   {"name": "b", "accelerator": "cpu", "regions": ["r2"], "workers": 6, "streams": "2-7",
                    "out": str(tmp_path / "b-out")}]})


def _rows(text: str) -> dict[str, list[str]]:
    """The status table's cells by worker id."""
    return {cells[0]: cells for line in text.splitlines()
            if (cells := [c.strip() for c in line.strip("│ ").split("│")])[0].startswith("st/")}


def test_status_is_one_table_of_every_worker_in_every_state_with_its_storage_progress(half_done_fleet):
    plan = make_plan(load_fleet(half_done_fleet))
    jobs = RecordedJobs([record(1, "st.a.0", "SUCCEEDED"), record(2, "st.b.0", "PENDING"),
                         record(3, "st.b.1", "STARTING"), record(4, "st.b.2", "RUNNING"),
                         record(5, "st.b.3", "RECOVERING", recoveries=2), record(6, "st.b.4", "FAILED_SETUP"),
                         record(7, "st.b.5", "CANCELLED")])
    console = Console(record=True, width=220)
    assert status.show(plan, jobs, console=console) == 0
    text = console.export_text()
    assert text.count("fleet st: 8 workers") == 1 and text.count("┏") == 1, text  # one table
    rows = _rows(text)
    states = {wid: cells[3] for wid, cells in rows.items()}
    assert states == {"st/a/0": "done", "st/a/1": "not launched", "st/b/0": "pending", "st/b/1": "pending",
                      "st/b/2": "running", "st/b/3": "recovering", "st/b/4": "failed", "st/b/5": "cancelled"}, text
    assert rows["st/b/4"][4] == "FAILED_SETUP" and rows["st/b/3"][5] == "2" and rows["st/a/1"][4] == "-"
    assert rows["st/a/1"][7] == "1/1" and rows["st/b/0"][7] == "0/1"  # storage's word, launched or not
    assert "2/8 streams done" in text
    assert "workers 1 done, 1 not launched, 2 pending, 1 running, 1 recovering, 1 failed, 1 cancelled" in text


@pytest.mark.parametrize("python, error", [
    (sys.executable, "No module named 'sky'"),  # any failing SDK call
    ("/nonexistent/python", "cannot run /nonexistent/python"),
])
def test_status_when_skypilot_cannot_be_asked_shows_storage_and_its_error_in_one_line(half_done_fleet, capfd,
                                                                                       monkeypatch, python, error):
    """The table still comes from storage, every job state is unknown, SkyPilot's error is the one line under
    it, and the exit code 2."""
    monkeypatch.setenv("HARVEST_SKYPILOT_PYTHON", python)
    code = main(["fleet", "status", str(half_done_fleet)])
    out = capfd.readouterr().out
    assert code == 2
    rows = _rows(out)
    assert {cells[3] for cells in rows.values()} == {"unknown"} and len(rows) == 8, out
    assert rows["st/a/0"][7] == "1/1"
    (line,) = [line for line in out.splitlines() if "SkyPilot" in line]
    assert line.startswith("job states unknown: SkyPilot queue failed") and error in line, line


def _skypilot_env(home: Path) -> dict[str, str]:
    """SkyPilot with its own ~/.sky and a local API server on ports free now. Its default, 46580, lies in Linux's
    ephemeral range (32768-60999), where the suite's own loopback connections can hold it ("Port 46580 is not
    available", seen in a fresh-clone run), and so does the request-queue port it derives from the server's
    (sky.server.requests.queues.mp_queue: 50011 shifted by the server port's offset from 46580, within
    [50000, 60000): "port 53622 is already in use", seen in another). So the server's port is taken below that
    range, and one whose queue port is free too."""
    for port in random.Random().sample(range(20000, 32000), 400):
        queue = 50000 + (50011 - 50000 + port - 46580) % 10000
        if _port_free(port) and _port_free(queue):
            return {**os.environ, "HOME": str(home), "SKYPILOT_API_SERVER_LOCAL_PORT": str(port)}
    raise AssertionError("no free pair of ports for a SkyPilot API server and its request queue")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _skypilot_server_up(python: str, env: dict[str, str]) -> bool:
    probe = ("from sky.server import common\n"
             "print(common.get_api_server_status().status == common.ApiServerStatus.HEALTHY)\n")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.slow
def test_status_before_any_launch_with_the_real_skypilot_stops_the_api_server_it_started(half_done_fleet, tmp_path):
    """The real SDK (no cloud account, a fresh ~/.sky): before any managed job there is no jobs controller and
    its queue raises ClusterDoesNotExist. `fleet status` shows every worker not launched with storage's
    progress, exits 0, and stops the local API server its call started (~10 processes otherwise left)."""
    python = _skypilot()
    home = tmp_path / "home"
    home.mkdir()
    env = {**_skypilot_env(home), "HARVEST_SKYPILOT_PYTHON": python}
    if _skypilot_server_up(python, env):
        pytest.skip("a SkyPilot API server already answers on the port chosen; this test must start its own")
    done = subprocess.run([str(Path(sys.executable).parent / "harvest"), "fleet", "status", str(half_done_fleet)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert {cells[3] for cells in rows.values()} == {"not launched"} and len(rows) == 8, done.stdout
    assert rows["st/a/0"][7] == "1/1" and "2/8 streams done" in done.stdout
    assert "ClusterDoesNotExist" not in done.stdout + done.stderr
    assert "stopped the SkyPilot API server this command started" in done.stderr, done.stderr
    assert not _skypilot_server_up(python, env)
