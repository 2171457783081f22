"""HF safetensors -> harvest params, placed straight into their shardings.

PARAMS maps each of our tensors to its HF name and says how HF's layout becomes ours (Linear weights
are [out, in] in HF, [in, out] here, with head dims split out). Each process reads, through
`jax.make_array_from_callback`, only the slices its own devices hold, and only the layers it will run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read bf16 checkpoints)
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open

from harvest.errors import UserError
from harvest.model.gguf import gguf_in, is_gguf, materialize
from harvest.model.config import ModelConfig
from harvest.runtime.mesh import logical_sharding

_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
              "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.jinja"]


class CheckpointError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One of our tensors (per layer when `layered`): shape, logical axes, HF source and layout."""

    hf: str  # HF name; {i} is the layer index
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    # Our dims grouped by the HF dim they come from (after transposing HF when `transpose`).
    groups: tuple[tuple[int, ...], ...]
    transpose: bool = False
    layered: bool = True
    fuse: tuple[int, int, int] | None = None  # families.base.Source.fuse: our part of a fused HF tensor
    base: bool = True  # under the base model's prefix

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of our part in HF's layout (of the whole fused tensor: full_hf_shape)."""
        dims = tuple(math.prod(self.shape[d] for d in g) for g in self.groups)
        return dims[::-1] if self.transpose else dims

    @property
    def fused_axis(self) -> int:
        """The HF dim a fused tensor stacks its parts along: the output dim ([out, in] linear: 0; else last)."""
        return 0 if self.transpose else len(self.hf_shape) - 1

    @property
    def full_hf_shape(self) -> tuple[int, ...]:
        shape = list(self.hf_shape)
        if self.fuse:
            shape[self.fused_axis] *= self.fuse[0]
        return tuple(shape)


def _layout(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...], int]]:
    """Our tensors: shape, logical axes and how many leading dims come from HF's input dim (the rest from its
    output dim; -1: a vector or table, one group). Every family's params are a subset of these."""
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_norm, k_norm = ((hd,), (hd,)) if cfg.qk_norm == "head" else ((H * hd,), (K * hd,))
    return {
        "embed": ((V, D), ("vocab", "embed"), 1),
        "pos_embed": ((cfg.max_positions, D), (None, "embed"), 1),
        "layers/q_proj": ((D, H, hd), ("embed", "heads", None), 1),
        "layers/k_proj": ((D, K, hd), ("embed", "kv_heads", None), 1),
        "layers/v_proj": ((D, K, hd), ("embed", "kv_heads", None), 1),
        "layers/o_proj": ((H, hd, D), ("heads", None, "embed"), 2),
        "layers/q_bias": ((H, hd), ("heads", None), -1),
        "layers/k_bias": ((K, hd), ("kv_heads", None), -1),
        "layers/v_bias": ((K, hd), ("kv_heads", None), -1),
        "layers/o_bias": ((D,), (None,), -1),
        "layers/q_norm": (q_norm, (None,), -1),
        "layers/k_norm": (k_norm, (None,), -1),
        "layers/gate_proj": ((D, I), ("embed", "mlp"), 1),
        "layers/up_proj": ((D, I), ("embed", "mlp"), 1),
        "layers/down_proj": ((I, D), ("mlp", "embed"), 1),
        "layers/gate_bias": ((I,), ("mlp",), -1),
        "layers/up_bias": ((I,), ("mlp",), -1),
        "layers/down_bias": ((D,), (None,), -1),
        "lm_head": ((D, V), ("embed", "vocab"), 1),
        **{f"{norm}{bias}": ((D,), (None,), -1) for bias in ("", "_bias")
           for norm in ("layers/attn_norm", "layers/attn_post_norm", "layers/mlp_norm", "layers/mlp_post_norm",
                        "final_norm")},
    }


def param_paths(cfg: ModelConfig, head: bool = False) -> list[str]:
    """The params `cfg` has ('embed', 'layers/q_proj', ...): what its block's switches read. `head` adds the final
    norm and LM head."""
    def norm(path: str) -> list[str]:
        return [path, path + "_bias"] if cfg.norm == "layer" else [path]

    post_normed = cfg.block in ("sandwich", "post")
    paths = ["embed"] + (["pos_embed"] if cfg.rope is None else [])
    paths += [] if cfg.block == "post" else norm("layers/attn_norm")
    paths += [f"layers/{x}_proj" for x in "qkvo"]
    paths += [f"layers/{x}_bias" for x in "qkv"] if cfg.qkv_bias else []
    paths += ["layers/o_bias"] if cfg.o_bias else []
    paths += ["layers/q_norm", "layers/k_norm"] if cfg.qk_norm else []
    paths += norm("layers/attn_post_norm") if post_normed else []
    paths += [] if cfg.block == "post" else norm("layers/mlp_norm")
    paths += norm("layers/mlp_post_norm") if post_normed else []
    mlp = (["gate"] if cfg.gated_mlp else []) + ["up", "down"]
    paths += [f"layers/{x}_proj" for x in mlp] + ([f"layers/{x}_bias" for x in mlp] if cfg.mlp_bias else [])
    if head:
        paths += norm("final_norm") + ([] if cfg.tie_word_embeddings else ["lm_head"])
    return paths


