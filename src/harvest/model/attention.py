"""Attention over packed rows, every implementation behind one selector (`--attention`): dense (the reference,
seq^2 memory), blocks (the block pairs that share a segment; CPU extraction), splash (TPU), pallas-gpu (the
Pallas flash kernel; public API, so it runs in interpret mode in the tests), auto. A token sees the earlier
tokens of its own segment (in its sliding window); padding sees padding, so no softmax row is empty. The
kernels run compiled on their own backend and interpreted elsewhere. Each implementation's trade-offs:
docs/extracting.md (Attention kernels)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from harvest.config import ATTENTION_KINDS as KINDS
from harvest.errors import UserError
from harvest.model.blocks import block_len, block_pairs
from harvest.runtime.mesh import logical_spec

KERNEL_BACKEND = {"splash": "tpu", "pallas-gpu": "gpu"}
LANES = 128  # kernel rows are padded to a multiple of this; splash blocks are multiples of it
BLOCKS_ENV = "HARVEST_PALLAS_BLOCKS"  # pallas-gpu tiles for every head size and row (benchmarks sweep it)
log = logging.getLogger(__name__)


class AttentionError(UserError):
    pass


def limiting(windows, seq: int) -> tuple[int | None, ...]:
    """Per layer: the sliding window where it hides some key of a row of `seq` tokens, else None."""
    return tuple(w if w is not None and w < seq else None for w in windows)


def resolve(kind: str, windows=(), seq: int = 0, backward: bool = False, softcap: float | None = None,
            backend: str | None = None) -> str:
    """The implementation `kind` names ("auto": the backend's best that serves these windows and this score
    softcap, and a backward pass where training needs one), or an AttentionError for a kind that cannot serve
    them. Where auto passes over a kernel the backend has, it says so in one line. `backend`: jax's default."""
    if kind not in KINDS:
        raise AttentionError(f"--attention {kind!r}: choose one of {', '.join(KINDS)}")
    lacks = _lacks(windows, seq, softcap)
    if kind == "auto":
        backend = backend or jax.default_backend()
        if backend in KERNEL_BACKEND.values():
            kind = "pallas-gpu" if backend == "gpu" else "splash"
            if kind == "pallas-gpu" and lacks:
                log.warning("attention: this model needs %s, which the Pallas GPU kernel lacks; it runs dense "
                            "attention (seq^2 memory per row)", lacks)
                return "dense"
            return kind
        return "dense" if backward else "blocks"
    if kind == "blocks" and backward:
        raise AttentionError("--attention blocks: its loop runs over each batch's real block pairs, a count known "
                             "only at run time, which has no backward pass; train with --attention dense (or auto)")
    if kind == "pallas-gpu" and lacks:
        raise AttentionError(f"--attention pallas-gpu: the model needs {lacks}, which the Pallas GPU kernel lacks; "
                             f"use --attention dense (or auto)")
    return kind


def _lacks(windows, seq: int, softcap: float | None) -> str:
    """What a model needs that the Pallas GPU kernel lacks, in words ('' if nothing)."""
    shorter = [w for w in limiting(windows, seq) if w]
    needs = ([f"a sliding window of {min(shorter)} tokens, shorter than the rows ({seq})"] if shorter else []) + (
        [f"an attention score softcap ({softcap:g})"] if softcap else [])
    return " and ".join(needs)


