"""ModelConfig: the decoder hyper-parameters read from a HF config.json, nothing guessed.

One frozen record describes every family: the block is written once (model.transformer) with the ways
families differ as switches (norm kind, where the norms sit, activation, gating, positions, softcaps, q/k-norm,
windows, local rope), and a family (model.families) is its choice of them plus its weight names. This module
holds the record and the parsing every family shares; `ModelConfig.from_hf` hands a config.json to the family
its model_type names.

Two dialects reach us: the transformers-v4 keys that hub checkpoints carry (`rope_theta`,
`rope_scaling`, `sliding_window` + `use_sliding_window` + `max_window_layers`) and the v5 keys that
`save_pretrained` writes today (`rope_parameters`, `layer_types`). A field that changes the numbers
and is missing is an error, never a default: a wrong rope_theta gives plausible, wrong activations.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from harvest.errors import UserError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NORMS = ("rms", "rms_fp32", "rms_one_plus", "layer")
BLOCKS = ("pre", "sandwich", "post", "parallel")
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


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
    beta_fast: float = 32.0  # yarn's ramp between kept and interpolated frequencies
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0  # cos and sin are scaled by it (yarn)


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
    norm_eps: float
    rope: RopeConfig | None  # None: learned absolute positions (max_positions of them)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Per layer: the sliding attention window in tokens, or None for full causal attention.
    sliding_windows: tuple[int | None, ...]
    # rms: w * normed cast back (Llama); rms_fp32: w * normed in float32, then cast (OLMo 2); rms_one_plus:
    # (1 + w) * normed in float32, then cast (Gemma); layer: LayerNorm with a bias (GPT-2, GPT-NeoX).
    norm: str = "rms"
    # pre: x + f(norm(x)) (Llama); sandwich: x + norm_post(f(norm(x))) (Gemma 2/3); post: x + norm(f(x)) (OLMo 2/3);
    # parallel: x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX).
    block: str = "pre"
    qk_norm: str | None = None  # head: per head after the projection (Qwen3, Gemma 3); full: over all heads (OLMo 2)
    act: str = "silu"
    gated_mlp: bool = True  # act(gate) * up; else act(up)
    rotary_dim: int = 0  # rotated dims of each head (partial rotary); 0: all of head_dim
    local_rope: RopeConfig | None = None  # the rope of sliding-window layers where it differs (Gemma 3)
    max_positions: int = 0  # rows of the learned position table (GPT-2)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the compute dtype (Gemma)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        from harvest.model.families import family_of

        return family_of(hf, source).config(hf, source)

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
        return cls.from_hf(hf, str(file))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def scale(self) -> float:
        """The attention's query-key scale."""
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    @property
    def rotated(self) -> int:
        """Dims of each head that rotary embeddings turn."""
        return self.rotary_dim or self.head_dim


