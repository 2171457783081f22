"""`harvest sae features` at scale, as a user runs it (real processes): memory stays flat as the run grows, two
processes splitting the run merge to exactly one's result, a pass killed mid-way and rerun ends with the bytes of
one never killed, and bad input is refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from extract_helpers import harvest_cmd, run_harvest

# Peak RSS of the pass over 4x the tokens stays within this of the 1x pass's (each rank 0 of 2: no build
# after it). What would grow: the pass holding anything per token, e.g. the 256 latents of the ~7.8k more
# tokens (8 MB as float32).
FLAT_MB = 4


def features(sae: str, out: Path, *more: str) -> list[str]:
    return harvest_cmd("sae", "features", sae, "--out", str(out), "--top", "5", "--bins", "2", "--per-bin", "3",
                       "--window", "2", "--batch-tokens", "64", *more)


def run_measured(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    """The process's own peak RSS (MB, from wait4), and how it ended."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    out, err = proc.stdout.read(), proc.stderr.read()
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    return usage.ru_maxrss / 1024, subprocess.CompletedProcess(cmd, code, out, err)


@pytest.fixture(scope="module")
def straight_all(straight, sae_source, tmp_path_factory):
    """One process over every stream (4x the held-out stream's tokens), and its peak memory."""
    out = tmp_path_factory.mktemp("features-all") / "out"
    peak, done = run_measured(features(straight, out, "--streams", "all"), sae_source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    return out, peak


def test_memory_stays_flat_as_the_run_grows(straight, sae_source, tmp_path):
    from harvest.sae.features.state import load_bytes

    peaks, states = [], []
    for streams in ("held-out", "all"):
        out = tmp_path / streams
        peak, done = run_measured(features(straight, out, "--streams", streams, "--rank", "0", "--world", "2"),
                                  sae_source["env"])
        assert done.returncode == 0, done.stderr[-3000:]
        peaks.append(peak)
        states.append(load_bytes((out / "scan" / "part-0-of-2.safetensors").read_bytes()))
    assert states[1][1].tokens > 3.5 * states[0][1].tokens
    # the state is O(latents): the same arrays whatever the tokens read
    sizes = [{t: {k: v.nbytes for k, v in s.arrays().items()} for t, s in st.items()} for st, _ in states]
    assert sizes[0] == sizes[1]
    assert peaks[1] - peaks[0] < FLAT_MB, peaks


def test_two_processes_merge_to_exactly_one(straight, sae_source, straight_all, tmp_path):
    from harvest.sae.features.state import load_bytes, merge

    out = tmp_path / "two"
    procs = [subprocess.Popen(features(straight, out, "--streams", "all", "--rank", str(r), "--world", "2"),
                              env=sae_source["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    said = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in said]
    assert any("open " in o for o, _ in said)  # the last to finish wrote the site
    one, _ = load_bytes((straight_all[0] / "scan" / "part-0-of-1.safetensors").read_bytes())
    parts = [load_bytes((out / "scan" / f"part-{r}-of-2.safetensors").read_bytes()) for r in range(2)]
    assert sum(p.tokens for _, p in parts) == load_bytes(
        (straight_all[0] / "scan" / "part-0-of-1.safetensors").read_bytes())[1].tokens
    merged = merge([s for s, _ in parts])
    for tensor, state in one.items():
        for name, value in state.arrays().items():
            assert value.tobytes() == merged[tensor].arrays()[name].tobytes(), name
    assert (out / "features.json").read_bytes() == (straight_all[0] / "features.json").read_bytes()
    assert _data(out) == _data(straight_all[0])


def test_killed_and_rerun_ends_as_never_killed(straight, sae_source, straight_all, tmp_path):
    out = tmp_path / "killed"
    slow = {**sae_source["env"], "HARVEST_TEST_FEATURES_SHARD_SECONDS": "0.05"}
    proc = subprocess.Popen(features(straight, out, "--streams", "all"), env=slow, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    state = out / "scan" / "rank-0-of-1.safetensors"
    deadline = time.monotonic() + 120
    while not state.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    assert proc.poll() is None, "the pass ended before it was killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "features.json").exists()
    done = run_harvest(*features(straight, out, "--streams", "all")[3:], env=sae_source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    straight_out = straight_all[0]
    assert (out / "scan" / "part-0-of-1.safetensors").read_bytes() == \
        (straight_out / "scan" / "part-0-of-1.safetensors").read_bytes()
    assert (out / "features.json").read_bytes() == (straight_out / "features.json").read_bytes()
    assert _data(out) == _data(straight_out)


def test_serve_serves_the_site(straight_all, sae_source):
    from processes import free_port

    port = free_port()
    proc = subprocess.Popen(harvest_cmd("sae", "features", "serve", str(straight_all[0]), "--port", str(port)),
                            env=sae_source["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/index.html", timeout=5) as page:
                    assert page.read() == (straight_all[0] / "index.html").read_bytes()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read()[-2000:]
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _data(out: Path) -> dict[str, bytes]:
    """The site's files (and any other output) but the pass's state and features.json."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and "scan" not in p.parts and p.name != "features.json"}


@pytest.mark.parametrize("case", ["not-sae", "no-held-out", "tensor", "rank", "settings"])
def test_bad_input_is_one_line_before_anything_is_written(case, straight, sae_source, straight_all, tmp_path):
    out = tmp_path / "out"
    sae, more = straight, []
    if case == "not-sae":
        sae = sae_source["run"]
    elif case == "no-held-out":  # another run (the same files by another name): none of its streams is held out
        (tmp_path / "other").symlink_to(sae_source["run"])
        more = ["--run", str(tmp_path / "other")]
    elif case == "tensor":
        more = ["--run", _run_without(sae_source["run"], "resid_post.1", tmp_path), "--streams", "all"]
    elif case == "rank":
        more = ["--rank", "2", "--world", "2"]
    else:
        out = straight_all[0]  # a finished pass made with --top 5
        more = ["--top", "7", "--streams", "all"]
    before = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None
    done = run_harvest(*features(sae, out, *more)[3:], env=sae_source["env"])
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("harvest: error: "), done.stderr
    after = sorted(p.relative_to(out) for p in out.rglob("*")) if out.exists() else None
    assert after == before


def _run_without(run: str, tensor: str, tmp_path: Path) -> str:
    """A run whose run.json holds every tensor of `run` but `tensor` (and no shard)."""
    info = json.loads((Path(run) / "run.json").read_text())
    del info["tensors"][tensor]
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "run.json").write_text(json.dumps(info))
    return str(other)
