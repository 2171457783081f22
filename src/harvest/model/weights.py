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

# Buffers some exporters leave in checkpoints; they hold nothing we need.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
              "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.jinja"]


class CheckpointError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One of our tensors (per layer when `layered`): shape, logical axes, HF name and layout."""

    hf: str  # HF name; {i} is the layer index
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    # Our dims grouped by the HF dim they come from (after transposing HF when `transpose`).
    groups: tuple[tuple[int, ...], ...]
    transpose: bool = False
    layered: bool = True

    @property
    def hf_shape(self) -> tuple[int, ...]:
        dims = tuple(math.prod(self.shape[d] for d in g) for g in self.groups)
        return dims[::-1] if self.transpose else dims


def param_specs(cfg: ModelConfig, head: bool = False) -> dict[str, ParamSpec]:
    """Our params by path ('embed', 'layers/q_proj', ...). `head` adds the final norm and LM head."""
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = "model.layers.{i}.self_attn."
    m = "model.layers.{i}.mlp."

    def linear_in(hf, shape, axes):  # HF [out..., in] -> ours [in, out...]
        return ParamSpec(hf, shape, axes, ((0,), tuple(range(1, len(shape)))), transpose=True)

    def linear_out(hf, shape, axes):  # HF [out, in...] -> ours [in..., out]
        return ParamSpec(hf, shape, axes, (tuple(range(len(shape) - 1)), (len(shape) - 1,)), transpose=True)

    def vector(hf, shape, axes):
        return ParamSpec(hf, shape, axes, (tuple(range(len(shape))),))

    specs = {
        "embed": ParamSpec("model.embed_tokens.weight", (V, D), ("vocab", "embed"), ((0,), (1,)), layered=False),
        "layers/attn_norm": vector("model.layers.{i}.input_layernorm.weight", (D,), (None,)),
        "layers/q_proj": linear_in(a + "q_proj.weight", (D, H, hd), ("embed", "heads", None)),
        "layers/k_proj": linear_in(a + "k_proj.weight", (D, K, hd), ("embed", "kv_heads", None)),
        "layers/v_proj": linear_in(a + "v_proj.weight", (D, K, hd), ("embed", "kv_heads", None)),
        "layers/o_proj": linear_out(a + "o_proj.weight", (H, hd, D), ("heads", None, "embed")),
        "layers/mlp_norm": vector("model.layers.{i}.post_attention_layernorm.weight", (D,), (None,)),
        "layers/gate_proj": linear_in(m + "gate_proj.weight", (D, I), ("embed", "mlp")),
        "layers/up_proj": linear_in(m + "up_proj.weight", (D, I), ("embed", "mlp")),
        "layers/down_proj": linear_out(m + "down_proj.weight", (I, D), ("mlp", "embed")),
    }
    if cfg.qkv_bias:
        specs["layers/q_bias"] = vector(a + "q_proj.bias", (H, hd), ("heads", None))
        specs["layers/k_bias"] = vector(a + "k_proj.bias", (K, hd), ("kv_heads", None))
        specs["layers/v_bias"] = vector(a + "v_proj.bias", (K, hd), ("kv_heads", None))
    if cfg.o_bias:
        specs["layers/o_bias"] = vector(a + "o_proj.bias", (D,), (None,))
    if cfg.mlp_bias:
        specs["layers/gate_bias"] = vector(m + "gate_proj.bias", (I,), ("mlp",))
        specs["layers/up_bias"] = vector(m + "up_proj.bias", (I,), ("mlp",))
        specs["layers/down_bias"] = vector(m + "down_proj.bias", (D,), (None,))
    if cfg.qk_norm:
        specs["layers/q_norm"] = vector(a + "q_norm.weight", (hd,), (None,))
        specs["layers/k_norm"] = vector(a + "k_norm.weight", (hd,), (None,))
    if head:
        specs["final_norm"] = dataclasses.replace(vector("model.norm.weight", (D,), (None,)), layered=False)
        if not cfg.tie_word_embeddings:
            specs["lm_head"] = ParamSpec("lm_head.weight", (D, V), ("embed", "vocab"), ((0,), (1,)),
                                         transpose=True, layered=False)
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
    prefix = _prefix(ckpt)
    _check_names(ckpt, cfg, param_specs(cfg, head=head), prefix)
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
    tensors = {}
    for path, spec in param_specs(cfg, head=True).items():
        value = np.asarray(tree_get(params, path))
        blocks = value if spec.layered else [value]
        grouped = tuple(math.prod(spec.shape[d] for d in g) for g in spec.groups)
        for name, block in zip(_names(spec, "model.", range(len(blocks))), blocks):
            block = block.reshape(grouped)
            tensors[name] = np.ascontiguousarray(block.T if spec.transpose else block)
    return tensors


def _prefix(ckpt: _Checkpoint) -> str:
    """'model.' for *ForCausalLM checkpoints, '' for bare base-model exports."""
    if "model.embed_tokens.weight" in ckpt.files:
        return "model."
    if "embed_tokens.weight" in ckpt.files:
        return ""
    raise CheckpointError(f"{ckpt.path}: missing tensor model.embed_tokens.weight")


def _names(spec: ParamSpec, prefix: str, layers: range) -> list[str]:
    name = spec.hf.replace("model.", prefix, 1) if spec.hf.startswith("model.") else spec.hf
    return [name.format(i=i) for i in layers] if spec.layered else [name]


def _check_names(ckpt: _Checkpoint, cfg: ModelConfig, specs: dict[str, ParamSpec], prefix: str) -> None:
    """Every tensor the config implies is present with its shape; nothing unexpected is there."""
    every = param_specs(cfg, head=True)
    expected = {n: s.hf_shape for s in every.values() for n in _names(s, prefix, range(cfg.num_layers))}
    present = {n for n in ckpt.files if not _IGNORED.match(n)}
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
