"""A TopK SAE's sparse step on the CPU through our own kernels (cpu_kernels.cc, called by jax.ffi).

XLA:CPU runs a top-k and a scatter on one thread, and writes a [B, k, d] array out for a gather that feeds a
reduction or a scatter: at the bench's shape they made its TopK step 0.59x sparsify's. The kernels select each
row's k largest of ReLU(pre + bias), take the k chosen decoder rows' dot products and scatter the gradients of the
chosen encoder and decoder rows, on XLA's own thread pool; the matmul and the decode (a gather-and-add XLA fuses
well) stay XLA's.

The source is compiled on first use with the machine's C++ compiler (-O3 -march=native) into
$HARVEST_CACHE/kernels/, under a name made from everything the binary depends on (its source, jaxlib's version,
the flags, the machine and its CPU's features), so that a change of any of them builds afresh and a binary is never
run on a CPU it was not built for. Without a compiler (or with HARVEST_CPU_KERNELS=0) the step keeps XLA's
formulation, after one warning; the results agree to float32 rounding (sums in another order).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache, partial
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from harvest.runtime.cache import root
from harvest.sae.topk import DATA_AXES

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-w")
TARGETS = {"topk": "HarvestTopK", "backward": "HarvestBackward"}
ENV = "HARVEST_CPU_KERNELS"  # 0: keep XLA's formulation
PRE_BLOCK_BYTES = 16 * 2**20
MIN_BLOCK_ROWS = 64


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str) -> Path:
    """The compiled library, built now unless this exact build is in the cache already."""
    import jaxlib

    include = jax.ffi.include_dir()
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, jaxlib.__version__.encode(), " ".join(FLAGS).encode(),
                                     compiler.encode(), platform.machine().encode(),
                                     _cpu_features().encode()])).hexdigest()[:24]
    folder = root() / "kernels"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # what is loaded from here runs: this user's alone
    library = folder / f"sae-{key}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / library.name
        done = subprocess.run([compiler, *FLAGS, "-I", include, str(SOURCE), "-o", str(built)], capture_output=True,
                              text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(built, library)  # atomic: another process building the same key finds one whole file
    return library


@cache
def available() -> bool:
    """Whether the kernels are built, loaded and registered with XLA (once per process; False: XLA's path)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler (g++): the TopK SAE step runs XLA's slower formulation on this CPU")
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        for target in TARGETS.values():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as error:
        log.warning("the CPU kernels did not build (%s): the TopK SAE step runs XLA's slower formulation", error)
        return False
    return True


def usable(mesh: Mesh, dtype) -> bool:
    """Whether a step over `mesh` in `dtype` takes the kernels: float32, every device a CPU, the latents whole
    (`model` = 1: each device runs them on its rows of the batch), the kernels built."""
    return (mesh.shape["model"] == 1 and all(d.platform == "cpu" for d in mesh.devices.flat)
            and jnp.dtype(dtype) == jnp.float32 and available())


def _call(name: str, out):
    if not available():
        raise RuntimeError(f"the CPU kernels are not available ({ENV}=0, or they did not build: see the warning)")
    return jax.ffi.ffi_call(TARGETS[name], out)


def top_k_relu(pre: jax.Array, bias: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) [B, k] of each row's k largest of ReLU(pre + bias), as lax.top_k orders them."""
    out = (jax.ShapeDtypeStruct((pre.shape[0], k), jnp.float32), jax.ShapeDtypeStruct((pre.shape[0], k), jnp.int32))
    return _call("topk", out)(pre, bias)


def backward(indices: jax.Array, values: jax.Array, d_values: jax.Array, d_decoded: jax.Array, centred: jax.Array,
             w_dec: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(g [B, k]: the chosen pre-activations' gradient, W_dec's [L, d], W_enc's transposed [L, d], b_enc's [L]):
    cpu_kernels.cc says how."""
    (rows, k), (latents, d) = indices.shape, w_dec.shape
    out = (jax.ShapeDtypeStruct((rows, k), jnp.float32), jax.ShapeDtypeStruct((latents, d), jnp.float32),
           jax.ShapeDtypeStruct((latents, d), jnp.float32), jax.ShapeDtypeStruct((latents,), jnp.float32))
    return _call("backward", out)(indices, values, d_values, d_decoded, centred, w_dec)


def gather_sum(table: jax.Array, indices: jax.Array, weights: jax.Array) -> jax.Array:
    """[B, d]: sum_j weights[b, j] table[indices[b, j]], one gather-and-add per j (XLA fuses the chain into one
    loop, with no [B, k, d] array)."""
    out = weights[:, 0, None] * table[indices[:, 0]]
    for j in range(1, indices.shape[1]):
        out = out + weights[:, j, None] * table[indices[:, j]]
    return out


def block_rows(rows: int, latents: int) -> int:
    """Rows encoded at a time: the most that divide `rows` with their [rows, latents] pre-activations within
    PRE_BLOCK_BYTES, so the top-k reads them from cache, not memory (at 4,096 x 14,336 the encoding took 385 ms in
    blocks of 256 rows, 450 ms whole); all of them where no divisor of at least MIN_BLOCK_ROWS fits."""
    most = max(PRE_BLOCK_BYTES // (4 * latents), 1)
    fits = [n for n in range(MIN_BLOCK_ROWS, min(most, rows) + 1) if rows % n == 0]
    return max(fits) if fits else rows


def encode_blocks(centred: jax.Array, w_enc: jax.Array, b_enc: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """top_k_relu(centred @ w_enc, b_enc, k), block_rows rows at a time."""
    rows, width = centred.shape
    per = block_rows(rows, w_enc.shape[1])
    if per == rows:
        return top_k_relu(centred @ w_enc, b_enc, k)
    values, indices = jax.lax.map(lambda block: top_k_relu(block @ w_enc, b_enc, k),
                                  centred.reshape(rows // per, per, width))
    return values.reshape(rows, k), indices.reshape(rows, k)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def reconstruct(x: jax.Array, b_dec: jax.Array, w_enc: jax.Array, b_enc: jax.Array, w_dec: jax.Array, k: int):
    """(decoded [B, d] without b_dec, values [B, k], indices [B, k]) of a TopK SAE on x - b_dec."""
    values, indices = encode_blocks(x - b_dec, w_enc, b_enc, k)
    return gather_sum(w_dec, indices, values), values, indices


def _reconstruct_fwd(x, b_dec, w_enc, b_enc, w_dec, k):
    decoded, values, indices = reconstruct(x, b_dec, w_enc, b_enc, w_dec, k)
    return (decoded, values, indices), (x, b_dec, w_enc, w_dec, values, indices)


def _reconstruct_bwd(k, saved, cotangents):
    """Only the k chosen latents of a row carry a gradient: one pass over the B x k chosen pairs takes their
    decoder rows' dot products and adds both matrices' rows (B k d work, no [B, L] matmul). b_dec's gradient
    through x - b_dec is -W_enc @ (the encoder bias's), a matvec: x's own (k rows of W_enc.T a token, which
    XLA:CPU gathers from the transpose in place, strided) is computed only where something asks for it."""
    x, b_dec, w_enc, w_dec, values, indices = saved
    d_decoded, d_values, _ = cotangents
    g, d_dec, d_rows_enc, d_bias = backward(indices, values, d_values, d_decoded, x - b_dec, w_dec)
    return gather_sum(w_enc.T, indices, g), -(w_enc @ d_bias), d_rows_enc.T, d_bias, d_dec


reconstruct.defvjp(_reconstruct_fwd, _reconstruct_bwd)


def reconstruct_rows(mesh: Mesh, x: jax.Array, b_dec: jax.Array, w_enc: jax.Array, b_enc: jax.Array, w_dec: jax.Array,
                     k: int):
    """reconstruct with x's rows over `mesh`'s data axes: each device runs the kernels on its own rows (the kernels
    have no sharding rules of their own), and the params' gradients are summed over the devices."""
    rows, whole = PartitionSpec(DATA_AXES), PartitionSpec()
    return jax.shard_map(lambda *a: reconstruct(*a, k), mesh=mesh, in_specs=(rows, whole, whole, whole, whole),
                         out_specs=(rows, rows, rows), check_vma=False)(x, b_dec, w_enc, b_enc, w_dec)
