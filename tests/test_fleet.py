"""`harvest fleet`: the users' four-region fleet planned into SkyPilot tasks that SkyPilot itself loads; every
refusal one line; `up` idempotent and `status` joined with storage, through the one SkyPilot module fed
recorded job records (no cloud is reachable here); the accelerator table against Google's documents."""

from __future__ import annotations

import copy
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_helpers import FOUR_REGIONS, RecordedJobs, record, write_fleet
from rich.console import Console
from test_reader_verify import COUNTS, fake_run

from harvest.cli import build_parser, main
from harvest.data.streams import create_streams
from harvest.errors import UserError
from harvest.fleet import launch, status
from harvest.fleet.plan import make_plan, task_config
from harvest.fleet.sky import skypilot_python
from harvest.fleet.spec import load_fleet
from harvest.fleet.topology import topology
from harvest.store.verify import verify, verify_all


@pytest.fixture(scope="module")
def streams32(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("streams32")
    source = root / "tasks.jsonl"
    source.write_text("".join(json.dumps({"text": f"task {i}"}) + "\n" for i in range(64)))
    create_streams(str(source), 32, str(root / "streams"))
    return str(root / "streams")


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
                "envs": task.envs, "resources": [
                    {"accelerators": r.accelerators, "use_spot": r.use_spot, "region": r.region,
                     "job_recovery": r.job_recovery} for r in task.resources]})
print(json.dumps(out))
"""


def test_emitted_tasks_load_in_skypilot(users_fleet, tmp_path, capsys):
    try:
        python = skypilot_python()
    except UserError as e:
        pytest.skip(f"SkyPilot not installed (`make test` installs it in .venv-sky): {e}")
    assert main(["fleet", "plan", str(users_fleet), "--emit", str(tmp_path)]) == 0
    plan = make_plan(load_fleet(users_fleet))
    paths = [str(tmp_path / f"{w.job_name}.yaml") for w in plan.workers]
    loaded = subprocess.run([python, "-c", _LOAD_TASKS, *paths], capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    tasks = json.loads(loaded.stdout.strip().splitlines()[-1])
    parser = build_parser()
    for w, task in zip(plan.workers, tasks, strict=True):
        assert task["name"] == w.job_name == f"arc-qwen05-{w.group.name}-{w.index}"
        assert task["num_nodes"] == 1
        assert task["setup"] == "pip install 'harvest[tpu,gcs]==0.2.0'"
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


def test_multi_node_gpu_group_derives_process_flags_from_skypilot_env(tmp_path, streams32):
    """Each node runs the same command; the shell turns SkyPilot's env into --coordinator/--num-processes
    /--process-id (node 0 coordinates). A `harvest` on PATH that prints its argv shows what the CLI gets."""
    fleet = copy.deepcopy(FOUR_REGIONS)
    fleet["groups"] = [{"name": "gpu", "accelerator": "H100:8", "num_nodes": 2, "regions": ["us-east4"],
                        "workers": 1, "streams": "0-31", "out": "s3://acts/run", "mesh": "data=2,model=8"}]
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", {**fleet, "data": streams32})))
    task = task_config(plan.workers[0], plan.spec)
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "H100:8"
    shim = tmp_path / "bin" / "harvest"
    shim.parent.mkdir()
    shim.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    shim.chmod(0o755)
    for rank in (0, 1):
        env = {"PATH": f"{shim.parent}:/usr/bin:/bin", "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.9\n",
               "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "2"}
        done = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, check=True)
        args = build_parser().parse_args(json.loads(done.stdout))
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
    ({"extract": {"model": "m", "layers": "12-23"}}, "extract: unknown setting 'layers'"),
    ({"extract": {"model": "m", "format": "arcx"}}, "extract: --format 'arcx': choose one of text, chat, arc"),
    ({"extract": {"model": "m", "max_seq_len": "long"}}, "extract: setting: max_seq_len must be int"),
    ({"extract": {"model": "m", "streams": "0-3"}}, "extract: streams is set per worker"),
    ({"extract": {"model": "m", "overwrite": True}}, "extract: overwrite is refused in a fleet"),
    ({"extract": {"format": "arc"}}, "extract: missing --model"),
    ({"g2_workers": 20}, "group us-east5-v6e: 20 workers but only 11 streams"),
    ({"g0_regions": []}, "group us-central1-v5e: regions must be a non-empty list"),
    ({"g0_colour": "red"}, "groups[0]: unknown key colour"),
    ({"image": "reg/harvest:1"}, "give exactly one of install"),
    ({"name": "Arc_Qwen"}, "name 'Arc_Qwen': use lowercase letters"),
])
def test_plan_refuses_with_one_line(tmp_path, streams32, capsys, changes, message):
    path = write_fleet(tmp_path / "fleet.yaml", _edit({**FOUR_REGIONS, "data": streams32}, **changes))
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err and str(path) in err, err
    assert not (tmp_path / "tasks").exists()  # nothing written


def test_image_instead_of_install(tmp_path, streams32):
    fleet = {**_edit(FOUR_REGIONS, g0_accelerator="H100:8", g0_mesh=None), "data": streams32}
    del fleet["install"]
    fleet["image"] = "registry.example/harvest:0.2.0"
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    gpu, tpu = task_config(plan.workers[0], plan.spec), task_config(plan.workers[8], plan.spec)
    assert gpu["resources"]["image_id"] == "docker:registry.example/harvest:0.2.0" and "setup" not in gpu
    assert gpu["run"].startswith("harvest extract ")
    assert tpu["setup"] == "docker pull registry.example/harvest:0.2.0"
    assert tpu["run"].startswith("docker run --rm --privileged --net=host registry.example/harvest:0.2.0 extract ")


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
        g["out"] = str(tmp_path / g["name"])  # nothing there yet
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", {**fleet, "data": streams32})))
    jobs = RecordedJobs([record(1, plan.workers[0].job_name, "RECOVERING", recoveries=2)])
    console = Console(record=True, width=200)
    assert status.show(plan, jobs, console=console) == 0
    text = console.export_text()
    assert "arc-qwen05/us-central1-v5e/0" in text and "RECOVERING" in text and "NOT LAUNCHED" in text
    assert "0/32 streams done" in text and "0/1 workers running" not in text


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
        f"stream_00000/: written in 2 outputs ({a}, {b}); a stream belongs to exactly one worker",
        "stream_00001/: in none of the 2 outputs (never started)"]
