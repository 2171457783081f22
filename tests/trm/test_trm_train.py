"""harvest train with a TRM model, on generated sudokus: a run SIGKILLed at a random step and then SIGTERMed
(exit 75) resumes to the state of a run never interrupted (weights, AdamATan2, EMA, puzzle embeddings, carry);
a checkpoint in a bucket resumes on a fresh machine; 2 processes x 4 devices equal 1 device; bad input (a
mesh that does not fit, an unknown preset, processes with different settings) is one line, exit 2, nothing
written; ARC's pass@K undoes each augmentation and votes as the reference's evaluator; and (slow) a small TRM
learns 6x6 sudokus to >= 90% exact test accuracy, measured by `harvest train eval`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import harvest_cmd, harvest_env, run_harvest
from preemption import kill_hold_resume, preempt, resume
from processes import free_port, run_processes, two_process_env
from training_helpers import assert_trees_close, metrics
from trm_helpers import STEPS, TINY, build_sudokus, train_args


@pytest.fixture(scope="module")
def straight(sudokus) -> str:
    out = str(sudokus["root"] / "straight")
    done = run_harvest(*train_args(sudokus["data"], out), env=sudokus["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def restored(out: str) -> dict:
    """The newest checkpoint's whole tree: state (params, opt_state, ema, puzzle_emb, states, key) and carry."""
    import jax

    from harvest.trm.evaluate import load_run

    *_, state = load_run(out)
    return jax.device_get(state)


def test_killed_and_preempted_runs_resume_to_the_uninterrupted_state(sudokus, straight, tmp_path):
    """SIGKILL at a random step, then the same command held at STEPS-1 and SIGTERMed (exit 75, a checkpoint at
    STEPS-1), then the same command to the end: the whole state and the carry equal the straight run's (1e-6);
    metrics.jsonl has every step once; status shows the run."""
    from rich.console import Console

    from harvest.training.status import training_status

    out = str(tmp_path / "run")
    kill_hold_resume(train_args(sudokus["data"], out), sudokus["env"], STEPS)
    ours, theirs = restored(out), restored(straight)
    assert {"params", "opt_state", "ema", "puzzle_emb", "carry"} <= set(ours)
    assert_trees_close(ours, theirs, rtol=1e-6)
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"loss", "exact_accuracy", "halt_step", "tokens_per_s"} <= set(records[-1])
    console = Console(width=200, record=True)
    console.print(training_status(out))
    text = console.export_text()
    assert f"{STEPS}/{STEPS}" in text and "TRM" in text and "sudoku" in text, text


def test_checkpoint_in_a_bucket_resumes_on_a_fresh_machine(sudokus, straight, tmp_path, gcs_url):
    """SIGTERMed at step 5 with --out in a bucket, then rerun with an empty cache (no staging): it resumes
    from the bucket to the straight run's state."""
    servers = {k: v for k, v in os.environ.items() if k not in sudokus["env"]}  # the emulator's endpoint
    env = {**sudokus["env"], **servers}
    preempt(train_args(sudokus["data"], gcs_url), env, hold_at=5)
    resume(train_args(sudokus["data"], gcs_url), {**env, "HARVEST_CACHE": str(tmp_path / "another-machine")}, after=5)
    assert_trees_close(restored(gcs_url), restored(straight), rtol=1e-6)


