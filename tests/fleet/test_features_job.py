"""A features fleet (`features:`, the settings of `harvest sae features`): every worker of every group is one rank
of the pass, world the fleet's workers, all writing one out; its tasks load in SkyPilot and each host's command
is the real CLI's, turned by it into the FeaturesConfig the pass gets; its refusals are one line each; and
`fleet status` reads each rank's progress and the site from the out the ranks share."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_helpers import RecordedJobs, load_tasks, record, run_as_host, run_cli, write_fleet
from rich.console import Console

import harvest.sae.features.build as features_build
from harvest.cli import main
from harvest.fleet import status
from harvest.fleet.plan import make_plan
from harvest.fleet.spec import load_fleet
from harvest.sae.features.record import FEATURES_JSON
from harvest.sae.features.scan import part_path, state_path

SAE = "gs://saes-us/qwen05"
OUT = "gs://saes-us/qwen05-features"
FEATURES = {
    "name": "qwen05-features",
    "data": SAE,
    "features": {"streams": "held-out", "top": 20, "window": 8, "logits": 12, "neuronpedia": True},
    "groups": [
        {"name": "us-v5e", "accelerator": "tpu-v5litepod-8", "regions": ["us-central1", "us-west4"], "workers": 3,
         "out": OUT},
        {"name": "us-l4", "accelerator": "L4:1", "regions": ["us-east4"], "workers": 2, "out": OUT},
    ],
}
WORLD = 5


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[object, str, list[dict]]:
    """The fleet planned by the CLI (its printed table) into task files, loaded by SkyPilot's own parser."""
    root = tmp_path_factory.mktemp("features-fleet")
    path = write_fleet(root / "fleet.yaml", FEATURES)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert main(["fleet", "plan", str(path), "--emit", str(root / "tasks")]) == 0
    plan = make_plan(load_fleet(path))
    return plan, printed.getvalue(), load_tasks([root / "tasks" / f"{w.job_name}.yaml" for w in plan.workers])


def test_every_worker_is_one_rank_of_one_pass(planned):
    plan, printed, _ = planned
    assert [w.rank for w in plan.workers] == list(range(WORLD))
    assert [(w.group.name, w.index) for w in plan.workers] == [("us-v5e", 0), ("us-v5e", 1), ("us-v5e", 2),
                                                               ("us-l4", 0), ("us-l4", 1)]
    assert f"wrote {WORLD} SkyPilot task files" in printed
    assert f"features of {SAE}, {WORLD} ranks" in printed
    for rank in range(WORLD):
        assert f"{rank} of {WORLD}" in printed