class Fields:
    """Typed reads of one config.json's keys, each failing in one line that names the file and the key."""

    def __init__(self, hf: dict[str, Any], src: str):
        self.hf, self.src = hf, src

    def error(self, message: str) -> ModelConfigError:
        return ModelConfigError(f"{self.src}: {message}")

    def need(self, key: str, kind: type | tuple[type, ...] = int) -> Any:
        if key not in self.hf or self.hf[key] is None:
            raise self.error(f"missing '{key}', which this model needs")
        return self.check(key, self.hf[key], kind)

    def get(self, key: str, default: Any, kind: type | tuple[type, ...] = int) -> Any:
        value = self.hf.get(key)
        return default if value is None else self.check(key, value, kind)

    def check(self, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise self.error(f"'{key}' = {value!r} is not a {_kind_name(kind)}")
        return value

    def one_of(self, key: str, value: Any, choices: dict[str, Any]) -> Any:
        if value not in choices:
            raise self.error(f"{key} {value!r} is not supported (supported: {', '.join(map(repr, choices))})")
        return choices[value]

    def heads(self, head_dim_required: bool = False) -> tuple[int, int, int, int]:
        """(hidden_size, heads, kv heads, head_dim), checked against each other."""
        hidden, heads = self.need("hidden_size"), self.need("num_attention_heads")
        kv_heads = self.hf.get("num_key_value_heads") or heads  # HF: absent means multi-head attention
        head_dim = self.hf.get("head_dim")
        if head_dim is None and head_dim_required:
            raise self.error(f"missing 'head_dim', which {self.hf.get('model_type')} needs")
        if head_dim is None:
            if hidden % heads:
                raise self.error(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        for key, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise self.error(f"'{key}' = {value!r} is not a positive int")
        if heads % kv_heads:
            raise self.error(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        return hidden, heads, kv_heads, head_dim

    def sizes(self, head_dim_required: bool = False) -> dict[str, int]:
        """ModelConfig's sizes, from HF's usual keys (hidden_size, num_attention_heads, ...), checked."""
        hidden, heads, kv_heads, head_dim = self.heads(head_dim_required)
        return dict(vocab_size=self.need("vocab_size"), hidden_size=hidden, intermediate_size=self.need(
            "intermediate_size"), num_layers=self.need("num_hidden_layers"), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim)

    def sliding(self, num_layers: int) -> list[bool]:
        """Per layer, whether layer_types slides it (none slides without layer_types)."""
        types = self.layer_types(num_layers)
        return [t == "sliding_attention" for t in types] if types else [False] * num_layers

    def ropes(self, head_dim: int, sliding: list[bool]) -> dict[str, RopeConfig | None]:
        """ModelConfig's rope (the full-attention layers') and local_rope (the sliding layers', where it differs)."""
        rope, local = self.rope(head_dim, "full_attention"), self.rope(head_dim, "sliding_attention")
        return dict(rope=rope, local_rope=local if local != rope and any(sliding) else None)

    def rope(self, head_dim: int, layer_type: str | None = None) -> RopeConfig:
        """v5: rope_parameters holds rope_theta and the scaling (per layer type where the family has several);
        v4: rope_theta + rope_scaling."""
        hf, params = self.hf, self.hf.get("rope_parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise self.error("'rope_parameters' must be an object")
            if layer_type is not None and layer_type in params:
                params = params[layer_type]
                if not isinstance(params, dict):
                    raise self.error(f"'rope_parameters.{layer_type}' must be an object")
            if "rope_theta" not in params and hf.get("rope_theta") is None:
                raise self.error("missing 'rope_parameters.rope_theta', which rotary embeddings need")
            theta = params.get("rope_theta", hf.get("rope_theta"))
            scaling = params
        else:
            if hf.get("rope_theta") is None:
                raise self.error("missing 'rope_theta' (or 'rope_parameters'), which rotary embeddings need")
            theta = hf["rope_theta"]
            scaling = hf.get("rope_scaling") or {"rope_type": "default"}
            if not isinstance(scaling, dict):
                raise self.error("'rope_scaling' must be an object or null")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise self.error(f"'rope_theta' = {theta!r} is not a positive number")
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise self.error(f"rope_scaling.rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")

        def field(key: str) -> float:
            if scaling.get(key) is None:
                raise self.error(f"rope_scaling type {rope_type!r} needs 'rope_scaling.{key}'")
            return scaling[key]

        if rope_type == "default":
            return RopeConfig(theta=float(theta))
        if rope_type == "linear":
            return RopeConfig(theta=float(theta), type="linear", factor=float(field("factor")))
        if rope_type == "yarn":
            return self._yarn(float(theta), scaling, field)
        return RopeConfig(theta=float(theta), type="llama3", factor=float(field("factor")),
                          low_freq_factor=float(field("low_freq_factor")),
                          high_freq_factor=float(field("high_freq_factor")),
                          original_max_position_embeddings=int(field("original_max_position_embeddings")))

    def _yarn(self, theta: float, scaling: dict[str, Any], field) -> RopeConfig:
        """YaRN as transformers computes it (modeling_rope_utils._compute_yarn_parameters)."""
        original = int(field("original_max_position_embeddings"))
        factor = scaling.get("factor") or self.need("max_position_embeddings") / original

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = scaling.get("attention_factor")
        if attention is None:
            m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        return RopeConfig(theta=theta, type="yarn", factor=float(factor), original_max_position_embeddings=original,
                          beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                          truncate=bool(scaling.get("truncate", True)), attention_factor=float(attention))

    def partial_rotary(self) -> float:
        params = self.hf.get("rope_parameters") or {}
        value = params.get("partial_rotary_factor", self.hf.get("partial_rotary_factor", 1.0)) if isinstance(
            params, dict) else 1.0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise self.error(f"'partial_rotary_factor' = {value!r} is not a number in (0, 1]")
        return float(value)

    def layer_types(self, num_layers: int) -> list[str] | None:
        types = self.hf.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != num_layers:
            raise self.error(f"'layer_types' must list {num_layers} entries")
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise self.error(f"layer_types {unknown} are not supported")
        return types

    def windows(self, sliding: list[bool]) -> tuple[int | None, ...]:
        """Per layer the window of those that slide (sliding_window, checked), else None."""
        window = self.hf.get("sliding_window")
        if any(sliding) and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise self.error(f"sliding attention is on but 'sliding_window' = {window!r} is not a positive int")
        return tuple(window if s else None for s in sliding)

    def activation(self, key: str, default: str | None = None) -> str:
        """HF's activation name -> ours (the tanh-approximated gelus are one function)."""
        name = self.hf.get(key, default)
        return self.one_of(key, name, {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                                       "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"})


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)
