"""One process of the 2-process reader test (tests/read/test_reader_consumers.py): global JAX batches over meshes.

argv: COORDINATOR NUM_PROCESSES PROCESS_ID RUN_URL OUT_DIR. For each mesh below, reads an epoch of
`run.jax_batches` and checks every row this process's devices hold against the row stored for its token;
writes mesh.{name}.{process}.json: per step, {first row of each block this process holds: its tokens},
or the one-line refusal for a mesh it does not serve. The test compares the processes' files.
"""

import json
import sys

import numpy as np

BATCH, NAME = 16, "mlp_out.3"


def meshes(jax):
    """name -> Mesh over 2 processes x 4 devices (process 0 holds devices 0-3)."""
    from jax.sharding import Mesh

    d = np.array(jax.devices())
    return {
        "data1": Mesh(d.reshape(1, 8), ("data", "model")),  # one data index over both processes
        "data2": Mesh(d.reshape(2, 4), ("data", "model")),  # a data index per process
        "data2_spanning": Mesh(d.reshape(4, 2).T, ("data", "model")),  # each data index spans both processes
        "data8": Mesh(d.reshape(8, 1), ("data", "model")),  # four data indices per process
        "overlapping": Mesh(d[[0, 3, 1, 4, 2, 5, 6, 7]].reshape(4, 2), ("data", "model")),  # blocks 0-2 / 1-3
    }


def main(coordinator, num_processes, process_id, url, out_dir):
    from harvest.runtime.distributed import initialize

    info = initialize(coordinator, int(num_processes), int(process_id), timeout_s=60)

    import jax

    from harvest.read import open_run

    run = open_run(url)
    stored = {}
    for sc in run.shards:
        shard = run.read_shard(sc)
        stored.update(zip(shard["tokens"].tolist(), shard[NAME]))
    for name, mesh in meshes(jax).items():
        out = {"steps": []}
        try:
            for batch in run.jax_batches(BATCH, NAME, mesh=mesh, seed=5, piece_bytes=40 * (4 + 2 * 16)):
                step = {}
                acts = {s.index[0].start or 0: np.asarray(s.data) for s in batch[NAME].addressable_shards}
                for s in batch["tokens"].addressable_shards:
                    start, tokens = s.index[0].start or 0, np.asarray(s.data)
                    for t, row in zip(tokens.tolist(), acts[start]):
                        assert np.array_equal(row, stored[t]), (name, t)
                    step.setdefault(str(start), tokens.tolist())
                    assert step[str(start)] == tokens.tolist(), "devices of one process disagree"
                assert batch[NAME].shape == (BATCH, 16) and batch[NAME].sharding.mesh == mesh
                out["steps"].append(step)
        except ValueError as e:
            out["refused"] = str(e)
        with open(f"{out_dir}/mesh.{name}.{info.process_index}.json", "w") as f:
            json.dump(out, f)
    print(f"process {info.process_index}: done", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
