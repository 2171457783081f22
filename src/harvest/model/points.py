"""Capture points and the `--points` spec: which activations, at which layers; harvest's own names
(`resid_post:20-27`) or TransformerLens hook names (`blocks.12.hook_resid_post`), mixed at will."""

from __future__ import annotations

import dataclasses
import re

from harvest.errors import UserError
from harvest.ranges import format_ranges
from harvest.tl_hooks import TL_HOOKS

# In the order they arise inside a layer. attn_z: each head's attention output before the output projection,
# [n, heads x head_dim] with head h at [h * head_dim, (h + 1) * head_dim); attn_out and mlp_out: what the block
# adds to the residual (after the post-norm on Gemma 2/3's and OLMo's blocks); mlp_in: the MLP's input (its
# pre-norm's output; on OLMo's blocks, which have none, resid_mid); resid_mid: resid_pre + attn_out (on
# GPT-NeoX's parallel blocks too, where the MLP reads resid_pre).
POINTS = ("resid_pre", "attn_z", "attn_out", "resid_mid", "mlp_in", "mlp_hidden", "mlp_out", "resid_post")
_LAYERS = re.compile(r"^(\d+)(?:-(\d+))?$")
# A TransformerLens hook name without its "blocks.N." -> our point.
_TL_POINT = {hook.split(".", 2)[2]: point for point, hook in TL_HOOKS.items()}
_TL_NAME = re.compile(r"^blocks\.(\d+)\.(.+)$")


class PointsError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class CapturePlan:
    """For each captured point (in POINTS order), its sorted layers. Hashable: a static jit argument."""

    points: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def num_layers(self) -> int:
        """Layers that must run: up to the last captured one (early exit)."""
        return max(layers[-1] for _, layers in self.points) + 1

    def keys(self) -> list[tuple[str, int]]:
        return [(point, layer) for point, layers in self.points for layer in layers]

    def spec(self) -> str:
        return ",".join(f"{point}:{format_ranges(layers)}" for point, layers in self.points)


def from_tl_hook(name: str, where: str = "") -> tuple[str, int] | None:
    """(point, layer) of a TransformerLens hook name; None where `name` is not one (`blocks.N.` or `hook_`);
    a TL hook harvest has no point for is refused in one line (after `where`, the input) naming those it has."""
    match = _TL_NAME.match(name)
    if match is None and "hook_" not in name:
        return None
    if match is None or match.group(2) not in _TL_POINT:
        hooks = ", ".join(TL_HOOKS[p].format(layer="N") for p in POINTS)
        raise PointsError(f"{where}harvest captures no TransformerLens hook {name!r}; it has {hooks} "
                          f"(or harvest's own {', '.join(POINTS)})")
    return _TL_POINT[match.group(2)], int(match.group(1))


def parse_points(spec: str, num_layers: int) -> CapturePlan:
    """Parse `resid_post:20-27,mlp_out:12,attn_out:0,3,5` (`all` = every layer) against the model depth;
    a TransformerLens hook name (`blocks.3.hook_mlp_out`) is one point at one layer, among the others."""
    chosen: dict[str, set[int]] = {}
    current = None
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            raise PointsError(f"--points {spec!r}: empty item; write e.g. resid_post:20-27,mlp_out:12")
        hook = from_tl_hook(token, f"--points {spec!r}: ")
        if hook is not None:
            current = None  # a bare layer after a hook name belongs to no point
            chosen.setdefault(hook[0], set()).update(_parse_layers(str(hook[1]), spec, num_layers))
            continue
        if ":" in token:
            current, token = (s.strip() for s in token.split(":", 1))
            if current not in POINTS:
                raise PointsError(f"--points {spec!r}: unknown point {current!r} (points: {', '.join(POINTS)})")
            chosen.setdefault(current, set())
        if current is None:
            raise PointsError(f"--points {spec!r}: {token!r} has no point; write e.g. resid_post:{token}")
        chosen[current] |= _parse_layers(token, spec, num_layers)
    if not chosen:
        raise PointsError(f"--points {spec!r}: nothing to capture")
    return CapturePlan(tuple((p, tuple(sorted(chosen[p]))) for p in POINTS if p in chosen))


def _parse_layers(token: str, spec: str, num_layers: int) -> set[int]:
    if token == "all":
        return set(range(num_layers))
    match = _LAYERS.match(token)
    if not match:
        raise PointsError(f"--points {spec!r}: {token!r} is not a layer, a range a-b, or 'all'")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) else lo
    if lo > hi:
        raise PointsError(f"--points {spec!r}: range {token!r} runs backwards")
    if hi >= num_layers:
        raise PointsError(f"--points {spec!r}: layer {hi} does not exist; the model has layers 0-{num_layers - 1}")
    return set(range(lo, hi + 1))