def test_two_processes_equal_one_device_and_disagreeing_ones_stop(sudokus, tmp_path):
    """2 processes x 4 devices (the batch and the carry over data=8) against one device: the state and the carry
    after 4 steps agree to 1e-5 (AdamATan2's moments, gradients, to 2e-4 of their scale), and so do the losses.
    Then the 2 processes with different settings: both exit 2, nothing written.

    Learning rates 1e-6: AdamATan2's first steps move every weight by +-lr (atan2(m, sqrt v) does not depend on
    the gradient's size), and sign-SGD every embedding entry, so an entry whose gradient is rounding noise moves
    by +-lr depending on its last bits, which differ between meshes (summation order); at 1e-6 that stays under
    the tolerance while a misplaced row of the batch or the carry does not."""
    settings = {"steps": 4, "checkpoint_every": 100}
    tiny = {**TINY, "lr": 1e-6, "puzzle_emb_lr": 1e-6}
    two = str(tmp_path / "two")

    def processes(out: str, models: list[dict]) -> list[int]:
        address = f"127.0.0.1:{free_port()}"
        return run_processes([harvest_cmd(*train_args(sudokus["data"], out, model, **settings), "--coordinator",
                                          address, "--num-processes", "2", "--process-id", str(pid))
                              for pid, model in enumerate(models)], two_process_env(tmp_path), tmp_path)

    codes = processes(two, [tiny, tiny])
    assert codes == [0, 0], [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    one = str(tmp_path / "one")
    done = run_harvest(*train_args(sudokus["data"], one, tiny, **settings),
                       env={**sudokus["env"], "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = restored(two), restored(one)
    # AdamATan2's moments are raw gradients, sums with cancellation: their last bits follow the summation order.
    assert_trees_close(ours.pop("opt_state"), theirs.pop("opt_state"), rtol=2e-4)
    assert_trees_close(ours, theirs, rtol=1e-5)
    losses = [[r["loss"] for r in metrics(out)] for out in (two, one)]
    np.testing.assert_allclose(*losses, rtol=1e-5)
    assert len(losses[0]) == 4

    differ = str(tmp_path / "differ")
    codes = processes(differ, [tiny, {**tiny, "H_cycles": 3}])
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    assert codes == [2, 2], logs
    assert all("processes disagree on the TRM training settings" in log for log in logs), logs
    assert not Path(differ).exists()


def test_bad_input_is_one_line_exit_2_and_nothing_written(sudokus, tmp_path, capsys):
    from harvest.cli import main

    out = tmp_path / "out"
    base = ["train", "--out", str(out), "--steps", "4"]
    model = json.dumps(TINY)
    cases = [
        (["--model", model, "--data", sudokus["data"], "--mesh", "data=3"], "3 devices, but there are 8"),
        (["--model", model, "--data", sudokus["data"], "--mesh", "model=8"], "a TRM is replicated"),
        (["--model", model, "--data", sudokus["data"], "--batch-size", "12"], "not a multiple of the mesh's 8"),
        (["--model", model, "--data", sudokus["data"], "--batch-size", "4096"], "has only 200 examples"),
        (["--model", json.dumps({**TINY, "preset": "trm-sudoku"}), "--data", sudokus["data"]],
         "unknown TRM preset 'trm-sudoku'"),
        (["--model", json.dumps({**TINY, "H_cycle": 2}), "--data", sudokus["data"]], "unknown TRM settings H_cycle"),
        (["--model", json.dumps({**TINY, "H_cycles": 0}), "--data", sudokus["data"]], "--H-cycles 0: must be at least"),
        (["--model", model, "--data", sudokus["data"], "--lr", "0.1"], "--lr: not a TRM setting"),
        (["--model", model, "--data", str(tmp_path)], "no complete puzzle dataset there"),
    ]
    for args, message in cases:
        assert main(base + args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harvest: error:") and message in err[0], (args, err)
        assert not out.exists(), args


ARC_TASKS = {  # two tiny tasks: flip left-right; recolour 1 -> 2
    "flip": {"train": [{"input": [[1, 0], [2, 3]], "output": [[0, 1], [3, 2]]},
                       {"input": [[4, 5, 0]], "output": [[0, 5, 4]]}],
             "test": [{"input": [[0, 6], [7, 0], [1, 1]], "output": [[6, 0], [0, 7], [1, 1]]}]},
    "recolour": {"train": [{"input": [[1, 1], [0, 1]], "output": [[2, 2], [0, 2]]}],
                 "test": [{"input": [[1, 0, 3]], "output": [[2, 0, 3]]},
                          {"input": [[0], [1]], "output": [[0], [2]]}]},
}


def test_arc_pass_at_k_undoes_augmentations_and_votes(tmp_path):
    """Predictions made in each augmented version's frame: right answers score pass@1 1 (the undoing is right);
    with half the versions of a pair voting for one wrong grid, the tie goes to the higher mean halting
    confidence, so pass@1 follows the confidence and pass@2 holds either way; a task without a right vote is 0."""
    from harvest.data.arc import dihedral
    from harvest.puzzles.arc import encode
    from harvest.puzzles.build import build_puzzles
    from harvest.puzzles.config import PuzzlesConfig
    from harvest.puzzles.format import open_puzzles
    from harvest.trm.evaluate import arc_pass_at

    for subset in ("training", "evaluation"):
        (tmp_path / "arc" / subset).mkdir(parents=True)
        for name, task in ARC_TASKS.items():
            (tmp_path / "arc" / subset / f"{name}.json").write_text(json.dumps(task))
    build_puzzles("arc", PuzzlesConfig(out=str(tmp_path / "data"), source=str(tmp_path / "arc"), augment=3))
    dataset = open_puzzles(str(tmp_path / "data"))
    split = dataset.split("test")
    ids = dataset.arrays("identifiers")
    names = json.loads(dataset.read_file("tasks.json"))["names"]

    def predictions(answer_of) -> np.ndarray:
        """Each example's prediction: answer_of(task, pair, version) in the original frame, augmented as its
        identifier says and encoded."""
        preds = np.zeros_like(split["labels"])
        for p, identifier in enumerate(split["puzzle_identifiers"]):
            version = p % 4
            for pair, example in enumerate(range(split["puzzle_indices"][p], split["puzzle_indices"][p + 1])):
                grid = np.asarray(answer_of(names[ids["task"][identifier]], pair, version), np.uint8)
                preds[example] = encode(dihedral(ids["colours"][identifier][grid], int(ids["dihedral"][identifier])))
        return preds

    def right(name, pair, version):
        return ARC_TASKS[name]["test"][pair]["output"]

    assert len(split["puzzle_identifiers"]) == 2 * 4  # each task as given and 3 augmentations
    q = np.zeros(len(split["inputs"]))
    assert arc_pass_at(dataset, split, split["labels"], q, ks=(1, 2)) == {"pass@1": 1.0, "pass@2": 1.0}
    wrong = [[9, 9]]

    def half_wrong(name, pair, version):
        return wrong if name == "flip" and version >= 2 else right(name, pair, version)

    preds = predictions(half_wrong)
    starts = split["puzzle_indices"]
    wrong_examples = np.array([names[ids["task"][split["puzzle_identifiers"][p]]] == "flip" and p % 4 >= 2
                               for p in range(8) for _ in range(starts[p + 1] - starts[p])])
    confident_wrong = np.where(wrong_examples, 2.0, -1.0)
    assert arc_pass_at(dataset, split, preds, confident_wrong, ks=(1, 2)) == {"pass@1": 0.5, "pass@2": 1.0}
    assert arc_pass_at(dataset, split, preds, -confident_wrong, ks=(1, 2)) == {"pass@1": 1.0, "pass@2": 1.0}

    def recolour_wrong(name, pair, version):
        return wrong if name == "recolour" and pair == 1 else right(name, pair, version)

    assert arc_pass_at(dataset, split, predictions(recolour_wrong), q, ks=(1,)) == {"pass@1": 0.75}


@pytest.mark.slow
def test_a_small_trm_learns_6x6_sudokus(tmp_path):
    """The README's CPU setup (token MLP, hidden 64, H 2 x L 2, 8 supervision steps, batch 64, AdamATan2 lr 3e-3,
    warmup 20, no EMA) on 2000 generated 6x6 sudokus x 20 augmentations: `harvest train eval` gives >= 90%
    exact accuracy on 200 test sudokus after 600 steps (measured: see the report)."""
    data = build_sudokus(tmp_path / "sudoku6", 6, 2000, 20, 200)
    model = {"type": "trm", "mlp_t": True, "pos_encodings": "none", "hidden": 64, "heads": 4, "expansion": 4,
             "H_cycles": 2, "L_cycles": 2, "halt_max_steps": 8, "puzzle_emb_ndim": 64, "puzzle_emb_len": 1,
             "lr": 3e-3, "warmup": 20, "ema_rate": None}
    env = {**harvest_env(tmp_path / "cache"), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    out = str(tmp_path / "run")
    done = run_harvest(*train_args(data, out, model, batch_size=64, steps=600, log_every=100, checkpoint_every=1000),
                       env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    done = run_harvest("train", "eval", out, "--data", data, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["examples"] == 200 and result["step"] == 600
    assert result["exact_accuracy"] >= 0.9, result