def attention_of(kind: str, segment_ids: jax.Array, windows, scale: float, mesh: Mesh | None = None,
                 softcap: float | None = None):
    """`attend_of(i)` -> `attend(q [b,s,h,d], k, v [b,s,g,d]) -> [b,s,h,d]` for layer i (a traced index under
    scan) with `windows[i]` (None: full causal) and scores capped at `softcap` (cap * tanh(s / cap); None:
    not capped)."""
    seq = segment_ids.shape[-1]
    kind = resolve(kind, windows, seq, softcap=softcap)
    windows = limiting(windows, seq)
    if kind in ("dense", "blocks"):
        window = jnp.asarray([w or seq for w in windows], jnp.int32)
        if kind == "blocks" and mesh is not None and mesh.devices.size > 1:
            # Each device lists its own rows' pairs, once for all layers, and loops over them alone.
            rows = PartitionSpec(logical_spec(segment_ids.shape, ("batch", None), mesh)[0])
            pairs = jax.shard_map(block_pairs, mesh=mesh, in_specs=PartitionSpec(*rows, None),
                                  out_specs=(rows, rows))(segment_ids)
            local = lambda w: lambda q, k, v, segments, *pairs: block_sparse_attention(q, k, v, segments, w, pairs,
                                                                                      scale, softcap)
            return lambda i: lambda q, k, v: _sharded(local(window[i]), mesh, q, k, v, segment_ids, *pairs)
        if kind == "blocks":
            pairs = block_pairs(segment_ids)
            return lambda i: lambda q, k, v: block_sparse_attention(q, k, v, segment_ids, window[i], pairs, scale,
                                                                    softcap)
        idx = jnp.arange(seq)
        causal = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (idx[:, None] >= idx[None, :])
        distance = idx[:, None] - idx[None, :]
        return lambda i: lambda q, k, v: dense_attention(q, k, v, causal & (distance < window[i]), scale, softcap)
    local = {"splash": _splash, "pallas-gpu": _pallas_gpu}[kind]
    interpret = jax.default_backend() != KERNEL_BACKEND[kind]
    distinct = sorted(set(windows), key=lambda w: w or 0)
    branches = [functools.partial(_kernel, functools.partial(local, window=w, scale=scale, softcap=softcap,
                                                             interpret=interpret), mesh=mesh) for w in distinct]
    if len(branches) == 1:
        return lambda i: lambda q, k, v: branches[0](q, k, v, segment_ids)
    choice = jnp.asarray([distinct.index(w) for w in windows], jnp.int32)
    return lambda i: lambda q, k, v: jax.lax.switch(choice[i], branches, q, k, v, segment_ids)


def capped(scores: jax.Array, softcap: float | None) -> jax.Array:
    """Scores through the softcap (Gemma 2: cap * tanh(scores / cap)), as they are without one."""
    return scores if not softcap else softcap * jnp.tanh(scores / softcap)


