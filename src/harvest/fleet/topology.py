"""What an accelerator name (SkyPilot's spelling) is made of: hosts, chips and the devices JAX sees.

Sources (checked 2026-11; our users' own deployment guides disagree with each other, e.g. a v5e-64 as
"4 hosts x 16 chips" and as "4 x 8" -- Google's pages below say 16 hosts x 4 chips):
- v5e: https://cloud.google.com/tpu/docs/v5e -- accelerator type v5litepod-N counts chips; slices of 1, 4
  and 8 chips are one host (ct5lp-hightpu-1t/4t/8t); multi-host slices (16..256 chips) are made of 4-chip
  hosts, so v5litepod-64 (8x8) is 16 hosts.
- v6e: https://cloud.google.com/tpu/docs/v6e -- the same shapes as v5e: v6e-N counts chips, 1/4/8 on one
  host, 16..256 on 4-chip hosts.
- v4: https://cloud.google.com/tpu/docs/v4 -- v4-N counts TensorCores, 2 per chip (one JAX device per
  chip, megacore), 4 chips per host: v4-32 is 16 chips on 4 hosts, v4-64 32 chips on 8 hosts.
- v5p: https://cloud.google.com/tpu/docs/v5p -- v5p-N counts TensorCores, 2 per chip, 4 chips per host
  (2x2x1 = 4 chips on 1 host ... 16x16x24 = 6144 chips on 1536 hosts).
- v2/v3: https://cloud.google.com/tpu/docs/system-architecture-tpu-vm -- vN-M counts TensorCores, 2 per
  chip, 4 chips (8 cores) per host, and JAX sees one device per TensorCore.
- cpu: SkyPilot's CPU-only VMs (`cpus:` instead of `accelerators:`), one JAX device per node.
- GPUs: SkyPilot's `NAME:COUNT` (https://docs.skypilot.co/en/latest/reference/yaml-spec.html), COUNT GPUs
  per node, one JAX device each; a multi-node group sets num_nodes.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from harvest.errors import UserError


class AcceleratorError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class TpuGeneration:
    counts_cores: bool  # the -N suffix counts TensorCores (2 per chip), not chips
    devices_per_chip: int  # what JAX sees per chip
    single_host_max: int  # chips that still fit on one host
    chips_per_host: int  # in multi-host slices
    sizes: tuple[int, ...]  # the -N suffixes Google sells


TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v2": TpuGeneration(True, 2, 4, 4, (8, 32, 128, 256, 512)),
    "v3": TpuGeneration(True, 2, 4, 4, (8, 32, 64, 128, 256, 512, 1024, 2048)),
    "v4": TpuGeneration(True, 1, 4, 4, (8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)),
    "v5litepod": TpuGeneration(False, 1, 8, 4, (1, 4, 8, 16, 32, 64, 128, 256)),
    "v5p": TpuGeneration(True, 1, 4, 4, (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 6144, 8192, 12288)),
    "v6e": TpuGeneration(False, 1, 8, 4, (1, 4, 8, 16, 32, 64, 128, 256)),
}
GPUS = ("B200", "H200", "H100", "H100-MEGA", "A100", "A100-80GB", "L40S", "L4", "A10G", "A10", "V100", "T4")
GPU_COUNTS = (1, 2, 4, 8, 16)
EXAMPLES = "e.g. tpu-v5litepod-8, tpu-v6e-8, tpu-v4-64, tpu-v5p-8, H100:8"
_TPU = re.compile(r"tpu-(v\d+[a-z]*)-(\d+)")
_GPU = re.compile(r"([A-Za-z0-9-]+?)(?::(\d+))?")


@dataclasses.dataclass(frozen=True)
class Topology:
    accelerator: str
    kind: str  # "tpu" | "gpu" | "cpu"
    hosts: int  # processes of one worker (TPU VM hosts, or GPU nodes)
    chips: int  # in all hosts together
    devices: int  # JAX devices in all hosts together

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    def describe(self) -> str:
        extra = f", {self.devices} devices" if self.devices != self.chips else ""
        return f"{self.hosts} host{'s' * (self.hosts > 1)} x {self.chips_per_host} chips{extra}"


def topology(accelerator: str, num_nodes: int = 1) -> Topology:
    """The shape of one worker on `accelerator` (SkyPilot's name); GPU groups may span `num_nodes` nodes."""
    name = str(accelerator).strip()
    if match := _TPU.fullmatch(name):
        generation, size = TPU_GENERATIONS.get(match.group(1)), int(match.group(2))
        if generation is None or size not in generation.sizes:
            raise AcceleratorError(_unknown(name))
        if num_nodes != 1:
            raise AcceleratorError(f"accelerator {name}: a TPU slice is one node (SkyPilot runs the command on "
                                   f"each of its hosts); drop num_nodes {num_nodes}")
        chips = size // 2 if generation.counts_cores else size
        hosts = 1 if chips <= generation.single_host_max else chips // generation.chips_per_host
        return Topology(name, "tpu", hosts, chips, chips * generation.devices_per_chip)
    if name.lower() == "cpu":  # SkyPilot's CPU VMs (no accelerator): one JAX device per process
        return Topology("cpu", "cpu", num_nodes, num_nodes, num_nodes)
    match = _GPU.fullmatch(name)
    if match and match.group(1).upper() in GPUS:
        count = int(match.group(2) or 1)
        if count not in GPU_COUNTS:
            raise AcceleratorError(f"accelerator {name}: {count} GPUs per node; choose one of "
                                   f"{', '.join(map(str, GPU_COUNTS))}")
        return Topology(f"{match.group(1).upper()}:{count}", "gpu", num_nodes, count * num_nodes, count * num_nodes)
    raise AcceleratorError(_unknown(name))


def known_accelerators() -> list[str]:
    return [f"tpu-{g}-{n}" for g, gen in TPU_GENERATIONS.items() for n in gen.sizes] + \
           [f"{gpu}:{n}" for gpu in GPUS for n in GPU_COUNTS]


def _unknown(name: str) -> str:
    guess = name.replace("tpu-v5e-", "tpu-v5litepod-").replace("v5e-", "tpu-v5litepod-")
    close = difflib.get_close_matches(guess if guess != name else name, known_accelerators(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown accelerator {name!r}{hint}: use SkyPilot's names, {EXAMPLES}"
