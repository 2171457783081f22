"""The TransformerLens hook name of each of harvest's capture points (model.points), where SAELens and TL users know
them from: a leaf module, so that a run's report (store) names them without importing the model."""

from __future__ import annotations

# TL's hook_z is [.., heads, head_dim]; harvest stores it flat (POINTS).

TL_HOOKS = {"resid_pre": "blocks.{layer}.hook_resid_pre", "attn_z": "blocks.{layer}.attn.hook_z",
            "attn_out": "blocks.{layer}.hook_attn_out", "resid_mid": "blocks.{layer}.hook_resid_mid",
            "mlp_in": "blocks.{layer}.ln2.hook_normalized", "mlp_hidden": "blocks.{layer}.mlp.hook_post",
            "mlp_out": "blocks.{layer}.hook_mlp_out", "resid_post": "blocks.{layer}.hook_resid_post"}


def tl_hook_name(point: str, layer: int) -> str:
    """The TransformerLens hook name of a point at a layer: `blocks.12.hook_resid_post`."""
    return TL_HOOKS[point].format(layer=layer)


def tl_hook_of_tensor(tensor: str) -> str | None:
    """The TransformerLens hook name of a run's tensor (`resid_post.12`, see harvest.store.format.tensor_name);
    None for a tensor that is no point at a layer."""
    point, _, layer = tensor.rpartition(".")
    return tl_hook_name(point, int(layer)) if point in TL_HOOKS and layer.isdigit() else None
