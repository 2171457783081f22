"""HuggingFace reference for activation-capture tests: tiny *random* checkpoints of the supported decoder
families built with ``transformers`` (no hub access), run under PyTorch with hooks for the activations the
JAX side must reproduce. The shapes catch common bugs: odd widths, GQA (6 query heads over 2 KV heads), per
family rope_theta and rms_norm_eps, llama3 rope scaling, qwen3's explicit head_dim, non-identity norms and
non-zero biases."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers

FAMILIES = ("qwen2", "llama", "mistral", "qwen3")

_BASE = dict(
    hidden_size=72,
    intermediate_size=100,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=256,
)

# (model class, per-family config kwargs, tied embeddings by default)
# With head_dim 12 and theta 5e5 the rope wavelengths are ~6.3, 56, 499, ...
# original_max_position_embeddings=64 puts them in llama3's high (<16, kept),
# medium (16..64, interpolated) and low (>64, divided by factor) bands, so all
# three branches of the llama3 scaling are exercised.
_FAMILY_SPECS = {
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        dict(rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        True,
    ),
    "llama": (
        transformers.LlamaForCausalLM,
        dict(
            rms_norm_eps=1e-5,
            attention_bias=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        False,
    ),
    "mistral": (
        transformers.MistralForCausalLM,
        dict(rms_norm_eps=3e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        False,
    ),
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        dict(rms_norm_eps=2e-6, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 2e5}),
        True,
    ),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _build_model(family, *, dtype, seed, num_layers, tie, overrides):
    """Random model with non-trivial weights (norms != 1, biases != 0), cast to dtype."""
    cls, family_kwargs, tie_default = _FAMILY_SPECS[family]
    kwargs = {
        **_BASE,
        **family_kwargs,
        "num_hidden_layers": num_layers,
        "tie_word_embeddings": tie_default if tie is None else tie,
        **(overrides or {}),
    }
    config = cls.config_class(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    return model.to(_DTYPES[dtype]).eval()


def build_checkpoint(
    family: str,
    out_dir,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_layers: int = 3,
    tie: bool | None = None,
    overrides: dict | None = None,
) -> pathlib.Path:
    """Save a tiny random ``family`` model as a single-file safetensors checkpoint.

    ``tie`` defaults to True for qwen2/qwen3 and False for llama/mistral;
    ``overrides`` is merged last into the config kwargs.
    """
    out_dir = pathlib.Path(out_dir)
    model = _build_model(
        family, dtype=dtype, seed=seed, num_layers=num_layers, tie=tie, overrides=overrides
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_sharded_checkpoint(
    family: str, out_dir, *, max_shard_size: str = "40KB", **kwargs
) -> pathlib.Path:
    """Like :func:`build_checkpoint` but split into several safetensors shards
    plus ``model.safetensors.index.json`` (tensors larger than the shard size
    get a shard of their own)."""
    out_dir = pathlib.Path(out_dir)
    model = _build_model(
        family,
        dtype=kwargs.pop("dtype", "float32"),
        seed=kwargs.pop("seed", 0),
        num_layers=kwargs.pop("num_layers", 3),
        tie=kwargs.pop("tie", None),
        overrides=kwargs.pop("overrides", None),
    )
    if kwargs:
        raise TypeError(f"unexpected arguments: {sorted(kwargs)}")
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "checkpoint was not sharded"
    return out_dir


def to_v4_dialect(ckpt_dir) -> None:
    """Rewrite ``config.json`` in place into the transformers-v4 dialect.

    Hub checkpoints (e.g. Qwen2.5-0.5B, Llama-3.2-1B) were written by
    transformers 4.x, whose config.json differs from what 5.x writes:

    * v5 ``rope_parameters: {rope_type, rope_theta, ...}`` becomes top-level
      ``rope_theta`` plus ``rope_scaling`` (null for ``rope_type == "default"``,
      else the remaining fields incl. ``rope_type``, as llama3 checkpoints have).
    * v5 ``layer_types`` is dropped (v4 had no such key; it is derived again).
    * v5 ``dtype`` becomes v4 ``torch_dtype``.
    * qwen2 gets Qwen2.5's ``sliding_window: 32768``, ``use_sliding_window:
      false`` and ``max_window_layers = num_hidden_layers``.
    * mistral gets ``sliding_window: null`` if the key is absent (v5 writes
      its 4096 default, which is kept).
    """
    path = pathlib.Path(ckpt_dir) / "config.json"
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg.pop("layer_types", None)
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] == "qwen2":
        cfg.update(
            sliding_window=32768,
            use_sliding_window=False,
            max_window_layers=cfg["num_hidden_layers"],
        )
    if cfg["model_type"] == "mistral":
        cfg.setdefault("sliding_window", None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_hidden", "mlp_out", "resid_post")


def hf_captures(
    ckpt_dir,
    input_ids: np.ndarray,
    *,
    dtype: str = "float32",
    attention_mask: np.ndarray | None = None,
) -> dict[tuple[str, int], np.ndarray]:
    """Run the checkpoint under transformers and return float32 activations.

    Keys are ``(point, layer)`` for every point in :data:`POINTS` and every
    layer; values are ``[B, S, width]`` (width = intermediate_size for
    ``mlp_hidden``, hidden_size otherwise). Positions are 0..S-1.
    ``resid_mid`` is read as the input of ``post_attention_layernorm``, which is
    exactly the residual stream after the attention add.
    """
    return model_captures(load_model(ckpt_dir, dtype=dtype), input_ids, attention_mask=attention_mask)


def load_model(ckpt_dir, *, dtype: str = "float32", gguf_file: str | None = None):
    """The checkpoint under transformers (eager attention); with ``gguf_file``, that GGUF file of ``ckpt_dir``,
    dequantized by transformers itself."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        ckpt_dir, dtype=_DTYPES[dtype], attn_implementation="eager", gguf_file=gguf_file
    ).eval()


