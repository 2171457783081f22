"""The user's path through failures and help (issue 35, point 6), each as a user meets it: a `--strict` stop
releases its leases and a rerun resumes; a full disk (a small tmpfs) exits 75 with nothing half-written and
resumes once there is room; an --out that cannot be written says why; every action has its own --help; the
progress line counts records and samples; W&B's files go under --out; stream and shard numbers past the
names' padded widths are listed and read like any other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from extract_helpers import TMP_MARK, harvest_cmd, harvest_env, run_harvest

from harvest.cli import build_parser
from harvest.fleet.plan import RETRYABLE_EXIT_CODES
from harvest.storage import Storage
from harvest.store import format as fmt
from harvest.store.listing import list_stream_dirs, read_chain, sidecar_numbers
from harvest.store.report import status_rows
from harvest.store.verify import verify

SETTINGS = ("--points", "resid_post:1", "--max-seq-len", "64", "--shard-size", "20KB", "--batch-size", "4")


def texts(n: int, bad: tuple[int, ...] = ()) -> str:
    lines = [json.dumps({"text": f"hello world number {i} " * (i % 5 + 1)}) for i in range(n)]
    for i in bad:
        lines[i] = '{"text": "a torn line'
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The demo checkpoint and one harvest cache (compiled programs shared by every process here)."""
    from harvest.demo import demo_checkpoint

    root = tmp_path_factory.mktemp("user-path")
    model = demo_checkpoint(root / "cache")
    return root, model, harvest_env(root / "cache", devices=1)


