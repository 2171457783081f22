"""Compressed storage: activations as 8-bit codes with one float32 scale per token (row).

A quantized tensor `{point}.{layer}` [n, d] is stored as its codes (int8 or float8_e4m3fn) and, beside it in
the same shard, `{point}.{layer}.scale` [n] float32: the row's absmax over the hidden dimension divided by
the format's largest code, so x = code * scale. Per-token scales follow the outliers that the residual
stream has per token (an attention sink's norm is 100x the median's) without flattening every other token.

Bounds, per element of a row with scale s (s = max|x| / QMAX), both tested:
  int8 (QMAX 127, codes rounded to nearest):  |x - x^| <= s / 2
  float8_e4m3fn (QMAX 448, 3 mantissa bits):  |x - x^| <= max(|x| / 16, s * 2^-10)
(plus float32 rounding of the product, |x| * 2^-23).

`harvest extract` makes the codes on the device (harvest.model.quantize, from QMAX and CODES here); `quantize`
is the reference its tests hold it to, and what bench/quant.py stores runs with.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

SCHEME = "absmax-per-token"  # what run.json and the sidecars record beside the dtype
SCALE_SUFFIX = ".scale"
CODES = {"int8": np.dtype(np.int8), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def is_quantized(dtype: str) -> bool:
    return dtype in CODES


def scale_name(name: str) -> str:
    """The name of the scale tensor stored beside tensor `name`."""
    return name + SCALE_SUFFIX


def record(dtype: str) -> dict | None:
    """What run.json and the sidecars record of a run stored as `dtype` (None: values stored as they are)."""
    return {"dtype": dtype, "scheme": SCHEME, "scale_dtype": "float32"} if is_quantized(dtype) else None


def quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """[n, d] float values -> (codes [n, d] of `dtype`, scales [n] float32)."""
    x = np.asarray(x, np.float32)
    qmax = QMAX[dtype]
    scale = (np.abs(x).max(axis=1) / qmax).astype(np.float32) if x.size else np.zeros(len(x), np.float32)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)[:, None]
    scaled = x * inverse
    if dtype == "int8":
        return np.clip(np.rint(scaled), -qmax, qmax).astype(np.int8), scale
    return np.clip(scaled, -qmax, qmax).astype(CODES[dtype]), scale


def dequantize(codes: np.ndarray, scale: np.ndarray, out_dtype=np.float32) -> np.ndarray:
    """codes [n, d], scales [n] -> values [n, d] in `out_dtype` (computed in float32)."""
    return (codes.astype(np.float32) * np.asarray(scale, np.float32)[:, None]).astype(out_dtype, copy=False)


def quantize_blocks(tensors: dict[str, list[np.ndarray]], dtype: str) -> dict[str, list[np.ndarray]]:
    """A shard's tensors (each as its blocks of rows) -> the tensors to store: codes under the same names,
    and each one's scales beside it (bench/quant.py's host-side writer)."""
    out: dict[str, list[np.ndarray]] = {}
    for name, blocks in tensors.items():
        pairs = [quantize(block, dtype) for block in blocks]
        out[name] = [codes for codes, _ in pairs]
        out[scale_name(name)] = [scale for _, scale in pairs]
    return out


def dequantize_named(tensors: dict[str, np.ndarray], names, out_dtype=np.float32) -> dict[str, np.ndarray]:
    """A decoded shard's {name: array} with each of `names` dequantized (its scale dropped from the result)."""
    out = {k: v for k, v in tensors.items() if not (k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] in names)}
    for name in names:
        out[name] = dequantize(tensors[name], tensors[scale_name(name)], out_dtype)
    return out


def scale_problem(codes: np.ndarray, scale: np.ndarray | None, dtype: str) -> str | None:
    """What is wrong with a stored tensor's scales (None: nothing): there must be one finite float32 scale >= 0
    per row, and each row with a scale above 0 must reach the largest code (its absmax), a row of scale 0 be 0."""
    if scale is None:
        return "is missing"
    if scale.dtype != np.float32 or scale.shape != (len(codes),):
        return f"is {scale.dtype}{list(scale.shape)}, its codes need float32[{len(codes)}]"
    if not np.all(np.isfinite(scale) & (scale >= 0)):
        return f"holds {int(np.sum(~(np.isfinite(scale) & (scale >= 0))))} scales that are negative, inf or nan"
    peak = np.abs(codes.astype(np.float32)).max(axis=1) if codes.size else np.zeros(len(codes), np.float32)
    wrong = np.flatnonzero(np.where(scale > 0, peak != QMAX[dtype], peak != 0))
    if len(wrong):
        return (f"does not match its codes in {len(wrong)} rows (row {wrong[0]}: scale {scale[wrong[0]]:.6g}, "
                f"largest code {peak[wrong[0]]:g}, want {QMAX[dtype]:g})")
    return None
