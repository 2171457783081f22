"""A fleet end to end without a cloud: the run commands `harvest fleet plan` emits (2 groups x 2 workers,
`shared_paths`) run as local processes with SkyPilot's env, writing to fake-gcs-server and moto S3. A worker
SIGKILLed and rerun as a recovery would: `fleet status` shows the stale streams, verify passes, the shards
equal one uninterrupted run's. A worker SIGSTOPped while its replacement takes its streams exits 3 having
written nothing more. A TRM fleet builds its puzzles once before its trainer starts; status reads its progress."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from extract_helpers import another_vm, harvest_env, run_harvest, text_streams
from fleet_helpers import RecordedJobs, built_wheel, record, write_fleet
from rich.console import Console
from trm_helpers import TINY

from harvest.cli import main
from harvest.fleet import status
from harvest.fleet.plan import make_plan, task_config
from harvest.fleet.spec import load_fleet
from harvest.storage import Storage
from harvest.store.records import Sidecar

pytestmark = pytest.mark.slow

NUM_STREAMS = 8
EXTRACT = {"points": "resid_post:1-3,mlp_out:2", "max_seq_len": 128, "long": "chunk", "batch_size": 2,
           "shard_size": "192KB"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Streams of a 160-record dataset, the demo checkpoint, and an uninterrupted local run of all streams."""
    root = tmp_path_factory.mktemp("fleet-e2e")
    checkpoint, env, streams = text_streams(root, NUM_STREAMS, n=160)
    cache = root / "cache"
    reference = root / "reference"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in EXTRACT.items()]
    done = run_harvest("extract", "--model", str(checkpoint), "--data", str(streams), "--out", str(reference),
                       *flags, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return root, cache, checkpoint, streams, reference


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The checkout's wheel the tasks carry (the hosts here run the suite's own `harvest`: tests/fleet/test_fleet_exec.py
    runs a task's setup too)."""
    return built_wheel(tmp_path_factory.mktemp("wheel"))


def fleet_yaml(path: Path, setup, gcs_out: str, s3_out: str, **extract) -> Path:
    root, cache, checkpoint, streams, reference = setup
    return write_fleet(path, {
        "name": "e2e", "data": str(streams), "shared_paths": True,
        "extract": {"model": str(checkpoint), **EXTRACT, **extract},
        "groups": [
            {"name": "gcs", "accelerator": "cpu", "regions": ["local"], "workers": 2, "streams": "0-3",
             "out": gcs_out},
            {"name": "s3", "accelerator": "cpu", "regions": ["local"], "workers": 2, "streams": "auto",
             "out": s3_out},
        ]})


@dataclasses.dataclass
class Host:
    """Runs one worker's task as SkyPilot would on a fresh single-node VM."""

    cache: Path
    tmp: Path

    def start(self, task: dict, tag: str, prefix: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
        """`prefix`: a command the task runs under (e.g. `unshare`, for a pid namespace of its own); `env`: more
        environment (test hooks)."""
        workdir = self.tmp / f"vm-{tag}-{time.monotonic_ns()}"  # a new VM: nothing left from before
        workdir.mkdir(parents=True)
        env = {**harvest_env(self.cache, devices=2), **task["envs"], "SKYPILOT_NODE_RANK": "0",
               "SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_IPS": "127.0.0.1",
               "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **(env or {})}  # `harvest` as installed
        with open(workdir / "log.txt", "wb") as log:
            proc = subprocess.Popen([*prefix, "bash", "-c", task["run"]], cwd=workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_path = workdir / "log.txt"
        return proc


def log_of(proc: subprocess.Popen) -> str:
    return proc.log_path.read_text(errors="replace")[-3000:]


def wait(proc: subprocess.Popen, timeout: float = 300) -> int:
    return proc.wait(timeout=timeout)


def committed(out: str, streams) -> int:
    storage = Storage(out)
    return sum(1 for s in streams for n in storage.listdir(f"stream_{s:05d}")
               if n.startswith("shard_") and n.endswith(".json"))


def wait_for_commits(proc: subprocess.Popen, out: str, streams, n: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while committed(out, streams) < n:
        assert proc.poll() is None, f"worker exited ({proc.returncode}) before {n} commits"
        assert time.monotonic() < deadline, f"no {n} commits after {timeout}s"
        time.sleep(0.1)


def committed_files(url: str) -> dict[str, tuple[bytes, Sidecar]]:
    """Per sidecar, the data it commits and the sidecar itself less that object's name: the name carries the
    writing attempt's id, so two runs that wrote the same bytes name them differently."""
    storage = Storage(url)
    out = {}
    for d in storage.listdir():
        for n in storage.listdir(d) if d.startswith("stream_") else []:
            if n.startswith("shard_") and n.endswith(".json"):
                sidecar = Sidecar.from_json(json.loads(storage.read_bytes(f"{d}/{n}")))
                out[f"{d}/{n}"] = (storage.read_bytes(f"{d}/{sidecar.file}"), dataclasses.replace(sidecar, file=""))
    return out


def assert_equals_reference(url: str, reference: Path, streams) -> None:
    ours = committed_files(url)
    theirs = {k: v for k, v in committed_files(str(reference)).items()
              if int(k[len("stream_"):len("stream_") + 5]) in streams}
    assert sorted(ours) == sorted(theirs) and len(ours) >= len(streams)
    assert ours == theirs


def test_fleet_on_gcs_and_s3_with_a_killed_worker(setup, wheel, gcs_url, s3_url, tmp_path, capsys):
    root, cache, checkpoint, streams_dir, reference = setup
    plan = make_plan(load_fleet(fleet_yaml(tmp_path / "fleet.yaml", setup, gcs_url, s3_url)))
    tasks = {w.worker_id: task_config(w, plan.spec, wheel) for w in plan.workers}
    by_id = {w.worker_id: w for w in plan.workers}
    assert [list(w.streams) for w in plan.workers] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    host = Host(cache, tmp_path)

    victim = by_id["e2e/gcs/0"]
    # Its third shard of stream 0 waits a minute before its commit: the worker is surely mid-stream when it is
    # killed (a whole worker's run can take a fraction of a second, faster than this test looks at storage).
    proc = host.start(tasks[victim.worker_id], "gcs-0", env={"HARVEST_TEST_STOP_BEFORE_COMMIT": "0:2:60"})
    others = {wid: host.start(tasks[wid], wid.replace("/", "-")) for wid in ("e2e/gcs/1", "e2e/s3/0", "e2e/s3/1")}
    wait_for_commits(proc, gcs_url, victim.streams, 2)
    assert proc.poll() is None, "the worker finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # a preemption: no goodbye
    proc.wait()
    for wid, other in others.items():
        assert wait(other) == 0, log_of(other)

    # Between preemption and recovery: SkyPilot says RECOVERING, storage says the victim's streams are
    # unfinished; an hour on they are stale and `fleet status` exits 1 naming the worker.
    jobs = RecordedJobs([record(1, victim.job_name, "RECOVERING", recoveries=1),
                         *(record(i + 2, by_id[wid].job_name, "SUCCEEDED") for i, wid in enumerate(others))])
    an_hour_on = datetime.now(timezone.utc) + timedelta(hours=1)
    later = status.fleet_status(plan, jobs, now=an_hour_on)
    assert [w.worker.worker_id for w in later.workers if w.stale] == ["e2e/gcs/0"] and not later.finished
    quiet = Console(file=io.StringIO())
    assert status.show(plan, jobs, console=quiet) == 0 and status.show(plan, jobs, console=quiet, now=an_hour_on) == 1
    console = Console(record=True, width=220)
    for renderable in status.render(later):
        console.print(renderable)
    text = console.export_text()
    assert "stale: e2e/gcs/0" in text and "RECOVERING" in text and "SUCCEEDED" in text

    rerun = host.start(tasks[victim.worker_id], "gcs-0-recovered")  # the same command on a new VM
    assert wait(rerun) == 0, log_of(rerun)

    now = status.fleet_status(plan, jobs)
    assert not now.stale and now.finished
    counts = plan.counts
    for w in now.workers:
        assert w.done == 2 and w.total("records") == sum(counts[s] for s in w.worker.streams)
    console = Console(record=True, width=220)
    assert status.show(plan, jobs, console=console) == 0
    assert "8/8 streams done" in console.export_text()

    # `harvest verify` over both buckets proves each stream done exactly once; one bucket alone is not the run
    assert main(["verify", gcs_url, s3_url]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith(f"OK {gcs_url} + {s3_url}: 8 streams"), out
    assert main(["verify", gcs_url]) == 1 and "stream_00004/: no committed shard" in capsys.readouterr().out
    assert_equals_reference(gcs_url, reference, [0, 1, 2, 3])
    assert_equals_reference(s3_url, reference, [4, 5, 6, 7])


def test_a_stopped_worker_resumed_after_its_replacement_exits_without_writing(setup, wheel, s3_url, gcs_url,
                                                                               tmp_path):
    root, cache, checkpoint, streams_dir, reference = setup
    elsewhere = another_vm()
    ttl = 6
    plan = make_plan(load_fleet(fleet_yaml(tmp_path / "fleet.yaml", setup, gcs_url, s3_url, lease_ttl=ttl)))
    worker = next(w for w in plan.workers if w.worker_id == "e2e/s3/1")
    task = task_config(worker, plan.spec, wheel)
    host = Host(cache, tmp_path)
    old = host.start(task, "s3-1-old")
    wait_for_commits(old, s3_url, worker.streams, 1)
    os.killpg(old.pid, signal.SIGSTOP)  # a VM that stalls; SkyPilot replaces it
    try:
        new = host.start(task, "s3-1-new", elsewhere)  # takes over once it saw the lease unchanged for its TTL
        assert wait(new) == 0, log_of(new)
        before = committed_files(s3_url)
    finally:
        os.killpg(old.pid, signal.SIGCONT)
    assert wait(old, timeout=60) == 3, log_of(old)  # lost the stream: stops, says so in one line
    assert committed_files(s3_url) == before  # the old worker wrote nothing after it woke
    assert_equals_reference(s3_url, reference, list(worker.streams))


# a training fleet: a TRM's puzzles built once, then the trainer; status from the run in its bucket --------------

class HostJobs(RecordedJobs):
    """SkyPilot's queue where each launched task runs at once, to its end, on a fresh local "VM" (Host); its
    record then says SUCCEEDED or FAILED by the exit code, as a managed job's does. Notes whether the fleet's
    data held a complete dataset when each job was launched."""

    def __init__(self, host: Host, data: str):
        super().__init__()
        self.host, self.data = host, data
        self.logs: dict[str, str] = {}
        self.dataset_at_launch: dict[str, bool] = {}

    def launch(self, task: dict, name: str) -> None:
        from harvest.fleet.puzzles import dataset_present

        self.dataset_at_launch[name] = dataset_present(self.data)
        super().launch(task, name)
        proc = self.host.start(task, name)
        code = wait(proc, timeout=600)
        self.logs[name] = log_of(proc)
        self.records[-1]["status"] = "SUCCEEDED" if code == 0 else "FAILED"


def trm_fleet(path: Path, bucket: str, **puzzles) -> Path:
    return write_fleet(path, {
        "name": "trm-e2e", "data": f"{bucket}/sudoku4",
        "train": {"model": TINY, "batch_size": 16, "steps": 6, "checkpoint_every": 3, "log_every": 1},
        "puzzles": {"kind": "sudoku", "size": 4, "augment": 1, **puzzles},
        "groups": [{"name": "pod", "accelerator": "cpu", "regions": ["local"], "workers": 1,
                    "out": f"{bucket}/trm"}]})


def test_a_trm_fleet_builds_its_puzzles_once_then_trains_and_status_reads_the_run(gcs_url, tmp_path):
    """`fleet up` runs the one puzzles build, starts the trainer only once the dataset is committed, and a
    second `up` launches nothing; `fleet status` then shows the step, loss, tokens/s and last checkpoint that
    the real `harvest train` run wrote to its bucket (fake-gcs-server)."""
    from harvest.fleet import launch

    bucket = gcs_url.rsplit("/", 1)[0]
    plan = make_plan(load_fleet(trm_fleet(tmp_path / "fleet.yaml", bucket, generate=100, test_size=20)))
    assert plan.build is not None and not plan.build.present
    jobs = HostJobs(Host(tmp_path / "cache", tmp_path), plan.spec.data)
    said: list[str] = []
    launched, kept = launch.up(plan, jobs, poll=0.1, say=said.append)
    assert jobs.launched == ["trm-e2e.puzzles", "trm-e2e.pod.0"], jobs.logs
    assert jobs.dataset_at_launch == {"trm-e2e.puzzles": False, "trm-e2e.pod.0": True}
    assert [r["status"] for r in jobs.records] == ["SUCCEEDED", "SUCCEEDED"], jobs.logs
    assert [w.job_name for w in launched] == ["trm-e2e.pod.0"] and not kept
    assert said[0].startswith("puzzles build trm-e2e.puzzles running") and "dataset ready" in said[1]
    assert launch.up(make_plan(plan.spec), jobs, poll=0.1, say=said.append) == ([], list(plan.workers))
    assert len(jobs.launched) == 2  # built once, trained once

    lines = Storage(f"{bucket}/trm").read_bytes("metrics.jsonl").decode().splitlines()
    last = json.loads(lines[-1])
    console = Console(record=True, width=200)
    assert status.show(make_plan(plan.spec), jobs, console=console) == 0
    text = console.export_text()
    row = next(line for line in text.splitlines() if "trm-e2e.pod.0" in line)
    assert last["step"] == 6 and "SUCCEEDED" in row and "6/6" in row and "step 6" in row, text
    assert f"{last['loss']:.4g}" in row, text
    assert "puzzles build trm-e2e.puzzles: done" in text


def test_a_failed_puzzles_build_stops_up_before_any_trainer_starts(gcs_url, tmp_path):
    from harvest.errors import UserError
    from harvest.fleet import launch

    bucket = gcs_url.rsplit("/", 1)[0]
    path = trm_fleet(tmp_path / "fleet.yaml", bucket, train=f"{bucket}/no-such.csv", test=f"{bucket}/no-such.csv")
    plan = make_plan(load_fleet(path))
    jobs = HostJobs(Host(tmp_path / "cache", tmp_path), plan.spec.data)
    with pytest.raises(UserError, match="puzzles build trm-e2e.puzzles ended FAILED without writing a dataset") as e:
        launch.up(plan, jobs, poll=0.1, say=lambda line: None)
    assert len(str(e.value).splitlines()) == 1 and str(path) in str(e.value)
    assert jobs.launched == ["trm-e2e.puzzles"]  # no pod asked for
