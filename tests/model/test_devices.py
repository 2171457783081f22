"""A host's devices at one device's cost: on a data mesh each device does its own rows, nothing activation-sized
crosses devices (read from the compiled program), and a row costs on 4 devices the time and memory it costs on one
(docs/performance.md, Several devices in one process)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import hf_reference as ref
import jax
import pytest
from devices_worker import POINTS as WORKER_POINTS
from devices_worker import ROWS_PER_DEVICE, SEQ

from harvest.model import held_bytes, lower_forward
from harvest.runtime.mesh import make_mesh

COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|"
                        r"collective-permute|collective-broadcast)(?:-start)?\(")
POINTS = "resid_post:all,attn_z:0,mlp_in:1,mlp_hidden:1"  # every kind of width: hidden, heads x head_dim, MLP
FACTOR = 1.5  # a row's time, and each device's memory, on N devices: at most this times one device's
# The process's peak on N devices, at most this times one device's process: it holds N slots' rows in flight (8 rows
# of 2,048 tokens each, their captures on the host), ~40 MB a device at these widths over a ~0.5 GB process
# (measured: 1.07x on 4 devices, 1.5x on 8; 3.5x on 4 when a mesh's auto attention was dense).
PROCESS_FACTOR = 2.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return ref.build_checkpoint("qwen2", tmp_path_factory.mktemp("devices") / "qwen2", num_layers=2)


def collectives(ckpt: Path, mesh: str, devices: int = 8, **settings) -> list[tuple[str, str]]:
    """(result shape, op) of every collective in the compiled extraction forward on the first `devices` (8 rows of
    256 per slot, the moments extraction hands the host)."""
    mesh = make_mesh(mesh, jax.devices()[:devices])
    rows = 8 * mesh.shape["data"]
    text = lower_forward(ckpt, POINTS, mesh, (rows, 256), "float32", moment_slots=4, **settings).compile().as_text()
    return COLLECTIVE.findall(text)


@pytest.mark.parametrize("devices", [4, 8])
@pytest.mark.parametrize("attention", ["dense", "blocks", "splash", "pallas-gpu"])
def test_a_data_mesh_moves_nothing_between_devices(ckpt, attention, devices):
    assert collectives(ckpt, f"data={devices}", devices, out_dtype="bfloat16", attention=attention) == []


def test_quantized_captures_stay_on_their_devices(ckpt):
    assert collectives(ckpt, "data=8", quantize="int8", attention="blocks") == []


def test_the_model_axis_adds_only_the_documented_collectives(ckpt):
    """Tensor parallelism over `model`: the attention's and the MLP's partial sums are all-reduced ([rows, seq,
    hidden] per layer: the loop body holds one of each), and a captured point whose width `model` splits (heads
    x head_dim, the MLP's width) is gathered whole for the host. Nothing else."""
    found = collectives(ckpt, "data=4,model=2", out_dtype="bfloat16", attention="blocks")
    assert sorted(op for _, op in found) == ["all-gather", "all-gather", "all-reduce", "all-reduce"]
    sums = [shape for shape, op in found if op == "all-reduce"]
    assert all(shape.startswith("f32[8,256,72]") for shape in sums), sums


def on_devices(ckpt: Path, devices: int, attention: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    worker = Path(__file__).parents[1] / "devices_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(ckpt), str(devices), attention], env=env, check=True,
                          stdout=subprocess.PIPE, text=True, timeout=300)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def one_device(ckpt) -> dict:
    return on_devices(ckpt, 1, "auto")


def device_bytes(ckpt: Path, devices: int) -> int:
    """What the compiled forward holds on each device (arguments, captures, working memory) at the worker's
    shapes: the memory a run needs, known before it starts."""
    mesh = make_mesh(f"data={devices}", jax.devices()[:devices])
    return held_bytes(lower_forward(ckpt, WORKER_POINTS, mesh, (ROWS_PER_DEVICE * devices, SEQ), "float32",
                                    "bfloat16", moment_slots=4).compile().memory_analysis())


@pytest.mark.parametrize("devices", [4, 8])
def test_n_devices_cost_what_one_does_per_row_at_2048_token_rows(ckpt, one_device, devices):
    """Each count in its own process (a process's CPU device count is fixed at start), 8 rows a device, auto
    attention: a row's time stays within FACTOR of one device's, as does each device's memory (from the compiled
    program), and the process's peak within PROCESS_FACTOR (16x and 37x on 4 devices while a mesh's auto
    attention was dense)."""
    many = on_devices(ckpt, devices, "auto")
    assert many["seconds_per_row"] <= FACTOR * one_device["seconds_per_row"], (one_device, many)
    assert many["peak_rss"] <= PROCESS_FACTOR * one_device["peak_rss"], (one_device, many)
    assert device_bytes(ckpt, devices) <= FACTOR * device_bytes(ckpt, 1)
