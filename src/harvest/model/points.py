"""Capture points and the `--points` spec: which activations, at which layers."""

from __future__ import annotations

import dataclasses
import re

from harvest.errors import UserError
from harvest.ranges import format_ranges

# In the order they arise inside a layer.
POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_hidden", "mlp_out", "resid_post")
_LAYERS = re.compile(r"^(\d+)(?:-(\d+))?$")


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


def parse_points(spec: str, num_layers: int) -> CapturePlan:
    """Parse `resid_post:20-27,mlp_out:12,attn_out:0,3,5` (`all` = every layer) against the model depth."""
    chosen: dict[str, set[int]] = {}
    current = None
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            raise PointsError(f"--points {spec!r}: empty item; write e.g. resid_post:20-27,mlp_out:12")
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
