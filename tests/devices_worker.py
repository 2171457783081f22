"""One process's forward on its N CPU devices (tests/model/test_devices.py): a data=N mesh, 8 packed rows of 2,048
tokens per device, as the seeds' workload. Prints {"seconds_per_row", "peak_rss"} as JSON: the steady forward's
wall time per row (compile out) and the process's peak resident memory in bytes.

argv: CKPT_DIR DEVICES ATTENTION   (XLA_FLAGS must give the process DEVICES CPU devices)
"""

import json
import resource
import sys
import time

ROWS_PER_DEVICE, SEQ, STEPS = 8, 2048, 3
POINTS = "resid_post:all,mlp_in:0"


def packed(rows: int, seed: int = 0):
    """Token rows filled back to back with samples of 10-400 tokens (segments 1, 2, ...), the rest padding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 211, (rows, SEQ)).astype(np.int32)
    segments = np.zeros((rows, SEQ), np.int32)
    for row in range(rows):
        ends = np.cumsum(rng.integers(10, 400, 40))
        ends = ends[ends < SEQ - 50]
        segments[row, : ends[-1]] = np.repeat(np.arange(1, len(ends) + 1), np.diff(ends, prepend=0))
    return tokens, segments


def main(ckpt: str, devices: str, attention: str) -> None:
    import jax

    from harvest.model import load_decoder
    from harvest.runtime.mesh import make_mesh

    assert jax.device_count() == int(devices), "XLA_FLAGS sets the process's CPU devices"
    decoder = load_decoder(ckpt, POINTS, make_mesh(f"data={devices}"), "float32", "bfloat16",
                           moment_slots=4, attention=attention)
    tokens, segments = packed(ROWS_PER_DEVICE * int(devices))
    jax.block_until_ready(decoder.step(tokens, segments))  # compiles
    start = time.perf_counter()
    for _ in range(STEPS):
        jax.block_until_ready(decoder.step(tokens, segments))
    seconds = (time.perf_counter() - start) / STEPS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds_per_row": seconds / len(tokens), "peak_rss": peak}))


if __name__ == "__main__":
    main(*sys.argv[1:])
