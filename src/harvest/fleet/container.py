"""The command a TPU host runs when the fleet gives an image. SkyPilot runs a TPU task on the VM itself (it
takes no image there), so the task starts harvest's container with `docker run`, and that command must give
the container what a worker needs:
- an init (`--init`, docker's tini) as pid 1: harvest as pid 1 would ignore SIGTERM, so cancelling or
  preempting the job (SkyPilot SIGTERMs the task's processes, docker passes it on; a VM shutting down stops
  its containers) would leave it running until SIGKILL. With an init, SIGTERM reaches harvest;
- the environment, forwarded by name only (`--env NAME`: docker copies the host's value when it is set, and
  nothing otherwise), so no value lands in the task YAML or a log: what SkyPilot sets on every host, what
  JAX, libtpu, gcsfs, s3fs and huggingface_hub read, and the fleet's own envs and secrets;
- the files those variables name (credentials, the hub cache) at the same path, credentials read-only; and,
  with shared_paths, the run's local data, out and model.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

# What SkyPilot 0.14 sets on every host of a task (sky/backends/task_codegen.py, cloud_vm_ray_backend.py,
# sky/jobs/controller.py): the node layout harvest's multi-node flags read, and the job's identity.
SKYPILOT_ENV = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES", "SKYPILOT_NUM_GPUS_PER_NODE",
                "SKYPILOT_TASK_ID", "SKYPILOT_MANAGED_JOB_ID", "SKYPILOT_CLUSTER_INFO")
# Multi-host settings (harvest.runtime.distributed, JAX's TPU cluster detection) and compiler flags.
RUNTIME_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_INDEX", "JAX_PLATFORMS", "XLA_FLAGS",
               "LIBTPU_INIT_ARGS", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE",
               "TPU_PROCESS_ADDRESSES", "TPU_SKIP_MDS_QUERY", "MEGASCALE_COORDINATOR_ADDRESS",
               "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID")
# Storage credentials and endpoints (harvest.storage: gcsfs, s3fs/botocore) and the hub's.
CREDENTIAL_ENV = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST",
                  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                  "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                  "AWS_ENDPOINT_URL_S3", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE",
                  "HF_TOKEN", "HF_HOME", "HF_ENDPOINT", "HF_HUB_OFFLINE")
# Variables naming a host file the container must see at the same path. A missing credential file fails
# the start (`--mount` insists on its source); the hub cache is created if absent (`--volume`).
CREDENTIAL_FILES = ("GOOGLE_APPLICATION_CREDENTIALS", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
                    "AWS_CA_BUNDLE")
CACHE_DIRS = ("HF_HOME",)
# docker's own default is 10 s; a preempted GCE VM has 30 s, which a checkpoint on SIGTERM may need.
STOP_TIMEOUT_S = 25


def forwarded_env(own: Iterable[str]) -> list[str]:
    """Every name the container gets from the host: the fixed lists, then the task's own (no repeats)."""
    return list(dict.fromkeys([*SKYPILOT_ENV, *RUNTIME_ENV, *CREDENTIAL_ENV, *own]))


def docker_run(image: str, args: list[str], own_env: Iterable[str], mounts: dict[str, bool]) -> str:
    """`docker run` of `image` with `args` (harvest's own), as a multi-line shell command.

    own_env: the task's variable names (the plan's and the fleet's envs and secrets); mounts: local paths
    the container must see at the same place, each read-only (True) or not.
    """
    names = forwarded_env(own_env)
    lines = [f"docker run --rm --init --stop-timeout {STOP_TIMEOUT_S} --privileged --net=host"]
    lines += [" ".join(f"--env {n}" for n in names[i:i + 4]) for i in range(0, len(names), 4)]
    lines += [f'${{{v}:+--mount "type=bind,src=${v},dst=${v},readonly"}}' for v in CREDENTIAL_FILES]
    lines += [f'${{{v}:+--volume "${v}:${v}"}}' for v in CACHE_DIRS]
    lines += [f"--volume {shlex.quote(f'{path}:{path}' + (':ro' if ro else ''))}" for path, ro in mounts.items()]
    lines.append(" ".join(shlex.quote(a) for a in [image, *args]))
    return " \\\n  ".join(lines)
