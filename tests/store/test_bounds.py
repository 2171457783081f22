"""What bounds an extraction (harvest.store.bounds): the stages' waits in shares of the run's time, the bound
the summary and `harvest status` name, and the bytes per token stored."""

from __future__ import annotations

import json
import re
import threading

import pytest

from extract_helpers import harvest_env, run_harvest

from harvest.extract.report import Progress, summarize
from harvest.storage import Storage
from harvest.store.commit import ResumePoint
from harvest.store import format as fmt
from harvest.store.bounds import ADVICE, Shares, Waits
from harvest.store.listing import read_chain
from harvest.store.records import Progress as ProgressRecord


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def waited(waits: Waits, clock: Clock, stage: str, seconds: float) -> None:
    with waits.on(stage):
        clock.now += seconds


def test_the_window_opens_with_the_first_item_and_the_stage_waited_on_most_binds():
    clock = Clock()
    waits = Waits(clock)
    with waits.on("chip"):  # the host waiting through the compile, then the first forward
        clock.now += 30.0
        assert waits.shares() == Shares(0.0, 0.0, 0.0, 0.0, 0.0) and waits.shares().bound == ""
        waited(waits, clock, "feeder", 1.0)  # the forward's first batch: the window opens as it arrives
        clock.now += 2.0  # the first forward: the host's wait counts from the window's opening
    waited(waits, clock, "feeder", 2.0)
    waited(waits, clock, "chip", 1.0)
    clock.now += 1.0  # the host's own work
    waited(waits, clock, "storage", 4.0)
    shares = waits.shares()
    assert shares == Shares(window_s=10.0, chip=0.1, host=0.3, storage=0.4, feeder=0.2)
    assert shares.bound == "storage" and shares.bound_share == 0.4
    assert shares.line() == f"bound: storage (chip 10%, host 30%, storage 40%, feeder 20% of 10.0 s): " \
                            f"{ADVICE['storage']}"
    clock.now += 10.0  # live: the host working since its last wait
    live = waits.shares(live=True)
    assert live.bound == "host" and live.window_s == 20.0 and live.host == pytest.approx(0.65)


def test_a_wait_that_ends_in_an_exception_counts_but_opens_nothing():
    clock = Clock()
    waits = Waits(clock)
    with pytest.raises(TimeoutError), waits.on("chip"):
        clock.now += 5.0
        raise TimeoutError
    assert waits.shares().window_s == 0.0
    waited(waits, clock, "chip", 1.0)
    with pytest.raises(TimeoutError), waits.on("chip"):
        clock.now += 5.0
        raise TimeoutError
    assert waits.shares() == Shares(window_s=5.0, chip=1.0, host=0.0, storage=0.0, feeder=0.0)
    with pytest.raises(ValueError, match="unknown stage 'disk'"), waits.on("disk"):
        pass


def test_a_timed_queue_times_its_gets_across_threads():
    waits = Waits()
    q = waits.queue("chip", 2)
    q.put("first")
    assert q.get() == "first"  # opens the window
    timer = threading.Timer(0.3, q.put, ["second"])
    timer.start()
    assert q.get() == "second"
    timer.join()
    shares = waits.shares()
    assert shares.bound == "chip" and shares.chip > 0.9 and shares.window_s >= 0.3


def test_older_progress_records_read_without_a_bound_and_new_ones_round_trip():
    old = {"stream": 0, "records_done": 5, "total": None, "shards": 1, "tokens_per_s": 10.0, "worker": "w",
           "updated_at": "2026-01-01T00:00:00+00:00", "done": False, "packing": [3, 4]}
    record = ProgressRecord.from_json(old)
    assert (record.bound, record.bound_share) == ("", 0.0)
    new = ProgressRecord(**{**old, "packing": (3, 4), "bound": "host", "bound_share": 0.71})
    assert ProgressRecord.from_bytes(new.to_bytes()) == new
    with pytest.raises(ValueError, match="bound_share"):
        ProgressRecord.from_json({**old, "bound": "host", "bound_share": "most"})


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    """One `harvest extract` of the demo model on a few texts, and its stdout."""
    from harvest.demo import demo_checkpoint

    root = tmp_path_factory.mktemp("bounds")
    env = harvest_env(root / "cache", devices=2)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "the residual stream " * n}) + "\n" for n in range(2, 40)))
    out = root / "run"
    done = run_harvest("extract", "--model", str(demo_checkpoint(root / "cache")), "--data", str(data), "--out",
                       str(out), "--points", "resid_post:0-1", "--max-seq-len", "64", "--shard-size", "20KB",
                       env=env)
    assert done.returncode == 0, done.stderr
    return out, env, done.stdout


def _status(out, env) -> str:
    shown = run_harvest("status", str(out), env={**env, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def test_status_shows_bytes_per_token_stored_and_the_bound_each_worker_recorded(extracted):
    out, env, _ = extracted
    storage = Storage(str(out))
    chain = read_chain(storage, 0)
    per_token = sum(sc.bytes for sc in chain) / sum(sc.tokens for sc in chain)
    path = fmt.progress_path(0)
    record = ProgressRecord.from_bytes(storage.read_bytes(path))
    storage.write_bytes(path, ProgressRecord(**{**record.__dict__, "bound": "storage", "bound_share": 0.62}).to_bytes())
    try:
        text = _status(out, env)
    finally:
        storage.write_bytes(path, record.to_bytes())
    assert f"{per_token:,.0f} B" in text
    assert "storage 62%" in text and f"bound storage: {ADVICE['storage'][:40]}" in " ".join(text.split())
    # each tensor's values per token: 64 wide in bfloat16 (the demo model), no scale
    assert "resid_post.0 128 B, resid_post.1 128 B (bfloat16)" in text


def test_the_summary_names_the_bound_and_the_bytes_per_token_stored(extracted):
    out, _, _ = extracted
    storage = Storage(str(out))
    clock = Clock()
    progress = Progress(storage, {0: None}, {0: ResumePoint()}, worker="w")
    progress.waits = Waits(clock)
    waited(progress.waits, clock, "feeder", 0.5)  # the forward's first batch: the window opens
    waited(progress.waits, clock, "chip", 1.0)
    clock.now += 3.0  # the host's own work
    waited(progress.waits, clock, "chip", 0.0)  # the host takes the end of the captures: the window's end
    summary = summarize(storage, [0], elapsed=5.0, progress=progress)
    chain = read_chain(storage, 0)
    assert summary["bytes_per_token"] == round(sum(sc.bytes for sc in chain) / sum(sc.tokens for sc in chain), 1)
    assert summary["waits"] == {"window_s": 4.0, "chip": 0.25, "host": 0.75, "storage": 0.0, "feeder": 0.0}
    assert summary["bound"] == f"bound: host (chip 25%, host 75%, storage 0%, feeder 0% of 4.0 s): {ADVICE['host']}"


def test_a_real_run_names_its_bound_in_the_summary_and_in_status(extracted):
    out, env, stdout = extracted
    found = re.search(r"^bound: (chip|host|storage|feeder) \(chip \d+%, host \d+%, storage \d+%, feeder \d+% of "
                      r"[\d.]+ s\): ", stdout, re.M)
    assert found, stdout
    record = ProgressRecord.from_bytes(Storage(str(out)).read_bytes(fmt.progress_path(0)))
    assert record.bound in ADVICE and 0 < record.bound_share <= 1
    assert f"{record.bound} {record.bound_share:.0%}" in _status(out, env)
