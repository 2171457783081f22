"""A decoder's train step over a mesh equals the single-device step: 8 devices with gradient accumulation,
and 2 processes x 4 devices; processes whose settings differ stop with the differing key, writing nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hf_reference as ref
import numpy as np
import pytest
from extract_helpers import harvest_cmd
from processes import free_port, run_processes, two_process_env
from training_helpers import TINY_SHAPE, assert_trees_close

HERE = Path(__file__).resolve().parents[1]  # the workers live beside the shared helpers, in tests/


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    return ref.build_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_layers=2)


def test_sharded_step_with_accumulation_equals_single_device_step(llama_ckpt):
    import jax
    from train_worker import one_step

    from harvest.runtime.mesh import make_mesh

    single, single_metrics = one_step(str(llama_ckpt), make_mesh("1d", jax.devices()[:1]))
    sharded, sharded_metrics = one_step(str(llama_ckpt), make_mesh("data=2,fsdp=2,model=2"), grad_accum=2)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(sharded_metrics[key]), float(single_metrics[key]), rtol=1e-5)
    assert_trees_close(jax.device_get(sharded), jax.device_get(single), rtol=1e-5)


@pytest.mark.slow
def test_two_processes_step_equals_single_device_step(llama_ckpt, tmp_path):
    import jax
    from safetensors.numpy import load_file
    from train_worker import one_step

    from harvest.model.config import ModelConfig
    from harvest.model.weights import to_hf
    from harvest.runtime.mesh import make_mesh

    address = f"127.0.0.1:{free_port()}"
    codes = run_processes([[sys.executable, str(HERE / "train_worker.py"), address, "2", str(pid), str(tmp_path),
                            str(llama_ckpt), "data=2,fsdp=2,model=2", "1"] for pid in range(2)],
                          two_process_env(tmp_path), tmp_path)
    assert codes == [0, 0], [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    got = load_file(str(tmp_path / "step.safetensors"))
    single, single_metrics = one_step(str(llama_ckpt), make_mesh("1d", jax.devices()[:1]))
    want = to_hf(jax.device_get(single), ModelConfig.from_dir(llama_ckpt))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got.pop(f"metric.{key}")[0], float(single_metrics[key]), rtol=1e-5)
    got.pop("metric.lr"), got.pop("metric.tokens")
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(value))), err_msg=name)


@pytest.mark.slow
def test_processes_that_disagree_stop_with_the_differing_key_and_write_nothing(text_data, tokenizer_dir, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    base = ["train", "--shape", json.dumps(TINY_SHAPE), "--tokenizer", str(tokenizer_dir), "--data", str(text_data),
            "--out", str(out), "--seq-len", "64", "--batch-size", "8", "--steps", "2",
            "--coordinator", address, "--num-processes", "2"]
    codes = run_processes([harvest_cmd(*base, "--process-id", "0", "--lr", "0.001"),
                           harvest_cmd(*base, "--process-id", "1", "--lr", "0.002")],
                          two_process_env(tmp_path), tmp_path)
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    assert codes == [2, 2], logs
    for log in logs:
        errors = [line for line in log.splitlines() if line.startswith("harvest: error:")]
        assert len(errors) == 1 and "lr: process 0 has 0.001, process 1 has 0.002" in errors[0], log
    assert not out.exists()
