"""Readers keyed by the stream's generation: shard numbers count within a generation, and an --overwrite (of some
streams, or of all with the same settings, which leaves run.json byte for byte the same) starts each stream it
covers over in a new one. A follower reading a run while `harvest extract` writes it stops with one line when a
stream it read starts over (harvest.read.rounds says why it does not go on), having served each shard of the
ended generation once and nothing of it after; its round book names the generations, so a rerun is refused
too. `Run.refresh()` after a full overwrite by another model serves the new bytes. Real extract processes
(the demo checkpoint, local disk) write while the follower reads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import harvest_cmd, run_harvest, text_streams, wait_stopped

from harvest.read import StartedOverError, open_run
from harvest.storage import Storage
from harvest.store.listing import stream_generation


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("generations")
    checkpoint, env, streams = text_streams(root, 2, n=120)
    return {"root": root, "checkpoint": checkpoint, "streams": streams,
            "env": {**env, "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache")}}


def extract(setup: dict, out: Path, *extra: str, model: Path | None = None) -> list[str]:
    return harvest_cmd("extract", "--model", str(model or setup["checkpoint"]), "--data", str(setup["streams"]),
                       "--out", str(out), "--points", "resid_post:1", "--dtype", "float32", "--max-seq-len", "64",
                       "--batch-size", "2", "--shard-size", "24KB", *extra)


def committed(out: Path, streams: str, shard: int | None = None) -> bool:
    """Whether a sidecar (of `shard`, or any) lies in a stream directory matching `streams`, in any generation."""
    name = "shard_*.json" if shard is None else f"shard_{shard:06d}.json"
    return any(out.glob(f"{streams}/{name}")) or any(out.glob(f"{streams}/*/{name}"))


def wait_for(what, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


class Follower(threading.Thread):
    """token_batches(follow=...) of one row at a time, in shard order, in a thread: every row served, and how
    it ended."""

    def __init__(self, out: Path, book: Path):
        super().__init__(daemon=True)
        self.reader = open_run(str(out)).token_batches(1, follow=0.05, rounds=Storage(str(book)), shuffle=False)
        self.served: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for batch in self.reader:
                self.served.append(int(batch["tokens"][0]))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            self.error = e


def round_tokens(book: Path, old: dict, out: Path) -> list[int]:
    """The rows the rounds recorded name, in order (shard order, rows left out as the reader leaves them out):
    shards of the ended generation from `old` ({(stream, generation, shard): tokens}), others from the run."""
    run = open_run(str(out))
    special = set(run.info.special_token_ids)
    rows = []
    for path in sorted((book / "epoch_00000").glob("round_*.json")):
        r = json.loads(path.read_text())
        for s, end in sorted(r["end"].items(), key=lambda item: int(item[0])):
            for k in range(r["start"].get(s, 0), end):
                key = (int(s), r["generations"][s], k)
                tokens = old[key] if key in old else run.read_shard(run.shards_of(int(s))[k])["tokens"]
                rows += [int(t) for t in tokens if int(t) not in special]
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("first, stop, again", [
    (("--streams", "0"), None, ("--overwrite", "--streams", "0")),
    (("--overwrite", "--lease-ttl", "2"), "1:2", ("--overwrite", "--lease-ttl", "2"))],
    ids=["partial overwrite", "identical full overwrite"])
def test_a_follower_stops_when_a_stream_it_read_starts_over(setup, tmp_path, first, stop, again):
    """An extraction writes while the follower reads: stream 0 alone (the run is not complete: the follower then
    waits for stream 1), or both streams until the process is stalled before a commit and killed. Then an
    --overwrite starts stream 0 over (of it alone, or of all with the first command's settings: run.json stays
    byte for byte the same). The follower stops with one line: it served each shard of the ended generations
    once, in the rounds it recorded, and nothing after; a rerun with the same round book is refused too, and so
    is a reader's state saved before the overwrite (it counts shards of the ended generations), and a rank
    given a snapshot taken before it."""
    out, book = tmp_path / "run", tmp_path / "rounds"
    env = {**setup["env"], **({"HARVEST_TEST_STOP_BEFORE_COMMIT": stop} if stop else {})}
    writer = subprocess.Popen(extract(setup, out, *first), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: committed(out, "stream_*"))
        follower = Follower(out, book)
        follower.start()
        if stop:  # stalled before committing stream 1's shard 2, then killed: its leases go stale after 2 s
            wait_for(lambda: committed(out, "stream_00001", 1))
            wait_stopped(writer.pid)
            writer.kill()
        assert writer.wait(timeout=180) == (-9 if stop else 0)
    finally:
        writer.kill()
    before = open_run(str(out))
    generations = {s: stream_generation(before.storage, s) for s in before.streams}
    old = {(sc.stream, generations[sc.stream], sc.shard): before.read_shard(sc)["tokens"] for sc in before.shards}
    special = set(before.info.special_token_ids)
    everything = [int(t) for tokens in old.values() for t in tokens if int(t) not in special]
    wait_for(lambda: len(follower.served) == len(everything))  # it read every committed shard, and waits
    run_json = (out / "run.json").read_bytes()
    plain = before.token_batches(4, seed=1)  # a reader of what is committed, stopped after one batch
    next(iter(plain))
    state = plain.state_dict()
    snapshot = json.loads(json.dumps(before.snapshot()))  # as ranks share it

    done = run_harvest(*extract(setup, out, *again)[3:], env=setup["env"], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    follower.join(timeout=60)
    assert not follower.is_alive() and isinstance(follower.error, StartedOverError), follower.error
    message = str(follower.error)
    assert re.search("streams? 0(, 1)? started over", message) and "start the reader over" in message
    assert "\n" not in message
    assert stream_generation(before.storage, 0) != generations[0]
    assert (out / "run.json").read_bytes() == run_json  # nothing but the generations tells the overwrite
    rounds = [json.loads(p.read_text()) for p in sorted((book / "epoch_00000").glob("round_*.json"))]
    for s, generation in generations.items():
        mine = [r for r in rounds if str(s) in r["end"]]
        assert all(r["generations"][str(s)] == generation for r in mine)
        assert [r["start"].get(str(s), 0) for r in mine[1:]] == [r["end"][str(s)] for r in mine[:-1]]
        assert mine[-1]["end"][str(s)] == len(before.shards_of(s))  # every shard of the ended generation, once
    assert follower.served == round_tokens(book, old, out)  # the rows of the rounds recorded, in order
    assert Counter(follower.served) == Counter(everything)  # so each row once, and no row of the new generation

    rerun = open_run(str(out)).token_batches(1, follow=0.05, rounds=Storage(str(book)), shuffle=False)
    with pytest.raises(StartedOverError, match="streams? 0(, 1)? started over"):
        next(iter(rerun))
    resumed = open_run(str(out)).token_batches(4, seed=1)  # its state counts shards of the ended generations
    resumed.load_state_dict(state)
    with pytest.raises(StartedOverError, match="streams? 0(, 1)? started over"):
        next(iter(resumed))
    later = open_run(str(out))  # a rank that lists the run after the overwrite, given the snapshot taken before
    with pytest.raises(StartedOverError, match="streams? 0(, 1)? started over"):
        next(iter(later.token_batches(4, seed=1, rank=1, world=2, snapshot=snapshot)))
    with pytest.raises(StartedOverError, match="streams? 0(, 1)? started over"):
        later.torch_dataset(4, rank=1, world=2, snapshot=snapshot)


@pytest.mark.slow
def test_a_follower_that_finds_run_json_gone_stops_as_started_over(setup, tmp_path):
    """A full --overwrite ends every stream's generation, deletes run.json and writes it again: a follower that
    lists the run in that window stops with the same line as one that lists it before or after (it was a CI
    flake: "no run.json here, so not a harvest run")."""
    out, book = tmp_path / "run", tmp_path / "rounds"
    done = run_harvest(*extract(setup, out, "--streams", "0")[3:], env=setup["env"], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    follower = Follower(out, book)
    follower.start()
    wait_for(lambda: (book / "epoch_00000").is_dir() and follower.served)  # it read stream 0 and waits for 1
    (out / "run.json").unlink()
    follower.join(timeout=60)
    assert not follower.is_alive() and isinstance(follower.error, StartedOverError), follower.error
    assert "run.json went while the run was being read" in str(follower.error)


def other_model(checkpoint: Path, to: Path) -> Path:
    """The demo checkpoint with its embeddings scaled: another model, the same shapes and tokenizer."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(checkpoint, to)
    weights = load_file(str(to / "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"] * np.float32(1.5)
    save_file(weights, str(to / "model.safetensors"))
    return to


@pytest.mark.slow
def test_refresh_after_a_full_overwrite_by_another_model_reads_the_new_bytes(setup, tmp_path):
    out = tmp_path / "run"
    assert run_harvest(*extract(setup, out)[3:], env=setup["env"], timeout=180).returncode == 0
    run = open_run(str(out))
    old = run.sample(0).activations["resid_post.1"].copy()
    other = other_model(setup["checkpoint"], tmp_path / "other")
    done = run_harvest(*extract(setup, out, "--overwrite", model=other)[3:], env=setup["env"], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    new = open_run(str(out)).sample(0).activations["resid_post.1"]
    assert not np.array_equal(new, old)
    run.refresh()
    assert run.info.model["source"] == str(other)
    np.testing.assert_array_equal(run.sample(0).activations["resid_post.1"], new)


def test_a_listing_begun_before_an_overwrite_that_meets_its_deletions_says_started_over(tmp_path, monkeypatch):
    """The interleaving the follower above can meet: it reads stream 0's generation, an --overwrite swaps the
    generation pointer and deletes the ended generation's shards, and the follower lists what is left of them (a
    gap: shard 0 gone, later ones there). That is the stream starting over, not a shard lost from storage."""
    from fake_runs import fake_run

    from harvest.store import format as fmt
    from harvest.store import listing
    from harvest.store.records import GenerationRecord
    from harvest.store.snapshot import Snapshot

    storage = fake_run(tmp_path).storage
    before = Snapshot.take(storage)
    assert before.generations()[0] == "" and len(before.of_stream(0)) > 1
    storage.write_bytes(f"{fmt.stream_dir(0)}/{fmt.GENERATION}", GenerationRecord("ab" * 8, [""]).to_bytes())
    storage.delete(fmt.sidecar_path(0, 0))  # the wipe's deletions, under way
    monkeypatch.setattr(listing, "stream_generation", lambda storage, stream: "")  # read before the swap
    with pytest.raises(StartedOverError, match="stream 0 started over"):
        before.grown(storage)
