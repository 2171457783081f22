"""ModelConfig: the decoder hyper-parameters read from a HF config.json, nothing guessed.

Two dialects reach us: the transformers-v4 keys that hub checkpoints carry (`rope_theta`,
`rope_scaling`, `sliding_window` + `use_sliding_window` + `max_window_layers`) and the v5 keys that
`save_pretrained` writes today (`rope_parameters`, `layer_types`). A field that changes the numbers
and is missing is an error, never a default: a wrong rope_theta gives plausible, wrong activations.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from harvest.errors import UserError

SUPPORTED = ("qwen2", "llama", "mistral", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
# transformers' own defaults for tie_word_embeddings when the key is absent (HF semantics, not a guess).
_TIE_DEFAULT = {"qwen2": False, "llama": False, "mistral": False, "qwen3": False}


class ModelConfigError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Per layer: the sliding attention window in tokens, or None for full causal attention.
    sliding_windows: tuple[int | None, ...]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        return _parse(hf, source)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            hf = json.loads(file.read_text())
        except FileNotFoundError:
            raise ModelConfigError(f"{file}: not found; --model must be a HF checkpoint directory or hub id") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(hf, dict):
            raise ModelConfigError(f"{file}: expected a JSON object")
        return _parse(hf, str(file))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parse(hf: dict[str, Any], src: str) -> ModelConfig:
    def need(key: str, kind: type | tuple[type, ...] = int) -> Any:
        if key not in hf or hf[key] is None:
            raise ModelConfigError(f"{src}: missing '{key}', which this model needs")
        value = hf[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ModelConfigError(f"{src}: '{key}' = {value!r} is not a {_kind_name(kind)}")
        return value

    model_type = hf.get("model_type")
    if model_type not in SUPPORTED:
        raise ModelConfigError(
            f"{src}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{src}: hidden_act {act!r} is not supported (only 'silu')")

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    num_layers = need("num_hidden_layers")
    kv_heads = hf.get("num_key_value_heads") or heads  # HF: absent means multi-head attention
    head_dim = hf.get("head_dim")
    if model_type == "qwen3" and head_dim is None:
        raise ModelConfigError(f"{src}: missing 'head_dim', which qwen3 needs")
    if head_dim is None:
        if hidden % heads:
            raise ModelConfigError(f"{src}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    for key, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{src}: '{key}' = {value!r} is not a positive int")
    if heads % kv_heads:
        raise ModelConfigError(
            f"{src}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    if head_dim % 2:
        raise ModelConfigError(f"{src}: head_dim {head_dim} must be even for rotary embeddings")

    attention_bias = bool(hf.get("attention_bias", False))
    tie = hf.get("tie_word_embeddings", _TIE_DEFAULT[model_type])
    return ModelConfig(
        model_type=model_type,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(need("rms_norm_eps", (int, float))),
        rope=_parse_rope(hf, src, head_dim),
        tie_word_embeddings=bool(tie),
        qkv_bias=True if model_type == "qwen2" else (attention_bias and model_type != "mistral"),
        o_bias=attention_bias and model_type in ("llama", "qwen3"),
        mlp_bias=bool(hf.get("mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3",
        sliding_windows=_parse_sliding(hf, src, model_type, num_layers),
    )


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _parse_rope(hf: dict[str, Any], src: str, head_dim: int) -> RopeConfig:
    """v5: rope_parameters holds rope_theta and the scaling; v4: rope_theta + rope_scaling."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ModelConfigError(f"{src}: 'rope_parameters' must be an object")
        # A per-layer-type dict ({"full_attention": {...}, ...}) is a dialect we have not seen on these families.
        if "rope_theta" not in params and hf.get("rope_theta") is None:
            raise ModelConfigError(f"{src}: missing 'rope_parameters.rope_theta', which rotary embeddings need")
        theta = params.get("rope_theta", hf.get("rope_theta"))
        scaling = params
    else:
        if hf.get("rope_theta") is None:
            raise ModelConfigError(f"{src}: missing 'rope_theta' (or 'rope_parameters'), which rotary embeddings need")
        theta = hf["rope_theta"]
        scaling = hf.get("rope_scaling") or {"rope_type": "default"}
        if not isinstance(scaling, dict):
            raise ModelConfigError(f"{src}: 'rope_scaling' must be an object or null")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelConfigError(f"{src}: 'rope_theta' = {theta!r} is not a positive number")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"{src}: rope_scaling.rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError(f"{src}: partial_rotary_factor {partial!r} is not supported (only 1.0)")

    def field(key: str) -> float:
        if scaling.get(key) is None:
            raise ModelConfigError(f"{src}: rope_scaling type {rope_type!r} needs 'rope_scaling.{key}'")
        return scaling[key]

    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), type="linear", factor=float(field("factor")))
    return RopeConfig(
        theta=float(theta),
        type="llama3",
        factor=float(field("factor")),
        low_freq_factor=float(field("low_freq_factor")),
        high_freq_factor=float(field("high_freq_factor")),
        original_max_position_embeddings=int(field("original_max_position_embeddings")),
    )


def _parse_sliding(hf: dict[str, Any], src: str, model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Which layers attend through a sliding window, and how wide, in both dialects."""
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelConfigError(f"{src}: 'layer_types' must list {num_layers} entries")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ModelConfigError(f"{src}: layer_types {unknown} are not supported")
        sliding = [t == "sliding_attention" for t in layer_types]
    elif model_type == "mistral":
        sliding = [window is not None] * num_layers
    elif model_type in ("qwen2", "qwen3"):
        on = bool(hf.get("use_sliding_window", False)) and window is not None
        first = hf.get("max_window_layers", num_layers)
        sliding = [on and i >= first for i in range(num_layers)]
    else:
        sliding = [False] * num_layers
    if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ModelConfigError(f"{src}: sliding attention is on but 'sliding_window' = {window!r} is not a positive int")
    return tuple(window if s else None for s in sliding)