def test_each_host_runs_the_pass_with_its_rank(planned, tmp_path, monkeypatch):
    """Each task SkyPilot loads (its group's accelerator and regions, recovery in the next region: a rerun of the
    command resumes) runs `harvest sae features SAE --out OUT --rank R --world W ...`, which the real CLI turns
    into the FeaturesConfig the pass is given."""
    plan, _, tasks = planned
    given = []
    monkeypatch.setattr(features_build, "run_features",
                        lambda cfg: given.append(cfg) or {"built": False, "out": cfg.out, "waiting": [0]})
    for worker, task in zip(plan.workers, tasks, strict=True):
        group = worker.group
        assert task["name"] == worker.job_name and task["num_nodes"] == 1
        assert {r["region"] for r in task["resources"]} == set(group.regions)
        for resources in task["resources"]:
            assert resources["use_spot"] is True
            assert resources["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
        assert "[" in task["setup"] and "train" in task["setup"].split("[")[1]  # orbax: the SAE's checkpoint
        argv = run_as_host(task, "harvest", tmp_path, {})
        assert argv[:3] == ["sae", "features", SAE]
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(argv) == 0
    assert [(c.rank, c.world) for c in given] == [(r, WORLD) for r in range(WORLD)]
    for cfg in given:
        assert (cfg.sae, cfg.out) == (SAE, OUT)
        for key, value in FEATURES["features"].items():
            assert getattr(cfg, key) == value


def _fleet(**changes) -> dict:
    return {**FEATURES, **changes}


def _group(**changes) -> list[dict]:
    return [{**FEATURES["groups"][0], **changes}]


@pytest.mark.parametrize("changes, message", [
    ({"features": {"rank": 3}}, "features: rank is set per worker from the plan (one rank per worker); remove it"),
    ({"features": {"world": 4}}, "features: world is set per worker from the plan"),
    ({"features": {"out": "gs://b/o"}}, "features: out is set per worker from the groups' out"),
    ({"features": {"sae": "gs://b/s"}}, "features: sae is set per worker from the fleet's data"),
    ({"features": {"top": 0}}, "features: --top 0: must be at least 1"),
    ({"features": {"window": -1}}, "features: --window -1: must be at least 0"),
    ({"features": {"top": "many"}}, "features: setting: top must be int"),
    ({"features": {"tensors": "resid_post.3"}}, "features: unknown setting 'tensors'"),
    ({"features": {"run": "./run"}}, "features: run './run' is not in object storage"),
    ({"data": "./sae"}, "data './sae' is not in object storage"),
    ({"groups": [FEATURES["groups"][0], {**FEATURES["groups"][1], "out": "gs://saes-eu/f"}]},
     "features: every rank writes its part into one out, where the last merges them, but the groups name 2"),
    ({"groups": _group(accelerator="tpu-v4-64")}, "group us-v5e: tpu-v4-64 is 8 hosts x 4 chips: a features: "
                                                  "worker is one process on one host"),
    ({"groups": _group(accelerator="H100:8", num_nodes=2)}, "group us-v5e: H100:8 is 2 hosts"),
    ({"groups": _group(mesh="data=8")}, "group us-v5e: mesh data=8: a features: worker encodes on every device"),
    ({"groups": _group(streams="0-3")}, "group us-v5e: streams 0-3: a features: job deals the run's shards"),
    ({"sae": {"k": 8}}, "give exactly one job section, extract, train, sae, features (its settings), got sae, "
                        "features"),
])
def test_features_plan_refuses_with_one_line(tmp_path, capsys, changes, message):
    path = write_fleet(tmp_path / "fleet.yaml", _fleet(**changes))
    code, out, err = run_cli(capsys, "fleet", "plan", str(path), "--emit", str(tmp_path / "tasks"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert message in err and str(path) in err, err
    assert not (tmp_path / "tasks").exists()


def test_status_shows_each_ranks_pass_and_the_site(tmp_path):
    """Read from the out the ranks share: a rank whose part is in scan/ is done, one with a saved state
    resumes from it; the site is written once features.json is."""
    out = tmp_path / "out"
    fleet = _fleet(data=str(tmp_path / "sae"), shared_paths=True,
                   groups=[{**FEATURES["groups"][0], "out": str(out)}])
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    names = [w.job_name for w in plan.workers]
    jobs = RecordedJobs([record(1, names[0], "SUCCEEDED"), record(2, names[1], "RUNNING", recoveries=1)])

    def shown() -> tuple[int, str]:
        console = Console(file=io.StringIO(), width=250)
        code = status.show(plan, jobs, console=console)
        return code, console.file.getvalue()

    code, text = shown()
    assert code == 0 and f"0/3 ranks done (parts in {out}/scan/), site not written yet" in text
    (out / "scan").mkdir(parents=True)
    (out / part_path(0, 3)).write_bytes(b"")
    (out / state_path(1, 3)).write_bytes(b"")
    code, text = shown()
    rows = {line.split()[1]: line for line in text.splitlines() if line.startswith("│ qwen05")}
    assert "done" in rows[f"{fleet['name']}/us-v5e/0"] and "part written" in rows[f"{fleet['name']}/us-v5e/0"]
    assert "running" in rows[f"{fleet['name']}/us-v5e/1"] and "state saved" in rows[f"{fleet['name']}/us-v5e/1"]
    assert "not launched" in rows[f"{fleet['name']}/us-v5e/2"]
    assert "1/3 ranks done" in text and not status.features_status(plan, jobs).finished
    (out / FEATURES_JSON).write_text("{}")
    code, text = shown()
    assert code == 0 and f"site written: {out}/index.html" in text and status.features_status(plan, jobs).finished


def test_status_says_when_skypilot_cannot_be_asked(tmp_path):
    class Unreachable(RecordedJobs):
        def queue(self):
            from harvest.errors import UserError

            raise UserError("SkyPilot's API server did not answer")

    fleet = _fleet(data=str(tmp_path / "sae"), shared_paths=True,
                   groups=[{**FEATURES["groups"][0], "out": str(tmp_path / "out")}])
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    console = Console(file=io.StringIO(), width=250)
    assert status.show(plan, Unreachable(), console=console) == 2
    text = console.file.getvalue()
    assert "job states unknown: SkyPilot's API server did not answer" in text and text.count("unknown") >= 4


def test_a_local_features_fleet_mounts_what_it_reads(tmp_path):
    """With shared paths and an image, a TPU host's container sees the SAE run and the run read (read-only) and
    the out (writable)."""
    from harvest.fleet.plan import task_config

    sae, run, out = tmp_path / "sae", tmp_path / "run", tmp_path / "out"
    fleet = _fleet(data=str(sae), shared_paths=True, image="harvest:cpu", features={"run": str(run)},
                   groups=[{**FEATURES["groups"][0], "out": str(out), "workers": 1}])
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    volumes = re.findall(r"--volume '?([^' ]+)", task_config(plan.workers[0], plan.spec)["run"])
    assert {f"{sae}:{sae}:ro", f"{run}:{run}:ro", f"{out}:{out}"} <= set(volumes), volumes


@pytest.mark.slow
def test_the_ranks_commands_build_one_site(tmp_path, wheel):
    """Two workers' commands run as their hosts would (shared paths: the SAE tests' run and an SAE trained on it):
    the first to finish writes its part and waits for the other; the last merges and writes the site, and
    `fleet status` follows it from the out."""
    from features_helpers import features_source

    from harvest.fleet.plan import task_config

    source = features_source(tmp_path / "source")
    out = tmp_path / "features"
    fleet = _fleet(data=source["sae"], shared_paths=True, features={"top": 5, "window": 3},
                   groups=[{"name": "cpus", "accelerator": "cpu", "regions": ["local"], "workers": 2,
                            "out": str(out)}])
    plan = make_plan(load_fleet(write_fleet(tmp_path / "fleet.yaml", fleet)))
    env = {**source["env"], "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # `harvest` as installed
    jobs = RecordedJobs()

    def host(worker) -> str:
        done = subprocess.run(["bash", "-c", task_config(worker, plan.spec, wheel)["run"]], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    def shown() -> str:
        console = Console(file=io.StringIO(), width=250)
        assert status.show(plan, jobs, console=console) == 0
        return console.file.getvalue()

    assert "waiting for rank(s) 0" in host(plan.workers[1])
    text = shown()
    assert "1/2 ranks done" in text and "site not written yet" in text
    assert f"open {out}/index.html" in host(plan.workers[0])
    assert "2/2 ranks done" in shown() and (out / "index.html").is_file() and (out / FEATURES_JSON).is_file()