def extract(model: Path, data: Path, out: str, *extra: str) -> list[str]:
    return ["extract", "--model", str(model), "--data", str(data), "--out", out, *SETTINGS, *extra]


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("harvest: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def as_root_in_own_mounts(script: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """`script` (sh) in a private mount namespace, where it may mount tmpfs without touching the host's mounts."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a tmpfs in a private mount namespace")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not allowed here: {probe.stderr.decode().strip()}")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec", script], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_strict_stop_before_any_commit_leaves_the_output_as_it_was(setup):
    root, model, env = setup
    data = root / "early.jsonl"
    data.write_text(texts(40, bad=(30,)))
    out = root / "strict-early"
    done = run_harvest(*extract(model, data, str(out), "--strict"), env=env)
    assert done.returncode == 2
    error = one_line_error(done.stderr)
    assert "early.jsonl:31" in error and "--strict" in error and "nothing was written" in error, error
    assert not out.exists(), sorted(out.rglob("*"))


def test_a_strict_stop_after_commits_keeps_them_frees_its_streams_and_a_rerun_resumes(setup):
    """Two streams, one slot: stream 0 meets its bad record after shards were committed, stream 1 was never
    started. Stream 0's shards stay (a chain a reader follows, its lease released), stream 1 leaves no trace;
    the same command without --strict resumes, records the bad line as skipped, and verify passes."""
    root, model, env = setup
    source = root / "late.jsonl"
    source.write_text(texts(800, bad=(700,)))  # record 350 of stream 0
    streams = root / "late-streams"
    made = run_harvest("streams", "create", "--data", str(source), "--num-streams", "2", "--out", str(streams),
                       env=env)
    assert made.returncode == 0, made.stderr
    out = root / "strict-late"
    done = run_harvest(*extract(model, streams, str(out), "--strict"), env=env)
    assert done.returncode == 2
    error = one_line_error(done.stderr)
    assert "late.jsonl:701" in error and "shards committed before the stop are kept" in error, error
    st = Storage(str(out))
    assert list_stream_dirs(st) == [0] and st.exists(fmt.RUN_JSON)
    assert sorted(os.listdir(out)) == ["run.json", "stream_00000"]
    lease = json.loads(st.read_bytes(fmt.lease_path(0)))
    assert lease["released"], lease
    chain = read_chain(st, 0)  # strict: one contiguous chain, each shard continuing the one before
    assert chain and not chain[-1].final and chain[-1].next[0] <= 350
    assert not [p for p in out.rglob("*") if TMP_MARK in p.name]
    stopped = verify(str(out))  # incomplete, not failed: every committed byte checks
    assert not stopped.problems and len(stopped.unfinished) == 2, stopped.lines()
    assert stopped.summary.startswith(f"INCOMPLETE {out}: 2 streams not finished"), stopped.summary
    assert [(r["stream"], r["state"]) for r in status_rows(str(out))] == [(0, "stopped"), (1, "pending")]

    resumed = run_harvest(*extract(model, streams, str(out)), env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = verify(str(out))
    assert report.ok, report.lines()
    assert report.records == 800 and report.samples == 799 and report.skipped == 1


def test_a_full_disk_exits_75_keeps_nothing_half_written_and_the_rerun_resumes(setup, tmp_path):
    root, model, env = setup
    data = tmp_path / "data.jsonl"
    data.write_text(texts(400))
    disk, full, final = tmp_path / "disk", tmp_path / "when-full", tmp_path / "final"
    disk.mkdir()
    out = disk / "out"
    command = " ".join(harvest_cmd(*extract(model, data, str(out))))
    script = f"""
        mount -t tmpfs -o size=1m tmpfs {disk}
        set +e; {command} 2> {tmp_path}/first.err; echo $? > {tmp_path}/first.rc; set -e
        cp -a {out} {full}
        mount -o remount,size=32m {disk}
        set +e; {command} > /dev/null 2> {tmp_path}/second.err; echo $? > {tmp_path}/second.rc; set -e
        cp -a {out} {final}
    """
    ran = as_root_in_own_mounts(script, env)
    assert ran.returncode == 0, ran.stderr
    first_err = (tmp_path / "first.err").read_text()
    assert int((tmp_path / "first.rc").read_text()) == 75, first_err[-3000:]
    assert 75 in RETRYABLE_EXIT_CODES  # a fleet's job recovery reruns it
    error = one_line_error(first_err)
    assert "no space left on device" in error and "rerun the same command to resume" in error, error
    # What the full disk left: committed shards only, each whole (checksums), no temp file, nothing but the end.
    assert not [p for p in full.rglob("*") if TMP_MARK in p.name]
    chain = read_chain(Storage(str(full)), 0)
    assert chain and not chain[-1].final
    report = verify(str(full))
    assert not report.problems and len(report.unfinished) == 1, report.lines()
    assert "stream incomplete" in report.unfinished[0] and report.summary.startswith("INCOMPLETE"), report.lines()
    assert int((tmp_path / "second.rc").read_text()) == 0, (tmp_path / "second.err").read_text()[-3000:]
    report = verify(str(final))
    assert report.ok and report.records == 400 and report.shards > len(chain), report.lines()


def test_an_unwritable_out_says_cannot_write(setup, tmp_path):
    """A file where a directory of --out should be, and a read-only mount: one line saying --out cannot be
    written and why (never "not found"), exit 2, nothing written."""
    root, model, env = setup
    data = tmp_path / "data.jsonl"
    data.write_text(texts(8))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = run_harvest(*extract(model, data, str(blocker / "out")), env=env)
    assert done.returncode == 2
    error = one_line_error(done.stderr)
    assert f"cannot write --out {blocker}/out" in error and f"{blocker} is a file, not a directory" in error, error
    assert "not found" not in error and blocker.read_text() == "not a directory"

    readonly = tmp_path / "readonly"
    readonly.mkdir()
    command = " ".join(harvest_cmd(*extract(model, data, str(readonly / "out"))))
    ran = as_root_in_own_mounts(f"mount -t tmpfs -o ro,size=1m tmpfs {readonly}\n"
                                f"set +e; {command}; echo rc=$?", env)
    assert "rc=2" in ran.stdout, ran.stderr[-3000:]
    error = one_line_error(ran.stderr)
    assert f"cannot write --out {readonly}/out: read-only file system" in error, error


def help_of(*args: str, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*args, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_each_action_has_its_own_help_and_every_command_a_description(capsys):
    own = {  # flags the action's help must show, and flags of other actions it must not
        ("sae", "train"): (["--architecture", "--run RUN", "--config"], ["SAE_RUN", "--format", "--max-seq-len"]),
        ("sae", "eval"): (["SAE_RUN", "--run RUN", "--tokens", "--model", "--max-seq-len"],
                          ["--architecture", "--format", "--config"]),
        ("sae", "export"): (["SAE_RUN", "--format", "--out", "--step"], ["--architecture", "--tokens", "--model"]),
        ("train", "eval"): (["RUN", "--data", "--split"], ["--lr", "--step", "--out"]),
        ("train", "export"): (["RUN", "--out", "--step"], ["--lr", "--split", "--data"]),
        ("train",): (["--lr", "--steps", "export", "eval"], ["--split"]),
    }
    for args, (shown, hidden) in own.items():
        text = help_of(*args, capsys=capsys)
        assert text.startswith(f"usage: harvest {' '.join(args)} "), text[:200]
        assert [s for s in shown if s not in text] == [], (args, text)
        assert [h for h in hidden if h in text] == [], (args, text)
    for command in (("status",), ("inspect",), ("verify",), ("extract",), ("sae", "eval"), ("train", "export")):
        text = help_of(*command, capsys=capsys)
        description = text.split("\n\n")[1]
        assert not description.lstrip().startswith(("positional arguments", "options")), (command, text)
    assert "Progress of an extraction run" in help_of("status", capsys=capsys)
    for command in (("extract",), ("train",), ("sae", "eval")):
        model_help = help_of(*command, capsys=capsys).split("\n  --model MODEL", 1)[1].split("\n  --", 1)[0]
        assert "GGUF" in model_help and ".gguf" in model_help, (command, model_help)


def test_the_progress_line_counts_records_and_samples_together(tmp_path):
    """--long truncate: one sample per record, less the bad ones. Rows of a packed block hold its pieces in any
    order (best fit), so both counts move when a block's last row is done, and samples never pass records."""
    from harvest.data.batching import pack_stream, stream_pieces
    from harvest.data.sources import Record
    from harvest.extract.report import Progress
    from harvest.store.commit import ResumePoint

    n, seq = 300, 32
    records = [Record(i, f"data.jsonl:{i + 1}", {"text": "x" * (5 + (i * 37) % 90)}) for i in range(n)]
    records[7] = Record(7, "data.jsonl:8", None, "malformed JSON")
    events = stream_pieces(iter(records), lambda r: [r.value["text"]], lambda t: [list(range(1, len(s) + 1))
                                                                                  for s in t],
                           first_index=0, max_seq_len=seq, long="truncate", strict=False, sample_error=ValueError)
    progress = Progress(Storage(str(tmp_path)), {0: n}, {0: ResumePoint()}, worker="w")
    seen = []
    for row in pack_stream(events, seq):
        progress.rows_done(0, row)
        seen.append((progress.records[0], progress.samples[0]))
        assert progress.samples[0] <= progress.records[0], seen[-5:]
    assert seen[-1] == (n, n - 1) and len({s for s in seen}) > 3  # live: it moved on the way
    assert progress.line().startswith(f"records {n}/{n} read, samples {n - 1}, ")


def test_wandb_files_go_under_the_runs_out_not_the_current_directory(tmp_path):
    """The one path every trainer's metrics take (decoder, TRM, `sae train`: harvest.training.metrics.MetricsFile),
    with W&B offline, run from another directory and no $WANDB_DIR."""
    pytest.importorskip("wandb")
    cwd, out = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    code = ("from harvest.storage import Storage\n"
            "from harvest.training.metrics import MetricsFile, RunRecord\n"
            "record = RunRecord(kind='trm', config={}, run_settings={}, mesh='data=1', config_sha256='x')\n"
            f"metrics = MetricsFile(Storage({str(out)!r}), 0, 'wandb', record)\n"
            "metrics.append({'step': 1, 'time': 0.0, 'loss': 1.5})\n"
            "metrics.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "WANDB_DIR"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONPATH": os.pathsep.join(
                              p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), sorted(out.rglob("*"))
    assert list(cwd.iterdir()) == []
    from harvest.training.curves import wandb_dir

    remote = wandb_dir(Storage("gs://bucket/runs/trm"))
    assert remote.startswith(os.environ["HARVEST_CACHE"])


def test_stream_and_shard_numbers_past_the_padded_widths_are_listed_and_read(tmp_path):
    st = Storage(str(tmp_path))
    for stream in (3, 99_999, 100_000, 1_234_567):
        st.write_bytes(fmt.lease_path(stream), b"{}")
    assert list_stream_dirs(st) == [3, 99_999, 100_000, 1_234_567]
    assert fmt.stream_dir(100_000) == "stream_100000"
    for shard in (999_999, 1_000_000, 12_345_678):
        st.write_bytes(fmt.sidecar_path(5, shard), b"{}")
        st.write_bytes(fmt.data_path(5, fmt.shard_file(shard, "0123456789abcdef")), b"")
        assert fmt.data_file_shard(fmt.shard_file(shard, "0123456789abcdef")) == shard
    assert sidecar_numbers(st, 5, "") == [999_999, 1_000_000, 12_345_678]
    # One name per number: a zero-padded name wider than the width names nothing.
    assert fmt.dir_stream("stream_000003") is None and fmt.sidecar_shard("shard_0000001.json") is None
    assert fmt.dir_stream("stream_00003") == 3 and fmt.sidecar_shard("shard_000001.json") == 1