def param_specs(cfg: ModelConfig, head: bool = False) -> dict[str, ParamSpec]:
    """Our params by path, each with its HF source (the family's names: model.families)."""
    from harvest.model.families import family

    sources, layout = family(cfg.model_type).sources(cfg), _layout(cfg)
    specs = {}
    for path in param_paths(cfg, head):
        shape, axes, inputs = layout[path]
        source = sources[path]
        dims = tuple(range(len(shape)))
        if source.layout == "table":
            groups = tuple((d,) for d in dims)
        elif source.layout == "vector" or inputs < 0:
            groups = (dims,)
        else:
            groups = (dims[:inputs], dims[inputs:])
        specs[path] = ParamSpec(source.name, shape, axes, groups, transpose=source.layout == "linear",
                                layered=path.startswith("layers/"), fuse=source.fuse, base=source.base)
    return specs


def resolve_checkpoint(model: str) -> Path:
    """A local HF checkpoint directory, or a hub id fetched (or found in the cache) with huggingface_hub, or a
    GGUF file (path or URL, or a directory holding one) dequantized once into a checkpoint directory."""
    if is_gguf(model):
        return materialize(model)
    path = Path(model).expanduser()
    if path.is_dir():
        found = gguf_in(path)
        return materialize(str(found)) if found else path
    if path.exists():
        raise CheckpointError(f"--model {model}: is a file; give the checkpoint directory holding config.json "
                              "or a .gguf file")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise CheckpointError(f"--model {model}: no such directory, and not a hub id like Qwen/Qwen2.5-0.5B")
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(repo_id=model, allow_patterns=_HUB_FILES))
    except Exception as e:  # the hub's errors are many; all mean the same thing to the user
        raise CheckpointError(f"--model {model}: not a local directory and not fetched from the hub "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


class _Checkpoint:
    """The tensors of a single-file or sharded safetensors checkpoint, opened lazily."""

    def __init__(self, path: Path):
        self.path = path
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            self.files = {name: path / file for name, file in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
            self.files = {}
            for file in files:
                with self._open(file) as f:
                    self.files.update({name: file for name in f.keys()})
        self._handles: dict[Path, Any] = {}

    def _open(self, file: Path):
        try:
            return safe_open(str(file), framework="numpy")
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read as safetensors ({e})") from None

    def slice(self, name: str):
        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file].get_slice(name)


def load_params(
    model: str | Path,
    cfg: ModelConfig,
    *,
    dtype: Any = np.float32,
    mesh: Mesh | None = None,
    num_layers: int | None = None,
    head: bool = False,
) -> dict:
    """Read a checkpoint into the params pytree of `model.transformer`, cast to `dtype`.

    Only layers [0, num_layers) are read (early exit). With a mesh, each tensor is placed straight into
    its logical sharding and each process reads only the slices its devices hold.
    """
    ckpt = _Checkpoint(resolve_checkpoint(str(model)))
    num_layers = cfg.num_layers if num_layers is None else num_layers
    prefix = _prefix(ckpt, cfg)
    _check_names(ckpt, cfg, prefix)
    params: dict = {}
    for path, spec, shape, sharding in _placements(cfg, mesh, num_layers, head):
        depth = num_layers if spec.layered else None
        tree_set(params, path, jax.make_array_from_callback(shape, sharding, _reader(ckpt, spec, prefix, depth, dtype)))
    return params


def params_shape(cfg: ModelConfig, *, dtype: Any = np.float32, mesh: Mesh | None = None, num_layers: int | None = None,
                 head: bool = False) -> dict:
    """What load_params gives, as shapes, dtypes and shardings only: enough to compile the forward before (or
    without) reading a byte of the weights."""
    num_layers = cfg.num_layers if num_layers is None else num_layers
    tree: dict = {}
    for path, _, shape, sharding in _placements(cfg, mesh, num_layers, head):
        tree_set(tree, path, jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding))
    return tree


def _placements(cfg: ModelConfig, mesh: Mesh | None, num_layers: int, head: bool):
    """(path, spec, shape, sharding) of each param: layered ones stacked to `num_layers`, each placed into its
    logical sharding on the mesh (or on the first local device)."""
    for path, spec in param_specs(cfg, head=head).items():
        shape = ((num_layers,) if spec.layered else ()) + spec.shape
        if mesh is None:
            sharding = SingleDeviceSharding(jax.local_devices()[0])
        else:
            sharding = logical_sharding(shape, ((None,) if spec.layered else ()) + spec.axes, mesh)
        yield path, spec, shape, sharding


def tree_set(tree: dict, path: str, value: Any) -> None:
    """tree['layers']['q_proj'] = value for path 'layers/q_proj', making the inner dicts."""
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value


def tree_get(tree: dict, path: str) -> Any:
    for key in path.split("/"):
        tree = tree[key]
    return tree


