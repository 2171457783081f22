"""One process of the multi-process test (tests/runtime/test_distributed.py): join, run the sharded forward, dump.

argv: COORDINATOR NUM_PROCESSES PROCESS_ID OUT_DIR MESHES NAME=CKPT_DIR...
Every process runs the same computations in the same order (multi-controller); process 0 writes
{name}.{mesh}.safetensors with the gathered captures, and every process writes info.{id}.json.
"""

import json
import sys

import numpy as np


def batch() -> tuple[np.ndarray, np.ndarray]:
    """Fixed tokens [8, 16] and packed segment ids: 1-3 samples per row, some rows padded (0) at the end."""
    rng = np.random.RandomState(7)
    tokens = rng.randint(0, 211, (8, 16)).astype(np.int32)
    segments = np.ones((8, 16), np.int32)
    for row, cuts in enumerate([(5, 11), (9,), (), (3, 4), (12,), (7, 14), (), (2,)]):
        for seg, cut in enumerate(cuts, start=2):
            segments[row, cut:] = seg
    segments[1, 13:] = 0
    segments[6, 10:] = 0
    return tokens, segments


def main(coordinator, num_processes, process_id, out_dir, meshes, *ckpts):
    from harvest.runtime.distributed import initialize

    info = initialize(coordinator, int(num_processes), int(process_id), timeout_s=60)
    again = initialize(coordinator, int(num_processes), int(process_id))  # idempotent

    import jax
    from jax.experimental.multihost_utils import process_allgather
    from safetensors.numpy import save_file

    from harvest.model.config import ModelConfig
    from harvest.model.points import POINTS, CapturePlan
    from harvest.model.transformer import forward
    from harvest.model.weights import load_params
    from harvest.runtime.mesh import constrainer, describe, logical_sharding, make_mesh

    with open(f"{out_dir}/info.{info.process_index}.json", "w") as f:
        json.dump({"info": info.__dict__, "again": again.__dict__}, f)

    tokens, segments = batch()
    fwd = jax.jit(forward, static_argnames=("cfg", "plan", "constrain"))
    for item in ckpts:
        name, path = item.split("=", 1)
        cfg = ModelConfig.from_dir(path)
        plan = CapturePlan(tuple((p, tuple(range(cfg.num_layers))) for p in POINTS))
        for spec in meshes.split(","):
            mesh = make_mesh(spec)
            params = load_params(path, cfg, dtype=np.float32, mesh=mesh, num_layers=plan.num_layers)
            # Every process holds the whole batch; each places only its own devices' rows.
            ids, segs = (
                jax.make_array_from_callback(a.shape, logical_sharding(a.shape, ("batch", None), mesh),
                                             lambda index, a=a: a[index])
                for a in (tokens, segments)
            )
            out = fwd(params, ids, segs, cfg=cfg, plan=plan, constrain=constrainer(mesh))
            gathered = process_allgather(out, tiled=True)
            if info.process_index == 0:
                save_file({p: np.ascontiguousarray(v) for p, v in gathered.items()},
                          f"{out_dir}/{name}.{spec}.safetensors", metadata={"mesh": describe(mesh)})
    print(f"process {info.process_index}: done", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
