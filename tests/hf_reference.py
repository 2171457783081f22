"""HuggingFace reference for activation-capture tests: tiny *random* checkpoints of the supported decoder
families built with ``transformers`` (no hub access), run under PyTorch with hooks for the activations the
JAX side must reproduce.

The shapes catch common bugs: odd widths (hidden 72, intermediate 100, vocab 211), GQA (6 query heads over 2
KV heads) where the family has KV heads, an explicit head_dim != hidden/heads (qwen3, gemma*), per family
rope_theta and norm eps, llama3 rope scaling, partial rotary (gpt_neox), sliding windows (5) shorter than the
test samples with sliding and full layers mixed, softcaps that bite on random weights (gemma2),
query_pre_attn_scalar != head_dim (gemma2/3), per layer-type rope (gemma3: local base 1e4, global 1e6 with
linear scaling x8; olmo3: yarn on the full layers only), non-identity norms and non-zero biases.

What transformers 5.23 ``save_pretrained`` writes into config.json for the new families (as built here):

* gpt2: no rope keys and no layer_types. ``n_embd, n_head, n_layer, n_positions, n_inner`` (null means
  4*n_embd), ``activation_function: "gelu_new"``, ``layer_norm_epsilon``, ``scale_attn_weights: true``,
  ``scale_attn_by_inverse_layer_idx: false``, ``reorder_and_upcast_attn: false``,
  ``tie_word_embeddings: true``. No ``n_ctx`` (hub gpt2 has it, = n_positions). Weights are saved as
  ``transformer.*`` without ``lm_head.weight``; hub gpt2's bare form is :func:`to_bare_gpt2`.
* gpt_neox: ``rope_parameters: {rope_type: "default", rope_theta, partial_rotary_factor}`` (the v4 keys
  ``rotary_pct`` / ``rotary_emb_base`` are read into it and not written back), ``use_parallel_residual``,
  ``hidden_act: "gelu"`` (exact erf gelu), ``layer_norm_eps``, ``attention_bias: true``,
  ``tie_word_embeddings: false``. No head_dim, no num_key_value_heads (MHA). The untied head is saved as
  ``embed_out.weight`` (``lm_head.weight`` in memory), the rest as ``gpt_neox.*``.
* gemma: ``rope_parameters: {rope_type, rope_theta}``, ``head_dim``, ``hidden_act: "gelu_pytorch_tanh"``
  (v4 hub files say ``"gelu"``, which GemmaConfig turns into the tanh approximation), ``rms_norm_eps``,
  ``attention_bias: false``, ``tie_word_embeddings: true``, ``use_bidirectional_attention: null``.
  No layer_types.
* gemma2: ``rope_parameters: {rope_type, rope_theta}`` (one for all layers), ``layer_types`` (default
  sliding for even layer index), ``sliding_window``, ``query_pre_attn_scalar``, ``attn_logit_softcapping``,
  ``final_logit_softcapping``, ``hidden_activation`` (no hidden_act), ``head_dim``, ``rms_norm_eps``,
  ``tie_word_embeddings: true``.
* gemma3_text: ``rope_parameters: {"full_attention": {rope_type, rope_theta[, factor]},
  "sliding_attention": {rope_type, rope_theta}}`` (nested by layer type), ``layer_types``,
  ``sliding_window``, ``sliding_window_pattern`` and ``_sliding_window_pattern`` (both written; only
  meaningful when layer_types is absent), ``query_pre_attn_scalar``, both softcaps (null),
  ``hidden_activation``, ``use_bidirectional_attention: false``, ``tie_word_embeddings: true``.
* gemma3 (Gemma3ForConditionalGeneration): top level ``model_type: "gemma3"``, ``text_config`` (all of the
  gemma3_text keys above, ``model_type: "gemma3_text"``), ``vision_config`` (``model_type:
  "siglip_vision_model"``), ``mm_tokens_per_image``, ``boi/eoi/image_token_index``,
  ``tie_word_embeddings``. Weights are saved in the hub's layout, ``language_model.model.*``,
  ``vision_tower.*``, ``multi_modal_projector.*`` (in memory v5 names them ``model.language_model.*`` etc.;
  :func:`to_new_gemma3_keys` writes that layout, as transformers 4.52-4.57 re-saves have it).
* olmo2: ``rope_parameters: {rope_type, rope_theta}``, ``rms_norm_eps``, ``hidden_act: "silu"``,
  ``attention_bias: false``, ``tie_word_embeddings: false``. No head_dim key, no layer_types.
* olmo3: ``rope_parameters`` nested by layer type like gemma3 (here full_attention is yarn with
  ``factor, original_max_position_embeddings, attention_factor, beta_fast, beta_slow``; sliding_attention
  default, same theta), ``layer_types``, ``sliding_window``, ``rms_norm_eps``, ``tie_word_embeddings: false``.
  transformers 5.23 reads two other forms of it oddly: a v4 file's ``rope_theta`` goes to full_attention only
  (sliding layers get 5e5, Olmo 3's own theta, whatever the file says), and the flat
  ``rope_parameters: {rope_type, rope_theta, ...}`` that transformers 5.0-5.8 wrote is ignored (both layer
  types default rope at 5e5).

HF quirks worth knowing: Gemma3 attention never applies ``attn_logit_softcapping`` (only Gemma 2 does), and
Gemma3ForConditionalGeneration never applies ``final_logit_softcapping`` (Gemma3ForCausalLM does); both are
null in Google's Gemma 3 configs.

Capture points: see :data:`POINTS` and :func:`hf_captures`.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers

FAMILIES = ("qwen2", "llama", "mistral", "qwen3")
NEW_FAMILIES = ("gpt2", "gpt_neox", "gemma", "gemma2", "gemma3_text", "gemma3", "olmo2", "olmo3")
ALL_FAMILIES = FAMILIES + NEW_FAMILIES

_BASE = dict(
    hidden_size=72,
    intermediate_size=100,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=256,
)

_SLIDING, _FULL = "sliding_attention", "full_attention"

_GEMMA3_TEXT = dict(
    _BASE,
    head_dim=16,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=20,
    sliding_window=5,
    sliding_window_pattern=3,  # layer_types [sliding, sliding, full] for 3 layers
    rope_parameters={
        _SLIDING: {"rope_type": "default", "rope_theta": 1e4},
        _FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    },
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)

# (model class, per-family config kwargs, tied embeddings by default)
# With head_dim 12 and theta 5e5 the rope wavelengths are ~6.3, 56, 499, ...
# original_max_position_embeddings=64 puts them in llama3's high (<16, kept),
# medium (16..64, interpolated) and low (>64, divided by factor) bands, so all
# three branches of the llama3 scaling are exercised.
_FAMILY_SPECS = {
    "qwen2": (
        transformers.Qwen2ForCausalLM,
        dict(_BASE, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        True,
    ),
    "llama": (
        transformers.LlamaForCausalLM,
        dict(
            _BASE,
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
        dict(_BASE, rms_norm_eps=3e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        False,
    ),
    "qwen3": (
        transformers.Qwen3ForCausalLM,
        dict(_BASE, rms_norm_eps=2e-6, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 2e5}),
        True,
    ),
    # GPT-2: learned positions, LayerNorm with bias, Conv1D ([in, out]) weights, gelu_new, MHA only.
    "gpt2": (
        transformers.GPT2LMHeadModel,
        dict(
            n_embd=72,
            n_head=6,
            n_inner=100,
            vocab_size=211,
            n_positions=256,
            layer_norm_epsilon=2e-5,
            activation_function="gelu_new",
            bos_token_id=210,
            eos_token_id=210,
        ),
        True,
    ),
    # Pythia-like: parallel residual, partial rotary 0.25 of head 24 = 6 dims (3 frequencies), fused QKV with
    # biases, exact gelu, untied embed_out. No GQA in GPT-NeoX (hence 3 heads of 24 over hidden 72).
    "gpt_neox": (
        transformers.GPTNeoXForCausalLM,
        dict(
            hidden_size=72,
            intermediate_size=100,
            num_attention_heads=3,
            vocab_size=211,
            max_position_embeddings=256,
            layer_norm_eps=1e-5,
            hidden_act="gelu",
            use_parallel_residual=True,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
            bos_token_id=0,
            eos_token_id=0,
        ),
        False,
    ),
    "gemma": (
        transformers.GemmaForCausalLM,
        dict(
            _BASE,
            head_dim=16,
            rms_norm_eps=1e-6,
            hidden_act="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        True,
    ),
    "gemma2": (
        transformers.Gemma2ForCausalLM,
        dict(
            _BASE,
            head_dim=16,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=5,  # layer_types: gemma2's default, sliding at even index ([S, F, S] for 3)
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
        True,
    ),
    "gemma3_text": (transformers.Gemma3ForCausalLM, _GEMMA3_TEXT, True),
    # The checkpoint users have for Gemma 3 4B-27B: a language model plus a (here tiny) SigLIP tower.
    "gemma3": (
        transformers.Gemma3ForConditionalGeneration,
        dict(
            text_config=dict(_GEMMA3_TEXT, model_type="gemma3_text"),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=32,
                intermediate_size=37,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,
            boi_token_index=206,
            eoi_token_index=207,
            image_token_index=208,
            eos_token_id=1,
        ),
        True,
    ),
    # OLMo 2: no pre-norms; norms on the attention and MLP outputs; q_norm/k_norm over the whole projection.
    "olmo2": (
        transformers.Olmo2ForCausalLM,
        dict(
            _BASE,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
            pad_token_id=1,
            eos_token_id=210,
        ),
        False,
    ),
    # OLMo 3 as released (7B/32B): sliding/full mix, yarn on the full layers only, default rope (same theta)
    # on the sliding ones. original_max_position_embeddings 8192 with head 12 and theta 5e5 puts the rope
    # frequencies in all three yarn regions (kept, ramp, interpolated); attention_factor scales cos/sin.
    "olmo3": (
        transformers.Olmo3ForCausalLM,
        dict(
            _BASE,
            max_position_embeddings=65536,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            attention_bias=False,
            sliding_window=5,
            layer_types=[_SLIDING, _FULL],  # cycled to num_layers: [S, F, S] for 3
            rope_parameters={
                _SLIDING: {"rope_type": "default", "rope_theta": 5e5},
                _FULL: {
                    "rope_type": "yarn",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "original_max_position_embeddings": 8192,
                    "attention_factor": 1.2079441541679836,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
            },
            pad_token_id=1,
            eos_token_id=210,
        ),
        False,
    ),
}

# Config keys that live on Gemma3Config itself; every other override of "gemma3" goes into its text_config.
_GEMMA3_TOP = {
    "text_config",
    "vision_config",
    "mm_tokens_per_image",
    "boi_token_index",
    "eoi_token_index",
    "image_token_index",
    "initializer_range",
    "eos_token_id",
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _fit_layer_types(kwargs: dict, num_layers: int) -> None:
    """An explicit ``layer_types`` of the spec, repeated/cut to ``num_layers``."""
    if "layer_types" in kwargs:
        pattern = list(kwargs["layer_types"])
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]


def _config(family, *, num_layers, tie, overrides):
    cls, family_kwargs, tie_default = _FAMILY_SPECS[family]
    tie = tie_default if tie is None else tie
    overrides = dict(overrides or {})
    if family == "gemma3":
        text = {**family_kwargs["text_config"], "num_hidden_layers": num_layers, "tie_word_embeddings": tie}
        _fit_layer_types(text, num_layers)
        top = {k: v for k, v in family_kwargs.items() if k != "text_config"}
        for key, value in overrides.items():
            (top if key in _GEMMA3_TOP else text)[key] = value
        text.update(overrides.get("text_config", {}))
        top.pop("text_config", None)
        return cls, cls.config_class(text_config=text, tie_word_embeddings=tie, **top)
    layers_key = "n_layer" if family == "gpt2" else "num_hidden_layers"
    kwargs = {**family_kwargs, layers_key: num_layers, "tie_word_embeddings": tie}
    _fit_layer_types(kwargs, num_layers)
    kwargs.update(overrides)
    return cls, cls.config_class(**kwargs)


def _norm_weights(model) -> dict[str, float | None]:
    """Parameter name -> centre of its random values for norm parameters (1 for weights used as ``w * x``, 0 for
    Gemma's ``(1 + w) * x`` weights, None for LayerNorm biases)."""
    out = {}
    for mname, mod in model.named_modules():
        cname = type(mod).__name__
        if not (isinstance(mod, torch.nn.LayerNorm) or "RMSNorm" in cname or "LayerNorm" in cname):
            continue
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if pname == "weight":
                out[full] = 0.0 if cname.startswith("Gemma") else 1.0
            else:
                out[full] = None
    return out


def _build_model(family, *, dtype, seed, num_layers, tie, overrides):
    """Random model with non-trivial weights (norms != identity, biases != 0), cast to dtype."""
    cls, config = _config(family, num_layers=num_layers, tie=tie, overrides=overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    norms = _norm_weights(model)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once
            centre = norms.get(name)
            if centre is not None:
                p.copy_(centre + 0.1 * torch.randn_like(p))
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
    """Save a tiny random ``family`` model (any of :data:`ALL_FAMILIES`) as a single-file safetensors
    checkpoint.

    ``tie`` defaults to the family's own default (True for qwen2/qwen3/gpt2/gemma*, False for
    llama/mistral/gpt_neox/olmo2/olmo3); ``overrides`` is merged last into the config kwargs (for "gemma3",
    into its text_config, except the Gemma3Config keys in ``_GEMMA3_TOP``). An explicit ``layer_types`` of a
    family spec is repeated or cut to ``num_layers``.
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


# ---------------------------------------------------------------------------------------------------------
# Older (transformers v4 / original hub) forms of the same checkpoints
# ---------------------------------------------------------------------------------------------------------


def _pattern_of(layer_types, default_rule):
    """The sliding_window_pattern p for which ``default_rule(i, p)`` reproduces layer_types, else None."""
    n = len(layer_types)
    for p in range(1, n + 2):
        if [default_rule(i, p) for i in range(n)] == list(layer_types):
            return p
    return None


def _gemma3_rule(i, p):
    return _SLIDING if (i + 1) % p else _FULL


# Gemma3TextConfig defaults of transformers 4.50-4.57: keys a v4 save_pretrained (diff dict) leaves out of
# a Gemma3ForConditionalGeneration's text_config when they hold these values (hub gemma-3-4b's text_config
# is just hidden_size, intermediate_size, model_type, num_hidden_layers, rope_scaling, sliding_window).
_GEMMA3_V4_TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    rope_scaling=None,
    sliding_window=4096,
    sliding_window_pattern=6,
    query_pre_attn_scalar=256,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)


def _rope_v4(rope: dict) -> tuple[float, dict | None]:
    rope = dict(rope)
    theta = rope.pop("rope_theta")
    return theta, (None if rope["rope_type"] == "default" else rope)


def _text_to_v4(cfg: dict) -> dict:
    """The per-model v4 rewrite of one (text) config dict; see :func:`to_v4_dialect`."""
    mt = cfg["model_type"]
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if mt == "gpt2":
        cfg["n_ctx"] = cfg["n_positions"]
        for key, default in (
            ("tie_word_embeddings", True),
            ("scale_attn_weights", True),
            ("scale_attn_by_inverse_layer_idx", False),
            ("reorder_and_upcast_attn", False),
            ("add_cross_attention", False),
        ):
            if cfg.get(key) == default:
                del cfg[key]
        return cfg
    if mt == "gpt_neox":
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rotary_emb_base"] = rope.pop("rope_theta")
        cfg["rotary_pct"] = rope.pop("partial_rotary_factor", 1.0)
        cfg["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        if cfg.get("attention_bias") is True:
            del cfg["attention_bias"]  # Pythia's config.json has no such key (always-on biases)
        return cfg
    if mt in ("gemma3_text", "olmo3"):
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"], cfg["rope_scaling"] = _rope_v4(rope[_FULL])
        local_theta, local_scaling = _rope_v4(rope[_SLIDING])
        assert local_scaling is None, "v4 had no rope scaling for sliding layers"
        if mt == "gemma3_text":
            cfg["rope_local_base_freq"] = local_theta
            cfg.pop("_sliding_window_pattern", None)
            pattern = _pattern_of(cfg["layer_types"], _gemma3_rule)
            if pattern is not None:  # else layer_types stays (as later v4 releases wrote it)
                cfg["sliding_window_pattern"] = pattern
                del cfg["layer_types"]
            if cfg.get("use_bidirectional_attention") is False:
                del cfg["use_bidirectional_attention"]
        else:
            # v4 Olmo3 rotated sliding layers with rope_theta, unscaled; v5 reads a v4 file's rope_theta into
            # full_attention only and gives the sliding layers its default 5e5.
            assert local_theta == cfg["rope_theta"], "olmo3 v4 has one rope_theta for both layer types"
        return cfg
    if mt != "gemma2":
        cfg.pop("layer_types", None)
    cfg["rope_theta"], cfg["rope_scaling"] = _rope_v4(cfg.pop("rope_parameters"))
    if mt == "qwen2":
        cfg.update(sliding_window=32768, use_sliding_window=False, max_window_layers=cfg["num_hidden_layers"])
    elif mt == "mistral":
        cfg.setdefault("sliding_window", None)
    elif mt == "gemma":
        cfg["hidden_act"] = "gelu"  # the original hub value; means the tanh approximation for Gemma
        cfg.pop("use_bidirectional_attention", None)
    elif mt == "gemma2":
        del cfg["rope_scaling"]  # gemma-2 hub configs have rope_theta only
        cfg["hidden_act"] = cfg["hidden_activation"]  # hub gemma-2 files carry both
        cfg.pop("use_bidirectional_attention", None)
        default = [_SLIDING if (i + 1) % 2 else _FULL for i in range(cfg["num_hidden_layers"])]
        if cfg.get("layer_types") == default:
            del cfg["layer_types"]  # v4 < 4.53 derived it (even layers sliding)
    return cfg


def to_v4_dialect(ckpt_dir) -> None:
    """Rewrite ``config.json`` in place into the transformers-v4 (hub) dialect.

    Hub checkpoints (e.g. Qwen2.5-0.5B, Llama-3.2-1B, Pythia, Gemma 2/3) were written by transformers 4.x,
    whose config.json differs from what 5.x writes:

    * everywhere: v5 ``dtype`` becomes v4 ``torch_dtype``.
    * qwen2/llama/mistral/qwen3/gemma/olmo2: v5 ``rope_parameters: {rope_type, rope_theta, ...}`` becomes
      top-level ``rope_theta`` plus ``rope_scaling`` (null for ``rope_type == "default"``, else the remaining
      fields incl. ``rope_type``, as llama3 checkpoints have); ``layer_types`` is dropped (derived again).
    * qwen2 gets Qwen2.5's ``sliding_window: 32768``, ``use_sliding_window: false`` and
      ``max_window_layers = num_hidden_layers``; mistral gets ``sliding_window: null`` if the key is absent
      (v5 writes its 4096 default, which is kept).
    * gemma: ``hidden_act: "gelu"`` as gemma-2b/7b's hub files say (transformers maps it to the tanh
      approximation, so the activations do not change).
    * gemma2: ``rope_theta`` only (no rope_scaling key), ``hidden_act`` next to ``hidden_activation``,
      ``layer_types`` dropped when it is the default alternation (sliding at even index).
    * gemma3_text (and the text_config of gemma3): ``rope_theta`` + ``rope_scaling`` from the full-attention
      rope, ``rope_local_base_freq`` from the sliding one, ``sliding_window_pattern`` instead of
      ``layer_types`` (kept if no pattern reproduces it). For gemma3 (multimodal) the text_config keeps only
      the keys that differ from the v4 Gemma3TextConfig defaults, as v4's diff-dict save wrote them (so a
      loader must know those defaults), and ``tie_word_embeddings`` goes away where it is true (default).
    * olmo3: ``rope_theta`` + ``rope_scaling`` (the full layers' yarn; v4 Olmo3 used default rope with the
      same theta on sliding layers) and ``layer_types`` kept (v4 Olmo3 wrote it).
    * gpt_neox: ``rotary_pct`` and ``rotary_emb_base`` (Pythia's keys), ``rope_scaling: null``, no
      ``attention_bias`` key.
    * gpt2: there is no rope to rewrite; adds hub gpt2's ``n_ctx`` (= n_positions) and drops the keys old
      files lack when they hold their defaults (``tie_word_embeddings``, ``scale_attn_weights``, ...).
      ``n_inner`` stays (null would mean 4 * n_embd). The weight layout of hub gpt2 is :func:`to_bare_gpt2`.
    """
    path = pathlib.Path(ckpt_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if cfg["model_type"] == "gemma3":
        if "dtype" in cfg:
            cfg["torch_dtype"] = cfg.pop("dtype")
        text = _text_to_v4(dict(cfg["text_config"]))
        for key in ("torch_dtype", "use_bidirectional_attention"):  # not in 4.50's text_config
            text.pop(key, None)
        cfg["text_config"] = {
            k: v for k, v in text.items() if k not in _GEMMA3_V4_TEXT_DEFAULTS or _GEMMA3_V4_TEXT_DEFAULTS[k] != v
        }
        if cfg.get("tie_word_embeddings") is True:
            del cfg["tie_word_embeddings"]
        vision = dict(cfg["vision_config"])
        vision.pop("dtype", None)
        cfg["vision_config"] = vision
    else:
        cfg = _text_to_v4(cfg)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _read_state(ckpt_dir: pathlib.Path) -> tuple[dict[str, torch.Tensor], list[pathlib.Path]]:
    from safetensors.torch import load_file

    files = sorted(ckpt_dir.glob("model*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(f))
    return state, files


def _write_state(ckpt_dir: pathlib.Path, state: dict, old_files: list[pathlib.Path]) -> None:
    from safetensors.torch import save_file

    for f in old_files:
        f.unlink()
    (ckpt_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, ckpt_dir / "model.safetensors", metadata={"format": "pt"})


def to_bare_gpt2(ckpt_dir, *, mask_dtype: str = "float32") -> None:
    """Rewrite a saved gpt2 checkpoint (single file or sharded) into the original hub form of ``gpt2``'s
    weights: one ``model.safetensors`` whose keys lack the ``transformer.`` prefix (``wte.weight``,
    ``h.0.attn.c_attn.weight``, ``ln_f.bias``, ...), no ``lm_head.weight`` (tied to wte), and per layer the old
    buffers ``h.N.attn.bias`` ([1, 1, n_ctx, n_ctx] lower triangle of ones, ``mask_dtype`` "float32", "bool"
    or "uint8") and ``h.N.attn.masked_bias`` (scalar -1e4, float32). config.json is left alone
    (:func:`to_v4_dialect` rewrites it). transformers still loads it (the prefix is stripped by
    base_model_prefix, ``attn.bias`` is in ``_keys_to_ignore_on_load_unexpected``, ``masked_bias`` is reported
    as unexpected and ignored)."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    assert cfg["model_type"] == "gpt2", cfg["model_type"]
    state, files = _read_state(ckpt_dir)
    if "lm_head.weight" in state:
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"]), "untied lm_head"
    bare = {k.removeprefix("transformer."): v for k, v in state.items() if k != "lm_head.weight"}
    n_ctx = cfg["n_positions"]
    mask = torch.tril(torch.ones(n_ctx, n_ctx)).view(1, 1, n_ctx, n_ctx)
    mask = mask.to({"float32": torch.float32, "bool": torch.bool, "uint8": torch.uint8}[mask_dtype])
    for i in range(cfg["n_layer"]):
        bare[f"h.{i}.attn.bias"] = mask.clone()
        bare[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    _write_state(ckpt_dir, bare, files)


def to_new_gemma3_keys(ckpt_dir) -> None:
    """Rewrite a saved "gemma3" (Gemma3ForConditionalGeneration) checkpoint's weights from the layout
    transformers 5 writes, which is the hub layout of gemma-3-4b..27b (``language_model.model.*``,
    ``language_model.lm_head.weight`` when untied, ``vision_tower.*``, ``multi_modal_projector.*``: v5 maps its
    in-memory names back on save), into the layout that transformers 4.52-4.57 wrote when re-saving one
    (``model.language_model.*``, ``lm_head.weight``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``),
    which is also the v5 in-memory naming. transformers loads both."""
    ckpt_dir = pathlib.Path(ckpt_dir)
    state, files = _read_state(ckpt_dir)
    out = {}
    for k, v in state.items():
        if k == "language_model.lm_head.weight":
            out["lm_head.weight"] = v
        elif k.startswith("language_model.model."):
            out["model.language_model." + k.removeprefix("language_model.model.")] = v
        elif k.startswith(("vision_tower.", "multi_modal_projector.")):
            out["model." + k] = v
        else:
            raise AssertionError(f"unexpected key {k}")
    _write_state(ckpt_dir, out, files)


# ---------------------------------------------------------------------------------------------------------
# Running the checkpoints under transformers
# ---------------------------------------------------------------------------------------------------------

POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_in", "attn_z", "mlp_hidden", "mlp_out", "resid_post")

# Where each point is read, per model_type: the decoder layers' path in the model, the residual structure,
# then per point (module path inside a layer, "in" = its first input via a forward pre-hook, "out" = its
# output). resid_pre / resid_post are always the layer's input / output. None: not a tensor HF has.
_LLAMA_HOOKS = dict(
    layers="model.layers",
    residual="sequential",
    attn_out=("self_attn", "out"),
    resid_mid=("post_attention_layernorm", "in"),
    mlp_in=("mlp", "in"),
    attn_z=("self_attn.o_proj", "in"),
    mlp_hidden=("mlp.down_proj", "in"),
    mlp_out=("mlp", "out"),
)
# Gemma 2/3: norms before *and* after each sublayer; the block adds the post-norm's output.
_SANDWICH_HOOKS = dict(
    _LLAMA_HOOKS,
    attn_out=("post_attention_layernorm", "out"),
    resid_mid=("pre_feedforward_layernorm", "in"),
    mlp_out=("post_feedforward_layernorm", "out"),
)
# OLMo 2/3: no pre-norms: the MLP reads the residual stream itself.
_OLMO_HOOKS = dict(
    _LLAMA_HOOKS,
    attn_out=("post_attention_layernorm", "out"),
    resid_mid=("mlp", "in"),
    mlp_out=("post_feedforward_layernorm", "out"),
)
_GPT2_HOOKS = dict(
    layers="transformer.h",
    residual="sequential",
    attn_out=("attn", "out"),
    resid_mid=("ln_2", "in"),
    mlp_in=("mlp", "in"),
    attn_z=("attn.c_proj", "in"),
    mlp_hidden=("mlp.c_proj", "in"),
    mlp_out=("mlp", "out"),
)
# With use_parallel_residual (Pythia) the block computes mlp(ln2(x)) + attn(ln1(x)) + x: no resid_mid tensor
# exists in HF, it is computed from the captures (see model_captures). Sequential GPT-NeoX reads it as the
# input of post_attention_layernorm.
_NEOX_HOOKS = dict(
    layers="gpt_neox.layers",
    residual="parallel",
    attn_out=("attention", "out"),
    resid_mid=None,
    mlp_in=("mlp", "in"),
    attn_z=("attention.dense", "in"),
    mlp_hidden=("mlp.dense_4h_to_h", "in"),
    mlp_out=("mlp", "out"),
)
_HOOKS = {
    "qwen2": _LLAMA_HOOKS,
    "llama": _LLAMA_HOOKS,
    "mistral": _LLAMA_HOOKS,
    "qwen3": _LLAMA_HOOKS,
    "gemma": _LLAMA_HOOKS,
    "gemma2": _SANDWICH_HOOKS,
    "gemma3_text": _SANDWICH_HOOKS,
    "gemma3": dict(_SANDWICH_HOOKS, layers="model.language_model.layers"),
    "olmo2": _OLMO_HOOKS,
    "olmo3": _OLMO_HOOKS,
    "gpt2": _GPT2_HOOKS,
    "gpt_neox": _NEOX_HOOKS,
}


def _hooks_of(model) -> dict:
    hooks = dict(_HOOKS[model.config.model_type])
    if model.config.model_type == "gpt_neox" and not model.config.use_parallel_residual:
        hooks.update(residual="sequential", resid_mid=("post_attention_layernorm", "in"))
    return hooks


def hf_captures(
    ckpt_dir,
    input_ids: np.ndarray,
    *,
    dtype: str = "float32",
    attention_mask: np.ndarray | None = None,
) -> dict[tuple[str, int], np.ndarray]:
    """Run the checkpoint under transformers and return float32 activations.

    Keys are ``(point, layer)`` for every point in :data:`POINTS` and every layer; values are
    ``[B, S, width]``: width = heads * head_dim for ``attn_z``, the MLP's inner width for ``mlp_hidden``,
    hidden_size otherwise. Positions are 0..S-1. The points (the contract the JAX side implements):

    * ``resid_pre``: the decoder block's input (== ``output_hidden_states[L]``).
    * ``attn_out``: what the block adds to the residual from attention: the attention module's output
      (Llama-like, GPT-2, GPT-NeoX); for Gemma 2/3 and OLMo 2/3 the post_attention_layernorm's output.
    * ``resid_mid``: resid_pre + attn_out, read where HF has it (Llama-like: input of
      post_attention_layernorm; Gemma 2/3: input of pre_feedforward_layernorm; OLMo 2/3: the MLP's input;
      GPT-2: input of ln_2). GPT-NeoX with parallel residual has no such tensor: resid_pre + attn_out added
      in float32 from the captures.
    * ``mlp_in``: the MLP module's input (the normed stream; for OLMo 2/3, which have no pre-norm, resid_mid).
    * ``attn_z``: the input of the attention output projection (o_proj / c_proj / dense), heads-major
      ``[B, S, heads * head_dim]`` as HF lays it out.
    * ``mlp_hidden``: the input of the MLP's down projection: act(gate) * up, or act(fc).
    * ``mlp_out``: what the block adds from the MLP: the MLP module's output; for Gemma 2/3 and OLMo 2/3 the
      post_feedforward_layernorm's output.
    * ``resid_post``: the block's output (== ``output_hidden_states[L + 1]``).
    """
    return model_captures(load_model(ckpt_dir, dtype=dtype), input_ids, attention_mask=attention_mask)


def load_model(ckpt_dir, *, dtype: str = "float32", gguf_file: str | None = None):
    """The checkpoint under transformers (eager attention); with ``gguf_file``, that GGUF file of ``ckpt_dir``,
    dequantized by transformers itself. A "gemma3" checkpoint (Gemma3ForConditionalGeneration) loads as
    that class (vision tower included; only its language model is run)."""
    cls = transformers.AutoModelForCausalLM
    if gguf_file is None and transformers.AutoConfig.from_pretrained(ckpt_dir).model_type == "gemma3":
        cls = transformers.Gemma3ForConditionalGeneration
    return cls.from_pretrained(
        ckpt_dir, dtype=_DTYPES[dtype], attn_implementation="eager", gguf_file=gguf_file
    ).eval()


def _run(model, input_ids, attention_mask, **kwargs):
    with torch.no_grad():
        return model(
            input_ids=torch.as_tensor(np.asarray(input_ids), dtype=torch.long),
            attention_mask=None if attention_mask is None else torch.as_tensor(np.asarray(attention_mask)),
            use_cache=False,
            **kwargs,
        )


def hf_logits(
    ckpt_dir, input_ids: np.ndarray, dtype: str = "float32", *, attention_mask: np.ndarray | None = None
) -> np.ndarray:
    """The checkpoint's logits under transformers, float32 ``[B, S, vocab]``, as HF computes them: the final
    norm, the LM head (tied or not), and the final logit softcap where the HF class applies one (Gemma2ForCausalLM
    and Gemma3ForCausalLM do; Gemma3ForConditionalGeneration never applies ``final_logit_softcapping``)."""
    logits = _run(load_model(ckpt_dir, dtype=dtype), input_ids, attention_mask).logits
    return logits.float().numpy()


def model_captures(
    model, input_ids: np.ndarray, *, attention_mask: np.ndarray | None = None
) -> dict[tuple[str, int], np.ndarray]:
    """:func:`hf_captures` of a model already loaded (:func:`load_model`)."""
    hooks = _hooks_of(model)
    layers = model.get_submodule(hooks["layers"])
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
    for i, layer in enumerate(layers):
        sites = [("resid_pre", ("", "in")), ("resid_post", ("", "out"))]
        sites += [(p, hooks[p]) for p in POINTS if p not in ("resid_pre", "resid_post") and hooks[p] is not None]
        for point, (path, kind) in sites:
            module = layer.get_submodule(path)
            if kind == "in":
                handles.append(module.register_forward_pre_hook(pre_hook((point, i)), with_kwargs=True))
            else:
                handles.append(module.register_forward_hook(fwd_hook((point, i))))
    try:
        result = _run(model, input_ids, attention_mask, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()

    hidden = result.hidden_states  # embeddings, layer outputs..., final entry is post-norm
    n = len(layers)
    assert len(hidden) == n + 1, (len(hidden), n)
    for i in range(n):
        assert torch.equal(out["resid_pre", i], hidden[i]), f"resid_pre {i} != hidden_states[{i}]"
        if i + 1 < n:
            assert torch.equal(out["resid_post", i], hidden[i + 1]), f"resid_post {i} != hidden_states[{i + 1}]"
        pre, attn, mlp, post = (out[p, i] for p in ("resid_pre", "attn_out", "mlp_out", "resid_post"))
        # The identities hold bit for bit in the model's dtype: HF adds exactly these tensors.
        if hooks["residual"] == "sequential":
            mid = out["resid_mid", i]
            assert torch.equal(mid, pre + attn), f"resid_mid {i} != resid_pre + attn_out"
            assert torch.equal(post, mid + mlp), f"resid_post {i} != resid_mid + mlp_out"
        else:  # GPT-NeoX parallel residual: mlp_output + attn_output + hidden_states
            assert torch.equal(post, mlp + attn + pre), f"resid_post {i} != mlp_out + attn_out + resid_pre"
            out["resid_mid", i] = pre.float() + attn.float()  # no such tensor in HF: computed, in float32
        if hooks["resid_mid"] == ("mlp", "in"):
            assert torch.equal(out["mlp_in", i], out["resid_mid", i])
        assert set(out) >= {(p, i) for p in POINTS}, sorted(k for k in out if k[1] == i)
    return {k: v.float().numpy() for k, v in out.items()}
