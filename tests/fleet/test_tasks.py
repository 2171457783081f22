"""The SkyPilot tasks a fleet emits, as SkyPilot itself loads them: the SDK calls harvest makes exist; a
multi-node GPU group takes its process flags from SkyPilot's env; an image's command forwards the environment
by name and runs under an init; shared paths are mounted; `up` passes the fleet's secrets."""

from __future__ import annotations

import copy
import shlex
import subprocess
import zipfile

import pytest
from fleet_helpers import FOUR_REGIONS, RecordedJobs, edit_fleet, load_tasks, run_as_host, skypilot_or_skip, write_fleet

from harvest.cli import build_parser, main
from harvest.errors import UserError
from harvest.fleet import launch
from harvest.fleet.container import CREDENTIAL_ENV, RUNTIME_ENV, SKYPILOT_ENV
from harvest.fleet.plan import make_plan, task_config
from harvest.fleet.sky import skypilot_python
from harvest.fleet.spec import load_fleet


def test_emitted_tasks_load_in_skypilot(users_fleet, tmp_path, capsys):
    skypilot_or_skip()
    assert main(["fleet", "plan", str(users_fleet), "--emit", str(tmp_path)]) == 0
    plan = make_plan(load_fleet(users_fleet))
    tasks = load_tasks([tmp_path / f"{w.job_name}.yaml" for w in plan.workers])
    (wheel,) = tmp_path.glob("harvest_activations-*-py3-none-any.whl")  # the checkout, carried by every task
    with zipfile.ZipFile(wheel) as packed:  # with the files the code reads beside itself
        assert {"harvest/sae/cpu_kernels.cc", "harvest/sae/features/web/app.js"} <= set(packed.namelist())
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
        args = build_parser().parse_args(run_as_host(task, "harvest", tmp_path, env))
        assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.7:8476", 2, rank)
        assert args.streams == "0-31" and args.mesh == "data=2,model=8"


def _image_fleet(streams32: str, **top) -> dict:
    """The four-region fleet from an image, its first group on H100s (SkyPilot runs those in the image)."""
    fleet = {**edit_fleet(FOUR_REGIONS, g0_accelerator="H100:8", g0_mesh=None), "data": streams32, **top}
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
    task = load_tasks([tmp_path / "tasks" / f"{worker.job_name}.yaml"])[0]
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
    argv = run_as_host(task, "docker", tmp_path, host)
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
    assert "--mount" not in run_as_host(task, "docker", tmp_path, {})


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
