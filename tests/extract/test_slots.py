"""A mesh's data slots with no stream to take compute padding: the worker says so at start, in one line with
what to do, and `harvest status` shows it; with a stream for every slot, neither says a word."""

from extract_helpers import run_harvest, text_streams, write_text_dataset

IDLE = "data slots this process feeds have no stream to take"


def extract(checkpoint, data, out, env):
    done = run_harvest("extract", "--model", str(checkpoint), "--data", str(data), "--out", str(out),
                       "--mesh", "data=4", "--points", "resid_post:1", "--max-seq-len", "128", "--batch-size", "2",
                       env=env)
    assert done.returncode == 0, done.stderr
    return done.stderr, run_harvest("status", str(out), env=env).stdout


def test_idle_slots_are_named_at_start_and_in_status(tmp_path):
    checkpoint, env, streams = text_streams(tmp_path, num_streams=4, n=40, devices=4)
    plain = write_text_dataset(tmp_path / "plain.jsonl", n=40)  # a plain file is one stream

    log, status = extract(checkpoint, plain, tmp_path / "one-stream", env)
    said = [line for line in log.splitlines() if IDLE in line]
    assert len(said) == 1 and "3 of the 4 data slots" in said[0] and "(1 stream left for them)" in said[0], log
    assert "harvest streams create --num-streams N" in said[0] and "--mesh fewer data slots" in said[0]
    flat = " ".join(status.split())
    assert "computed 3 of its 4 data slots as padding" in flat, status

    log, status = extract(checkpoint, streams, tmp_path / "four-streams", env)
    assert IDLE not in log and "idle slots" not in status, (log, status)
