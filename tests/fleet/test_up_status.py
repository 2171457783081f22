"""`harvest fleet up`, `down` and `status` through the one SkyPilot module fed recorded job records (no cloud
is reachable here): `up` idempotent, `status` one table joined with storage before, during and after a
launch; verify takes a fleet's outputs as one run; the real SkyPilot's API server stopped if status started it."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fake_runs import COUNTS, fake_run
from fleet_helpers import FOUR_REGIONS, RecordedJobs, record, skypilot_or_skip, write_fleet
from rich.console import Console

from harvest.cli import main
from harvest.data.streams import create_streams
from harvest.fleet import launch, status
from harvest.fleet.plan import make_plan
from harvest.fleet.spec import load_fleet
from harvest.store.verify import verify, verify_all


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
    python = skypilot_or_skip()
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