def dense_attention(q, k, v, mask, scale: float, softcap: float | None = None):
    """The reference: every score of a row, masked by `mask` [b, s, s], each kv head serving its group of query
    heads. Scores, their scale and cap and the softmax in float32 (transformers' eager attention rounds the scores
    to the compute dtype first: bf16 here is closer to the exact values than HF's own bf16)."""
    batch, seq, heads, dim = q.shape
    groups = k.shape[2]
    grouped = q.reshape(batch, seq, groups, heads // groups, dim)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", grouped, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], capped(scores, softcap), jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgrqk,bkgd->bqgrd", weights, v).reshape(q.shape)


def _kernel(local, q, k, v, segment_ids, *, mesh: Mesh | None):
    """A kernel over rows padded to a multiple of LANES, under shard_map when the mesh has several devices."""
    seq = q.shape[1]
    pad = -seq % LANES
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    if mesh is not None and mesh.devices.size > 1:
        out = _sharded(local, mesh, q, k, v, segment_ids)
    else:
        out = local(q, k, v, segment_ids)
    return out[:, :seq]


def _sharded(local, mesh: Mesh, q, k, v, segment_ids, *by_rows):
    """Rows over the data axes, query heads over `model` where they divide it and each device's heads fall in
    whole kv groups or inside one (its kv heads are then split alike, or sliced from a replicated copy).
    `by_rows`: 1-d arrays split as the rows are (each device's block pairs)."""
    rows = logical_spec(segment_ids.shape, ("batch", None), mesh)[0]
    heads, groups, m = q.shape[2], k.shape[2], mesh.shape["model"]
    rep, per_device = heads // groups, heads // m
    split = m > 1 and heads % m == 0 and (per_device % rep == 0 or rep % per_device == 0)
    kv_split = split and groups % m == 0
    q_spec = PartitionSpec(rows, None, "model" if split else None, None)
    kv_spec = PartitionSpec(rows, None, "model" if kv_split else None, None)

    def body(q, k, v, segment_ids, *by_rows):
        if split and not kv_split:  # this device's query heads all belong to one kv group
            group = jax.lax.axis_index("model") * per_device // rep
            k, v = (jax.lax.dynamic_slice_in_dim(x, group, 1, axis=2) for x in (k, v))
        return local(q, k, v, segment_ids, *by_rows)

    # check_vma off: Pallas calls do not declare how their outputs vary over the mesh.
    specs = (q_spec, kv_spec, kv_spec, PartitionSpec(rows, None), *[PartitionSpec(rows)] * len(by_rows))
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(q, k, v, segment_ids,
                                                                                            *by_rows)


def _splash(q, k, v, segment_ids, *, window: int | None, scale: float, softcap: float | None, interpret: bool):
    """Splash over each row: q [h, s, d] against k, v [g, s, d] (the kernel maps h/g query heads to each)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

    seq, heads = q.shape[1], q.shape[2]
    kernel = _splash_kernel(seq, heads, window, softcap, interpret)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(
        heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v), segment_ids)
    return heads_first(out)


@functools.cache
def _splash_kernel(seq: int, heads: int, window: int | None, softcap: float | None, interpret: bool):
    """Blocks of 512 where the row allows (as MaxText and levanter default), else the largest of 256, 128."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    block = next(b for b in (512, 256, LANES) if seq % b == 0)
    mask = (splash_mask.CausalMask((seq, seq)) if window is None
            else splash_mask.LocalMask((seq, seq), (window - 1, 0), offset=0))
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    with jax.ensure_compile_time_eval():  # the mask tables are constants, whichever trace builds them first
        return splash.make_splash_mha(splash_mask.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, attn_logits_soft_cap=softcap, interpret=interpret)


@dataclasses.dataclass(frozen=True)
class PallasBlocks:
    """Tiles of the Pallas GPU kernel: the forward's query x key blocks, warps per block and software-pipeline
    stages, and the backward's dk/dv pass blocks (queries x keys; its dq pass takes them mirrored, keys x
    queries, as the kernel's fused backward requires: as many dq query blocks as dk/dv key blocks). jax's
    kernel uses the warps for both passes; its backward always runs 2 stages."""

    block_q: int
    block_k: int
    warps: int
    stages: int
    back_q: int
    back_k: int

    def __str__(self) -> str:
        return f"{self.block_q}x{self.block_k}w{self.warps}s{self.stages}b{self.back_q}x{self.back_k}"

    def sizes(self):
        """jax's pallas_gpu.BlockSizes of these tiles."""
        from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

        return pallas_gpu.BlockSizes(block_q=self.block_q, block_k=self.block_k, block_q_dkv=self.back_q,
                                     block_kv_dkv=self.back_k, block_q_dq=self.back_k, block_kv_dq=self.back_q)


SPEC = re.compile(r"(\d+)x(\d+)(?:w(\d+))?(?:s(\d+))?(?:b(\d+)x(\d+))?")
SPEC_HELP = "QxK[wW][sS][bQxK], e.g. 128x64, 128x64w4s3, 64x64w4s2b32x128"


BLOCK_FIELDS = ("block_q", "block_k", "back_q", "back_k")


def table_blocks(head_dim: int, seq: int) -> PallasBlocks:
    """The tiles for this head size and row length, chosen on paper until a GPU sweep (bench/forward.py
    --pallas-blocks) measures them:

      forward 128 queries x 64 keys, 3 stages; 4 warps for head_dim <= 64, 8 above: the configuration Triton's
      flash-attention tutorial autotunes to on Hopper and Ampere (jax's defaults, 128 x 128 with 2 stages,
      keep a [128, 128] fp32 score tile in the registers of 4 warps and fetch only one key block ahead).
      Rows under 512 take 64-query blocks: a short row has few query blocks, and more, smaller blocks keep
      the SMs busy.
      backward 32 queries x 128 keys for dk/dv (and 128 x 32 for dq), the tutorial's split, for head_dim <=
      64 (jax's default is 32 x 32: four times the passes over q for each key block); 64 x 64 above, where a
      [128, head_dim] pair of fp32 dk/dv accumulators would spill registers."""
    wide = head_dim > 64
    return PallasBlocks(block_q=128 if seq >= 512 else 64, block_k=64, warps=8 if wide else 4, stages=3,
                        back_q=64 if wide else 32, back_k=64 if wide else 128)


def pallas_blocks(head_dim: int, seq: int) -> PallasBlocks:
    """table_blocks, or $HARVEST_PALLAS_BLOCKS where set (the parts it leaves out from the table); blocks
    longer than the (padded) row are cut to it, the kernel's own rule."""
    spec = os.environ.get(BLOCKS_ENV)
    chosen = parse_blocks(spec, table_blocks(head_dim, seq)) if spec else table_blocks(head_dim, seq)
    fit = dataclasses.replace(chosen, **{name: min(getattr(chosen, name), seq) for name in BLOCK_FIELDS})
    for name in BLOCK_FIELDS:
        if seq % getattr(fit, name):
            raise AttentionError(f"${BLOCKS_ENV}={spec}: {name} {getattr(fit, name)} does not divide the kernel's "
                                 f"rows of {seq} tokens; use blocks of at most 128")
    return fit


def parse_blocks(spec: str, base: PallasBlocks) -> PallasBlocks:
    """`spec` (SPEC_HELP) over `base`, or an AttentionError naming what is wrong."""
    match = SPEC.fullmatch(spec.strip())
    if not match:
        raise AttentionError(f"pallas-gpu blocks {spec!r}: write {SPEC_HELP}")
    q, k, warps, stages, back_q, back_k = (int(n) if n else None for n in match.groups())
    blocks = dataclasses.replace(base, block_q=q, block_k=k, **{name: n for name, n in (
        ("warps", warps), ("stages", stages), ("back_q", back_q), ("back_k", back_k)) if n is not None})
    for name in BLOCK_FIELDS:
        if getattr(blocks, name) not in (16, 32, 64, 128, 256):
            raise AttentionError(f"pallas-gpu blocks {spec!r}: blocks are 16, 32, 64, 128 or 256 tokens")
    if blocks.warps not in (1, 2, 4, 8, 16) or not 1 <= blocks.stages <= 6:
        raise AttentionError(f"pallas-gpu blocks {spec!r}: warps are 1, 2, 4, 8 or 16 and stages 1 to 6")
    return blocks


@contextlib.contextmanager
def blocks_override(spec: str | None):
    """Within this block, programs traced with pallas-gpu use `spec`'s tiles (checked here, one line if bad);
    None: the table's."""
    if spec is None:
        yield
        return
    parse_blocks(spec, table_blocks(64, 2048))
    before = os.environ.get(BLOCKS_ENV)
    os.environ[BLOCKS_ENV] = spec
    try:
        yield
    finally:
        if before is None:
            del os.environ[BLOCKS_ENV]
        else:
            os.environ[BLOCKS_ENV] = before


def _pallas_gpu(q, k, v, segment_ids, *, window: int | None, scale: float, softcap: float | None, interpret: bool):
    """The Pallas GPU kernel, causal within segments, with GQA by its k/v index maps (_gqa)."""
    assert window is None and not softcap, "resolve refuses pallas-gpu with a limiting window or a softcap"
    return _gqa(q, k, v, segment_ids, scale, pallas_blocks(q.shape[-1], q.shape[1]), interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gqa(q, k, v, segment_ids, scale: float, blocks: PallasBlocks, interpret: bool):
    return _gqa_forward(q, k, v, segment_ids, scale, blocks, interpret)[0]


def _gqa_forward(q, k, v, segment_ids, scale, blocks, interpret):
    """jax's forward kernel (pallas_gpu.mha_forward_kernel) on a grid of (query block, row, query head) as
    pallas_gpu.mha builds it, but query head h reads kv head h // (heads / kv heads): no repeated k/v in
    memory, and a group's query heads share their k/v in L2. Returns (out, (residuals)) as the backward
    takes them."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    batch, seq, heads, dim = q.shape
    rep = heads // k.shape[2]
    padded = pl.next_power_of_2(dim)
    kernel = functools.partial(pallas_gpu.mha_forward_kernel, sm_scale=scale, causal=True, block_q=blocks.block_q,
                               block_k=blocks.block_k, head_dim=dim)
    q_spec = pl.BlockSpec((None, blocks.block_q, None, padded), lambda i, b, h: (b, i, h, 0))
    kv_spec = pl.BlockSpec((None, seq, None, padded), lambda i, b, h: (b, 0, h // rep, 0))
    out, lse = pl.pallas_call(
        kernel, grid=(seq // blocks.block_q, batch, heads),
        in_specs=[q_spec, kv_spec, kv_spec, pl.BlockSpec((None, seq), lambda i, b, h: (b, 0))],
        out_specs=[q_spec, pl.BlockSpec((None, None, blocks.block_q), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages),
        interpret=interpret, name="harvest_gqa_forward",
    )(q, k, v, segment_ids)
    return out, (q, k, v, segment_ids, out, lse)


def _gqa_backward(scale, blocks, interpret, residuals, d_out):
    """jax's fused backward kernel (its private _mha_backward: the same in jax 0.10.2 and 0.11) over k/v
    repeated to the query heads, each group's dk/dv then summed in fp32: the backward of GQA. Training
    holds the repeated copy for one layer's backward at a time (memory ~seq)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    q, k, v, segment_ids, out, lse = residuals
    batch, seq, groups, dim = k.shape
    rep = q.shape[2] // groups
    k_all, v_all = (jnp.repeat(x, rep, axis=2) for x in (k, v))
    dq, dk, dv, _ = pallas_gpu._mha_backward(scale, True, blocks.sizes(), "triton", blocks.warps, blocks.stages,
                                             None, interpret, False, False,
                                             (q, k_all, v_all, segment_ids, out, lse), d_out)
    fold = lambda d, like: d.reshape(batch, seq, groups, rep, dim).sum(3, dtype=jnp.float32).astype(like.dtype)
    return dq, fold(dk, k), fold(dv, v), None


_gqa.defvjp(_gqa_forward, _gqa_backward)


def block_sparse_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: jax.Array,
                           pairs: tuple[jax.Array, jax.Array], scale: float, softcap: float | None = None) -> jax.Array:
    """Attention over the (query block, key block) pairs listed by model.blocks.block_pairs only: a packed
    row costs about sum(len_i^2), not seq^2.

    A loop takes the real pairs one at a time, in list order (each query block's keys in order), and folds
    each into its query block's running softmax (max, sum, weighted values), flash-attention style: no
    scatter, no partials held, and each step's matmuls are whole [heads x block, block] products. A query
    block's result depends on its own row alone, so a row rounds the same way whatever rows share its batch."""
    q_index, k_index = pairs
    batch, seq, heads, dim = q.shape
    groups = k.shape[2]
    rep = heads // groups
    block = block_len(seq)
    n = batch * seq // block
    # Blocks laid out for the matmuls: queries [n, groups, rep * block, dim], keys and values [n, groups, block, dim].
    qb = q.reshape(n, block, groups, rep, dim).transpose(0, 2, 3, 1, 4).reshape(n, groups, rep * block, dim)
    kb = k.reshape(n, block, groups, dim).transpose(0, 2, 1, 3)
    vb = v.reshape(n, block, groups, dim).transpose(0, 2, 1, 3)
    position = jnp.broadcast_to(jnp.arange(seq), (batch, seq)).reshape(n, block)
    segment = segment_ids.reshape(n, block)

    def fold(t, acc):
        peak, total, values = acc
        qi, ki = q_index[t], k_index[t]
        distance = position[qi][:, None] - position[ki][None, :]
        visible = (segment[qi][:, None] == segment[ki][None, :]) & (distance >= 0) & (distance < window)
        scores = capped(jnp.einsum("gmd,gkd->gmk", qb[qi], kb[ki]) * scale, softcap)
        scores = jnp.where(jnp.tile(visible, (rep, 1)), scores, jnp.asarray(-1e30, scores.dtype))
        # A query that sees nothing yet holds -1e30 and junk weights; its own key (always seen) rescales them to 0.
        new_peak = jnp.maximum(peak[qi], scores.max(-1))
        rescale = jnp.exp(peak[qi] - new_peak)
        weights = jnp.exp(scores - new_peak[..., None])
        return (peak.at[qi].set(new_peak), total.at[qi].set(total[qi] * rescale + weights.sum(-1)),
                values.at[qi].set(values[qi] * rescale[..., None] + jnp.einsum("gmk,gkd->gmd", weights, vb[ki])))

    shape = (n, groups, rep * block)
    start = (jnp.full(shape, -1e30, q.dtype), jnp.zeros(shape, q.dtype), jnp.zeros((*shape, dim), q.dtype))
    _, total, values = jax.lax.fori_loop(0, jnp.sum(q_index < n), fold, start)
    out = (values / total[..., None]).reshape(n, groups, rep, block, dim)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)