def model_captures(
    model, input_ids: np.ndarray, *, attention_mask: np.ndarray | None = None
) -> dict[tuple[str, int], np.ndarray]:
    """:func:`hf_captures` of a model already loaded (:func:`load_model`)."""
    out: dict[tuple[str, int], torch.Tensor] = {}

    def first(x):  # attention returns (out, weights); v5 decoder layers return a bare tensor
        return x[0] if isinstance(x, tuple) else x

    def fwd_hook(key):
        return lambda mod, args, output: out.__setitem__(key, first(output))

    def pre_hook(key):
        return lambda mod, args, kwargs: out.__setitem__(
            key, args[0] if args else kwargs["hidden_states"]
        )

    handles = []
    for i, layer in enumerate(model.model.layers):
        for module, key, kind in (
            (layer, "resid_pre", "pre"),
            (layer.self_attn, "attn_out", "fwd"),
            (layer.post_attention_layernorm, "resid_mid", "pre"),
            (layer.mlp.down_proj, "mlp_hidden", "pre"),
            (layer.mlp, "mlp_out", "fwd"),
            (layer, "resid_post", "fwd"),
        ):
            if kind == "pre":
                handles.append(module.register_forward_pre_hook(pre_hook((key, i)), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fwd_hook((key, i))))
    try:
        with torch.no_grad():
            result = model(
                input_ids=torch.as_tensor(np.asarray(input_ids), dtype=torch.long),
                attention_mask=None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask)),
                output_hidden_states=True,
                use_cache=False,
            )
    finally:
        for h in handles:
            h.remove()

    hidden = result.hidden_states  # embeddings, layer outputs..., final entry is post-norm
    n = len(model.model.layers)
    for i in range(n):
        assert torch.equal(out["resid_pre", i], hidden[i]), f"resid_pre {i} != hidden_states[{i}]"
        if i + 1 < n:
            assert torch.equal(out["resid_post", i], hidden[i + 1]), f"resid_post {i} != hidden_states[{i + 1}]"
    return {k: v.float().numpy() for k, v in out.items()}
