"""`harvest sae train --follow`: an SAE trained on a run while `harvest extract` writes it. The reader takes each
shard once as it is committed, in rounds, resumes mid-round from its state, and waits for shards (and for
run.json); the trainer, started before the extraction, ends its first epoch once every stream is complete
having used every token of the final run exactly once, with both processes SIGKILLed and rerun on the way.
What cannot be followed is refused in one line, and a stream started over while followed stops the trainer
in one line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import count_sidecars, harvest_cmd, is_complete, run_harvest, text_streams
from reader_helpers import RunWriter

from harvest.read import open_run
from harvest.storage import Storage

STREAMS = 3
BATCH = 128


# the reader -------------------------------------------------------------------------------------------
def test_a_followed_run_serves_each_token_once_across_rounds_waits_and_a_resume(tmp_path):
    """Shards committed between batches and while the reader waits (another thread), a state taken mid-way
    loaded into a fresh reader: over the first epoch every token is served exactly once, the rounds recorded
    cover each shard once, and the reader said what it waited for."""
    w = RunWriter(str(tmp_path / "run"), streams=2)
    w.shard(0, [30, 20])
    w.shard(1, [25, 5])
    book = Storage(str(tmp_path / "rounds"))
    settings = dict(seed=3, piece_bytes=40 * (4 + 2 * 40), follow=0.05, rounds=book, epochs=1)
    reader = open_run(w.storage.url).token_batches(8, **settings)
    it = iter(reader)
    served = [next(it)["tokens"] for _ in range(4)]
    w.shard(0, [40, 3])
    served += [next(it)["tokens"] for _ in range(6)]  # into round 1
    state = reader.state_dict()
    assert state["round"] == 1 and state["round_start"] == {"0": 1, "1": 1}

    def commit_later():
        time.sleep(0.3)
        w.shard(1, [17], final=True)
        time.sleep(0.3)
        w.shard(0, [9, 9], final=True)

    writer = threading.Thread(target=commit_later)
    writer.start()
    resumed = open_run(w.storage.url).token_batches(8, **settings)
    resumed.load_state_dict(state)
    served += [b["tokens"] for b in resumed]
    writer.join()
    counts = Counter(np.concatenate(served).tolist())
    assert counts.keys() == w.rows.keys() and set(counts.values()) == {1}
    rounds = [json.loads(p.read_text()) for p in sorted((tmp_path / "rounds" / "epoch_00000").glob("round_*.json"))]
    assert [r["start"] for r in rounds[1:]] == [r["end"] for r in rounds[:-1]] and rounds[0]["start"] == {}
    assert rounds[-1]["end"] == {"0": 3, "1": 2}
    assert json.loads((tmp_path / "rounds" / "epoch_00000" / "end.json").read_text())["rows"] == len(w.rows)


def test_a_reader_follows_alone(tmp_path):
    w = RunWriter(str(tmp_path / "run"), streams=2)
    w.shard(0, [30])
    run = open_run(w.storage.url)
    with pytest.raises(Exception, match="takes one consumer") as e:
        run.token_batches(8, follow=1.0, rank=0, world=2)
    assert "\n" not in str(e.value)


# the trainer --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sae-follow")
    checkpoint, env, streams = text_streams(root, STREAMS, n=240)
    return {"root": root, "checkpoint": checkpoint, "streams": streams,
            "env": {**env, "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache")}}


def extract_args(setup: dict, out: Path) -> list[str]:
    return ["extract", "--model", str(setup["checkpoint"]), "--data", str(setup["streams"]), "--out", str(out),
            "--points", "resid_post:1", "--dtype", "float32", "--max-seq-len", "64", "--batch-size", "2",
            "--shard-size", "64KB"]


def sae_cmd(run: Path, out: Path, tokens: int) -> list[str]:
    return harvest_cmd("sae", "train", "--run", str(run), "--out", str(out), "--tensors", "resid_post.1",
                       "--expansion", "2", "--k", "8", "--batch-tokens", str(BATCH), "--tokens", str(tokens),
                       "--warmup", "2", "--checkpoint-every", "4", "--log-every", "1", "--follow",
                       "--follow-poll", "0.2")


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def wait_for(what, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc is None or proc.poll() is None, f"the process ended ({proc.returncode}) first"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def saved_while_waiting(log: Path, sae: Path) -> int | None:
    """The last step the trainer logged, once it waits for shards with a checkpoint of that step."""
    steps = list(re.finditer(r"^step (\d+)/", log.read_text(), re.M))
    if not steps or "waiting for `harvest extract` to commit more" not in log.read_text()[steps[-1].end():]:
        return None
    return int(steps[-1][1]) if any(sae.glob(f"checkpoints/{steps[-1][1]}/*/process_00000.json")) else None


def assert_each_token_used_once(run: Path, sae: Path) -> None:
    """The rounds the SAE's reader recorded cover each shard of the complete run once, its first epoch served
    every token (less the special ones) once, and the trainer went on past that epoch."""
    final = open_run(str(run))
    rounds = [json.loads(p.read_text()) for p in sorted((sae / "follow" / "run_0" / "epoch_00000").glob("round_*"))]
    assert len(rounds) >= 2 and rounds[0]["start"] == {}
    assert [r["start"] for r in rounds[1:]] == [r["end"] for r in rounds[:-1]]
    assert rounds[-1]["end"] == {str(s): len(final.shards_of(s)) for s in range(STREAMS)}
    assert sum(r["tokens"] for r in rounds) == final.num_tokens
    special = set(final.info.special_token_ids)
    tokens = sum(int(np.isin(final.read_shard(sc)["tokens"], list(special), invert=True).sum()) for sc in final.shards)
    assert json.loads((sae / "follow" / "run_0" / "epoch_00000" / "end.json").read_text())["rows"] == tokens
    steps = [json.loads(line)["step"] for line in (sae / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] * BATCH > tokens


@pytest.mark.slow
def test_sae_follows_an_extraction_through_kills_of_both_and_uses_each_token_once(setup, tmp_path):
    """The trainer starts before the run exists (it waits for run.json); the extraction is SIGKILLed after a
    few commits; the trainer reads what was committed, says what it waits for, saves the step it reached, and
    is SIGKILLed; both are rerun (the extraction resumes its streams, the trainer that step and the rounds it
    recorded) and run side by side to the end: the first epoch used every token of the final run once."""
    run, sae, log = tmp_path / "run", tmp_path / "sae", tmp_path / "sae.log"
    trainer = start(sae_cmd(run, sae, 12_000), setup["env"], log)
    wait_for(lambda: "no run.json yet" in log.read_text(), proc=trainer)
    extraction = start(harvest_cmd(*extract_args(setup, run)), setup["env"], tmp_path / "extract.log")
    wait_for(lambda: count_sidecars(run) >= 4, proc=extraction)
    extraction.kill()
    extraction.wait()
    assert not is_complete(run, STREAMS)
    wait_for(lambda: saved_while_waiting(log, sae), proc=trainer)
    reached = saved_while_waiting(log, sae)
    trainer.kill()
    trainer.wait()
    before = len(log.read_text())
    extraction = start(harvest_cmd(*extract_args(setup, run)), setup["env"], tmp_path / "extract.log")
    trainer = start(sae_cmd(run, sae, 12_000), setup["env"], log)
    assert extraction.wait(timeout=120) == 0, (tmp_path / "extract.log").read_text()[-3000:]
    assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    rerun = log.read_text()[before:]
    assert is_complete(run, STREAMS) and re.search(r"^step (\d+)/", rerun, re.M)[1] == str(reached + 1), rerun[:3000]
    assert_each_token_used_once(run, sae)


def test_what_cannot_be_followed_is_refused_in_one_line(setup, tmp_path, capsys):
    from harvest.cli import main

    base = ["sae", "train", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "sae"), "--tensors",
            "resid_post.1", "--follow"]
    cases = [(["--normalize", "run-stats"], "--normalize run-stats needs the whole run's statistics"),
             (["--holdout-streams", "1", "--eval-every", "5"], "--eval-every reads held-out rows at the start"),
             (["--follow-poll", "0"], "--follow-poll 0")]
    for args, message in cases:
        assert main(base + args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (args, err)
        assert not (tmp_path / "sae").exists()


@pytest.mark.slow
def test_sigterm_while_the_trainer_waits_for_shards_saves_the_step_and_exits_75(setup, tmp_path):
    """A preemption notice while the trainer waits for an extraction's next shards (one that may itself be
    preempted and never commit them) ends the wait at once, not at the next listing: the step reached is saved,
    the trainer exits 75, and the rerun goes on from that step once the run is complete."""
    run, sae, log = tmp_path / "run", tmp_path / "sae", tmp_path / "sae.log"
    extraction = start(harvest_cmd(*extract_args(setup, run)), setup["env"], tmp_path / "extract.log")
    wait_for(lambda: count_sidecars(run) >= 4, proc=extraction)
    extraction.kill()
    extraction.wait()
    slow = [*sae_cmd(run, sae, 12_000)[:-1], "600"]  # a listing every 600 s: only SIGTERM ends the wait soon
    trainer = start(slow, setup["env"], log)
    wait_for(lambda: saved_while_waiting(log, sae), proc=trainer)
    reached = saved_while_waiting(log, sae)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=60) == 75, log.read_text()[-3000:]
    assert any(sae.glob(f"checkpoints/{reached}/*/process_00000.json"))
    before = len(log.read_text())
    assert run_harvest(*extract_args(setup, run), env=setup["env"]).returncode == 0
    trainer = start(sae_cmd(run, sae, 12_000), setup["env"], log)
    assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    rerun = log.read_text()[before:]
    assert re.search(r"^step (\d+)/", rerun, re.M)[1] == str(reached + 1), rerun[:3000]
    assert_each_token_used_once(run, sae)


@pytest.mark.slow
def test_a_stream_started_over_while_the_trainer_follows_it_stops_the_trainer_in_one_line(setup, tmp_path):
    """`--overwrite --streams 0` while the trainer follows the run: rounds counted shards without the stream's
    generation, and the epoch served stream 0's rows twice. Now the trainer stops (exit 2) with one line saying
    the stream started over, its rounds naming only the ended generation of stream 0."""
    run, sae, log = tmp_path / "run", tmp_path / "sae", tmp_path / "sae.log"
    assert run_harvest(*extract_args(setup, run), "--streams", "0", env=setup["env"]).returncode == 0
    trainer = start(sae_cmd(run, sae, 12_000), setup["env"], log)
    wait_for(lambda: saved_while_waiting(log, sae), proc=trainer)  # it read stream 0 and waits for streams 1, 2
    rounds = sae / "follow" / "run_0" / "epoch_00000"
    (generation,) = {json.loads(p.read_text())["generations"]["0"] for p in rounds.glob("round_*.json")}
    again = run_harvest(*extract_args(setup, run), "--overwrite", "--streams", "0", env=setup["env"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert trainer.wait(timeout=60) == 2, log.read_text()[-3000:]
    errors = [line for line in log.read_text().splitlines() if line.startswith("harvest: error:")]
    assert len(errors) == 1 and "stream 0 started over" in errors[0] and "start the reader over" in errors[0]
    assert {json.loads(p.read_text())["generations"]["0"] for p in rounds.glob("round_*.json")} == {generation}
