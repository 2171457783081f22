"""The decoder family: `load_decoder` gives a ready, jitted forward with captures on a mesh."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from harvest.model.config import ModelConfig
from harvest.model.moments import piece_moments
from harvest.model.points import POINTS, CapturePlan, parse_points
from harvest.model.quantize import piece_firsts, quantized
from harvest.model.transformer import forward
from harvest.model.weights import load_params, params_shape, resolve_checkpoint
from harvest.runtime.mesh import constrainer, logical_sharding

__all__ = ["POINTS", "CapturePlan", "Decoder", "ModelConfig", "compile_forward", "default_compute_dtype", "handed",
           "held_bytes", "load_decoder", "lower_forward", "parse_points"]


def default_compute_dtype() -> str:
    """float32 on CPU (XLA's CPU bf16 is ~50x slower), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass
class Decoder:
    """Config, capture plan and resident params on a mesh, with the forward jitted once per shape."""

    cfg: ModelConfig
    plan: CapturePlan
    params: dict
    mesh: Mesh
    out_dtype: str | None = None  # cast captures on device (halves device->host bytes for bf16 storage)
    attention: str = "auto"  # model.attention.KINDS; auto: the backend's best
    moment_slots: int = 0  # > 0: `step` also gives each row's first pieces' mean and M2 (harvest.model.moments)
    # An 8-bit code of harvest.store.quant (int8, float8_e4m3fn): captures leave the device as codes and scales of
    # their float32 values (harvest.model.quantize); out_dtype must then be None.
    quantize: str | None = None

    def __post_init__(self):
        self._forward = _forward_program(self.cfg, self.plan, self.mesh, self.out_dtype, self.attention,
                                         self.moment_slots, self.quantize)

    def shard_batch(self, array: np.ndarray) -> jax.Array:
        """A [batch, seq] host array (the same on every process) placed along the mesh's data axes."""
        sharding = _batch_sharding(array.shape, self.mesh)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def __call__(self, tokens: np.ndarray, segment_ids: np.ndarray) -> dict[str, jax.Array]:
        """{point: [n_layers_captured, batch, seq, width]} on device (dispatched asynchronously)."""
        return self.step(tokens, segment_ids)[0]

    def step(self, tokens: np.ndarray, segment_ids: np.ndarray) -> tuple[dict[str, jax.Array], dict[str, tuple]]:
        """The captures, and {point: (mean, M2)} [n_layers_captured, batch, moment_slots, width] float32 of each
        row's first `moment_slots` pieces ({} without moment slots). With `quantize` the captures are {point:
        codes [n_layers_captured, batch, seq, width], store.quant.scale_name(point): scales [.., batch, seq]
        float32}, and each point's moments, of the float32 values, are (mean, M2, first): first, of the same
        shape, holds each of those pieces' first token in float32 (harvest.model.quantize.piece_firsts)."""
        tokens, segment_ids = np.asarray(tokens, np.int32), np.asarray(segment_ids, np.int32)
        return self._forward(self.params, self.shard_batch(tokens), self.shard_batch(segment_ids))


def load_decoder(model: str | Path, points: str, mesh: Mesh, compute_dtype: str | None = None,
                 out_dtype: str | None = None, moment_slots: int = 0, attention: str = "auto",
                 quantize: str | None = None) -> Decoder:
    """Read config and weights (only the layers the points need) straight into the mesh."""
    path = resolve_checkpoint(str(model))
    cfg = ModelConfig.from_dir(path)
    plan = parse_points(points, cfg.num_layers)
    dtype = jnp.dtype(compute_dtype or default_compute_dtype())
    params = load_params(path, cfg, dtype=dtype, mesh=mesh, num_layers=plan.num_layers)
    return Decoder(cfg, plan, params, mesh, out_dtype, attention, moment_slots=moment_slots, quantize=quantize)


@functools.lru_cache(maxsize=16)
def _forward_program(cfg: ModelConfig, plan: CapturePlan, mesh: Mesh, out_dtype: str | None, attention: str,
                     moment_slots: int, quantize: str | None = None):
    """The jitted step (captures, and each row's first pieces' moments), one per setting: compile_forward's
    programs are the ones the Decoder then runs."""
    if quantize and out_dtype:
        raise ValueError(f"captures quantized to {quantize} are codes of their float32 values, not {out_dtype}")
    one_device = mesh.devices.size == 1
    # On one device there is nothing to pin.
    constrain = None if one_device else constrainer(mesh)
    run = partial(forward, cfg=cfg, plan=plan, constrain=constrain, attention=attention,
                  mesh=None if one_device else mesh)
    dtype = "float32" if quantize else out_dtype  # the captures' (None: as computed)

    def step(params, tokens, segment_ids):
        captures = {p: v.astype(dtype or v.dtype) for p, v in run(params, tokens, segment_ids).items()}
        captures, moments = handed(captures, segment_ids, moment_slots, quantize)
        if constrain is not None:  # whole rows (at full width), as the captures (the host slices them by row)
            moments = jax.tree.map(lambda m: constrain(m, ("capture", "batch", None, None)), moments)
            captures = {k: constrain(v, ("capture", "batch", *[None] * (v.ndim - 2))) for k, v in captures.items()}
        return captures, moments

    return jax.jit(step)


def handed(captures: dict[str, jax.Array], segment_ids: jax.Array, moment_slots: int,
           quantize: str | None = None) -> tuple[dict[str, jax.Array], dict[str, tuple]]:
    """What the step hands the host of its captures {point: values} (float32 where quantized): Decoder.step's
    (captures, moments). Public for benchmarks that make a device's outputs without a model."""
    moments = {p: piece_moments(v, segment_ids, moment_slots) for p, v in captures.items()} if moment_slots else {}
    if not quantize:
        return captures, moments
    return (quantized(captures, quantize),
            {p: (*m, piece_firsts(captures[p], segment_ids, moment_slots)) for p, m in moments.items()})


def _batch_sharding(shape: tuple[int, int], mesh: Mesh):
    return logical_sharding(shape, ("batch", None), mesh)


def compile_forward(model: str | Path, points: str, mesh: Mesh, shape: tuple[int, int],
                    compute_dtype: str | None = None, out_dtype: str | None = None, moment_slots: int = 0,
                    attention: str = "auto", quantize: str | None = None) -> concurrent.futures.Future:
    """Compile the forward that load_decoder's Decoder (same arguments) runs on batches of `shape`, from the
    params' shapes alone, in the background: the compile (seconds on a CPU, minutes for a large model on a pod)
    overlaps reading the weights and the data's first rows. The result() is the compiled program's memory on
    each device (jax's CompiledMemoryStats; None where the backend cannot say): what the run needs, known before
    its first batch. Wait for it before the first batch, or that batch compiles the forward again."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
    done = pool.submit(_compile_behind, lambda: lower_forward(model, points, mesh, shape, compute_dtype, out_dtype,
                                                              moment_slots, attention, quantize).compile())
    pool.shutdown(wait=False)
    return done


def lower_forward(model: str | Path, points: str, mesh: Mesh, shape: tuple[int, int],
                  compute_dtype: str | None = None, out_dtype: str | None = None, moment_slots: int = 0,
                  attention: str = "auto", quantize: str | None = None) -> jax.stages.Lowered:
    """The program compile_forward compiles (same arguments), traced from the params' shapes alone: its
    compiled text shows what crosses devices (tests/model/test_devices.py)."""
    path = resolve_checkpoint(str(model))
    cfg = ModelConfig.from_dir(path)
    plan = parse_points(points, cfg.num_layers)
    program = _forward_program(cfg, plan, mesh, out_dtype, attention, moment_slots, quantize)
    params = params_shape(cfg, dtype=compute_dtype or default_compute_dtype(), mesh=mesh, num_layers=plan.num_layers)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=_batch_sharding(shape, mesh))
    return program.lower(params, batch, batch)


def held_bytes(stats) -> int:
    """What a compiled program (jax's CompiledMemoryStats) holds on each device: its arguments, its outputs and its
    working memory, less the outputs that reuse an argument's buffer."""
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def _compile_behind(compile):
    """Compile at a lower CPU priority than the rest of the start-up (Linux: a thread's own nice value), which
    the first batch waits for too: the tokenizer's load, the checks, the feeder's first rows."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux: the compile competes evenly
        pass
    return compile().memory_analysis()