def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The inverse of load_params: host params (with the head) as HF tensors by name, in HF's layout."""
    from harvest.model.families import family

    tensors = {}
    for path, spec in param_specs(cfg, head=True).items():
        if spec.fuse:
            raise CheckpointError(f"{cfg.model_type}: writing its fused {spec.hf} back to HF is not supported")
        value = np.asarray(tree_get(params, path))
        blocks = value if spec.layered else [value]
        grouped = tuple(math.prod(spec.shape[d] for d in g) for g in spec.groups)
        for name, block in zip(_names(spec, family(cfg.model_type).prefixes[0], range(len(blocks))), blocks):
            block = block.reshape(grouped)
            tensors[name] = np.ascontiguousarray(block.T if spec.transpose else block)
    return tensors


def _prefix(ckpt: _Checkpoint, cfg: ModelConfig) -> str:
    """Where the base model's tensors sit: the family's first prefix under which its embedding is found
    ('model.' for *ForCausalLM checkpoints, '' for bare base-model exports, ...)."""
    from harvest.model.families import family

    embed = param_specs(cfg)["embed"].hf
    prefixes = family(cfg.model_type).prefixes
    found = next((p for p in prefixes if p + embed in ckpt.files), None)
    if found is None:
        raise CheckpointError(f"{ckpt.path}: missing tensor {prefixes[0] + embed} (is it a {cfg.model_type} "
                              "checkpoint?)")
    return found


def _names(spec: ParamSpec, prefix: str, layers: range) -> list[str]:
    name = prefix + spec.hf if spec.base else spec.hf
    return [name.format(i=i) for i in layers] if spec.layered else [name]


def _check_names(ckpt: _Checkpoint, cfg: ModelConfig, prefix: str) -> None:
    """Every tensor the config implies is present with its shape; nothing unexpected is there."""
    from harvest.model.families import family

    ignored = re.compile(family(cfg.model_type).ignored)
    every = param_specs(cfg, head=True)
    expected = {n: s.full_hf_shape for s in every.values() for n in _names(s, prefix, range(cfg.num_layers))}
    present = {n for n in ckpt.files if not ignored.match(n)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # some exporters store the tied copy too
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing:
        raise CheckpointError(f"{ckpt.path}: missing tensors {_few(missing)} (does config.json match the weights?)")
    if unexpected:
        raise CheckpointError(f"{ckpt.path}: unexpected tensors {_few(unexpected)} (not a {cfg.model_type} "
                              "checkpoint, or a config field such as attention_bias disagrees)")
    for name, shape in expected.items():
        got = tuple(ckpt.slice(name).get_shape())
        if got != shape:
            raise CheckpointError(f"{ckpt.path}: tensor {name} has shape {list(got)}, config.json implies {list(shape)}")


def _part(full: np.ndarray, spec: ParamSpec) -> np.ndarray:
    """Our part of a fused HF tensor (ParamSpec.fuse), in HF's layout."""
    parts, index, heads = spec.fuse
    x = np.moveaxis(full, spec.fused_axis, 0)
    n, rest = x.shape[0], x.shape[1:]
    if heads:  # [heads, parts, per head]
        x = x.reshape(heads, parts, n // (heads * parts), *rest)[:, index].reshape(n // parts, *rest)
    else:  # [parts, n / parts]
        x = x.reshape(parts, n // parts, *rest)[index]
    return np.moveaxis(x, 0, spec.fused_axis)


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _reader(ckpt: _Checkpoint, spec: ParamSpec, prefix: str, depth: int | None, dtype) -> Callable:
    """Callback for make_array_from_callback: the block of our tensor at `index`, read from HF's layout."""
    names = _names(spec, prefix, range(depth or 0))
    cache: dict[tuple, np.ndarray] = {}

    def read_one(name: str, index: tuple[slice, ...]) -> np.ndarray:
        bounds = [range(*s.indices(n)) for s, n in zip(index, spec.shape)]
        hf_index = []
        for group in spec.groups:
            inner = math.prod(spec.shape[d] for d in group[1:])
            if any(len(bounds[d]) != spec.shape[d] for d in group[1:]):
                raise AssertionError(f"{spec.hf}: only the outer dim of a split HF dim may be sharded")
            outer = bounds[group[0]]
            hf_index.append(slice(outer.start * inner, outer.stop * inner))
        if spec.transpose:
            hf_index.reverse()
        if spec.fuse:
            source = ckpt.slice(name)
            block = _part(source[tuple(slice(None) for _ in source.get_shape())], spec)[tuple(hf_index)]
        else:
            block = ckpt.slice(name)[tuple(hf_index)]
        if spec.transpose:
            block = block.T
        return np.asarray(block).astype(dtype).reshape([len(b) for b in bounds])

    def read(index) -> np.ndarray:
        index = tuple(index) if index is not None else (slice(None),) * (len(spec.shape) + bool(depth))
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            if spec.layered:
                layers = range(*index[0].indices(depth))
                cache[key] = np.stack([read_one(names[i], index[1:]) for i in layers])
            else:
                cache[key] = read_one(names[0], index)
        return cache[key]

    return read
