"""The `harvest` command as a user runs it: the demo works offline, bad flags give one line and exit 2."""

import json
import os
import subprocess
import sys

from extract_helpers import committed

from harvest.storage import Storage


def harvest(*args, tmp_path, **env_vars):
    env = {**os.environ, "HARVEST_CACHE": str(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           **env_vars}
    return subprocess.run([sys.executable, "-m", "harvest", *args], capture_output=True, text=True, env=env, timeout=300)


def test_demo_runs_the_whole_pipeline_offline(tmp_path):
    """The demo's steps on the tiny model (tests/model/test_gguf.py runs SmolLM2 itself)."""
    result = harvest("demo", "--model", "tiny", "--texts", "6", "--tasks", "6",
                     "--points", "resid_post:0-1,mlp_hidden:1",
                     "--sae-steps", "4", "--eval-texts", "2", "--eval-tokens", "256", "--out", str(tmp_path / "run"),
                     tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("2 streams [3, 3]") == 2
    assert result.stdout.count("verify: OK") == 2
    for run in ("text-run", "arc-run"):
        assert sorted(p.name for p in (tmp_path / "run" / run).iterdir()) == ["run.json", "stream_00000",
                                                                               "stream_00001"]
    assert "CE loss recovered" in result.stdout and "SAE.load_from_disk" in result.stdout
    assert (tmp_path / "run" / "saelens" / "resid_post.1" / "cfg.json").exists()  # the last point in capture order
    assert (tmp_path / "demo-qwen2-v2" / "tokenizer.json").exists()


def test_demo_checkpoint_is_the_same_bytes_every_time(tmp_path):
    from harvest.demo import demo_checkpoint

    a = (demo_checkpoint(tmp_path / "a") / "model.safetensors").read_bytes()
    b = (demo_checkpoint(tmp_path / "b") / "model.safetensors").read_bytes()
    assert a == b


def test_a_repeated_run_loads_its_compiled_forward_from_the_cache_and_writes_the_same_bytes(tmp_path):
    from harvest.demo import demo_checkpoint

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": "hello world " * n}) + "\n" for n in range(3, 13)))
    model = demo_checkpoint(tmp_path)
    # The demo model compiles in under JAX's 1 s threshold for keeping a program; log each hit.
    env = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_LOG_COMPILES": "1"}
    hit = "Persistent compilation cache hit for 'jit_step'"
    runs = {}
    for name, flags in (("first", ()), ("uncached", ("--no-compile-cache",)), ("repeat", ())):
        runs[name] = harvest("extract", "--model", str(model), "--data", str(data), "--out", str(tmp_path / name),
                             "--points", "resid_post:1", "--max-seq-len", "64", *flags, tmp_path=tmp_path, **env)
        assert runs[name].returncode == 0, runs[name].stderr
    assert [hit in runs[name].stderr for name in runs] == [False, False, True]
    assert any((tmp_path / "jax").glob("jit_step-*"))
    first, repeat = (committed(Storage(str(tmp_path / name))) for name in ("first", "repeat"))
    assert first[0] and first == repeat and not first[1]


def test_bad_flag_values_end_in_one_line_exit_2(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    for args, expected in (
        (("demo", "--model", "tiny", "--tasks", "2", "--points", "resid_post:7"),
         "layer 7 does not exist; the model has layers 0-3"),
        (("extract", "--model", str(tmp_path), "--data", "x.jsonl"), "missing --out"),
        (("extract", "--model", "/no/model", "--data", "x.jsonl", "--out", str(tmp_path / "o"), "--format", "csv"),
         "--format 'csv': choose one of text, chat, arc"),
        (("extract", "--model", "/no/model", "--data", "x.jsonl", "--out", str(tmp_path / "o")),
         "--model /no/model: no such directory"),
        (("streams", "create", "--data", str(data), "--num-streams", "2", "--out", str(data / "sub")),
         f"{data} is a file, not a directory"),
    ):
        result = harvest(*args, tmp_path=tmp_path)
        assert result.returncode == 2
        assert result.stderr.strip().count("\n") == 0 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_help_names_the_commands(tmp_path):
    result = harvest("--help", tmp_path=tmp_path)
    assert result.returncode == 0 and "demo" in result.stdout


def test_harvest_runs_from_a_source_tree_that_was_never_installed(tmp_path):
    """An accelerator host runs harvest from a checkout's src/ on PYTHONPATH, with no package metadata: the
    version that run.json and --version record says so instead of failing every command."""
    import shutil

    import harvest

    src = tmp_path / "src"
    shutil.copytree(os.path.dirname(harvest.__file__), src / "harvest")
    code = ("import importlib.metadata as m, sys\n"
            "real = m.version\n"
            "def version(name):\n"
            "    if name in ('harvest', 'harvest-activations'):\n"  # the distribution's name, and its old one
            "        raise m.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "m.version = version\n"
            "sys.argv = ['harvest', '--version']\n"
            "from harvest.cli import main\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(src)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-800:]
    assert done.stdout.strip() == "harvest 0+source"
