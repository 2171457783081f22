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
import pytest

from harvest.model import lower_forward
from harvest.runtime.mesh import make_mesh

COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|"
                        r"collective-permute|collective-broadcast)(?:-start)?\(")
POINTS = "resid_post:all,attn_z:0,mlp_in:1,mlp_hidden:1"  # every kind of width: hidden, heads x head_dim, MLP
FACTOR = 1.5  # a row's time and the process's peak memory on 4 devices, at most this times one device's


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return ref.build_checkpoint("qwen2", tmp_path_factory.mktemp("devices") / "qwen2", num_layers=2)


def collectives(ckpt: Path, mesh: str, **settings) -> list[tuple[str, str]]:
    """(result shape, op) of every collective in the compiled extraction forward (8 rows of 256 per slot, the
    moments extraction hands the host)."""
    mesh = make_mesh(mesh)
    rows = 8 * mesh.shape["data"]
    text = lower_forward(ckpt, POINTS, mesh, (rows, 256), "float32", moment_slots=4, **settings).compile().as_text()
    return COLLECTIVE.findall(text)


@pytest.mark.parametrize("attention", ["dense", "blocks", "splash", "pallas-gpu"])
def test_a_data_mesh_moves_nothing_between_devices(ckpt, attention):
    assert collectives(ckpt, "data=8", out_dtype="bfloat16", attention=attention) == []


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


def test_four_devices_cost_what_one_does_per_row_at_2048_token_rows(ckpt):
    """Each count in its own process (a process's CPU device count is fixed at start), 8 rows a device, auto
    attention: the time per row and the peak memory stay within FACTOR of one device's (they were 16x and 37x
    while a mesh's auto attention was dense)."""
    one, four = on_devices(ckpt, 1, "auto"), on_devices(ckpt, 4, "auto")
    assert four["seconds_per_row"] <= FACTOR * one["seconds_per_row"], (one, four)
    assert four["peak_rss"] <= FACTOR * one["peak_rss"], (one, four)
