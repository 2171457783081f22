"""Training fleets: a decoder and a TRM on a v4-64 and SAEs on two GPU nodes plan into tasks SkyPilot loads
whose command, on every host, takes its process layout from SkyPilot's env; their refusals (mesh, batch,
settings, workers, a missing dataset) one line each; a TRM's puzzles build as its own task; an image on a TPU
slice gets each host's rank; a stale trainer is seen from its metrics in a bucket; up and down of one job."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shlex
from pathlib import Path

import pytest
from fleet_helpers import (DECODER_POD, SAE_GPUS, TRM_POD, RecordedJobs, load_tasks, record, run_as_host, run_cli,
                           write_fleet)
from rich.console import Console
from storage_servers import create_gcs_bucket

from harvest.cli import build_parser, main
from harvest.fleet import launch, status
from harvest.fleet.plan import make_plan, task_config
from harvest.fleet.spec import load_fleet


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


def _per_host(task: dict, hosts: int, tmp_path: Path) -> list:
    """The task's run command on each host as SkyPilot runs it (its env per rank), each harvest argv parsed by
    harvest's own CLI parser."""
    ips = "".join(f"10.0.0.{i + 1}\n" for i in range(hosts))
    return [build_parser().parse_args(run_as_host(task, "harvest", tmp_path, {
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
    loaded = load_tasks([task for *_, task in planned.values()])
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
    from harvest.training.kinds import train_config

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
    ({"extract": {"model": "o/m"}}, "give exactly one job section, extract, train, sae, features (its settings), got "
                                    "extract, train"),
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
    build, trainer = load_tasks([tmp_path / "tasks" / "trm-sudoku.puzzles.yaml",
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
        argv = run_as_host(task, "docker", tmp_path, env)
        harvest_args = argv[argv.index("registry.example/harvest:0.2.0") + 1:]
        args = build_parser().parse_args(harvest_args)
        assert (args.command, args.coordinator, args.num_processes, args.process_id) == \
            ("train", "10.0.0.5:8476", 8, rank)


def test_status_of_a_running_trainer_that_stopped_logging_is_stale(tmp_path, gcs_server):
    """The trainer's own metrics writer (harvest.training.metrics.MetricsFile) in a bucket: a RUNNING job whose
    newest record is older than the stale limit makes `fleet status` say so and exit 1; a fresh one exits 0."""
    import time

    from harvest.fleet.status import STALE_AFTER_S
    from harvest.storage import Storage
    from harvest.training.metrics import MetricsFile

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
