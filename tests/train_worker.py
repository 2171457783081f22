"""One optimizer step of a tiny model on a fixed batch, on any mesh; run as a script it is one process of
the 2-process training test (tests/decoder/test_sharded_step.py).

argv: COORDINATOR NUM_PROCESSES PROCESS_ID OUT_DIR CKPT_DIR MESH GRAD_ACCUM
Process 0 writes step.safetensors: the params after the step (HF names) and the step's loss and grad norm.
"""

import sys

import numpy as np

SHAPE = (8, 32)


def train_batch() -> tuple[np.ndarray, np.ndarray]:
    """Fixed tokens [8, 32] with packed segment ids: 1-3 samples per row, some rows padded (0) at the end."""
    rng = np.random.RandomState(11)
    tokens = rng.randint(0, 211, SHAPE).astype(np.int32)
    segments = np.ones(SHAPE, np.int32)
    for row, cuts in enumerate([(10, 22), (17,), (), (5, 9), (25,), (14, 28), (), (3,)]):
        for seg, cut in enumerate(cuts, start=2):
            segments[row, cut:] = seg
    segments[1, 26:] = 0
    segments[6, 20:] = 0
    return tokens, segments


def one_step(ckpt: str, mesh, grad_accum: int = 1, remat: str = "layer"):
    """(params after one AdamW step from the checkpoint, metrics), both on the mesh.

    lr 1e-4: Adam's first update is lr * g / (|g| + eps), so an element whose gradient is near eps (1e-8)
    moves by an amount that depends on g's last bits, which differ between meshes (summation order); at
    this lr that stays under 1e-5 of the tensor's scale. The loss and the gradient norm are compared too.
    """
    import jax

    from harvest.model.config import ModelConfig
    from harvest.model.weights import load_params
    from harvest.decoder.config import TrainConfig
    from harvest.decoder.optimizer import learning_rate, make_optimizer
    from harvest.decoder.step import (
        batch_sharding,
        init_state,
        make_step,
        state_shardings,
    )

    model = ModelConfig.from_dir(ckpt)
    cfg = TrainConfig(data="unused", out="unused", model=ckpt, lr=1e-4, warmup=0, steps=10, grad_clip=0.5,
                      grad_accum=grad_accum, remat=remat)
    optimizer = make_optimizer(cfg)
    params = load_params(ckpt, model, mesh=mesh, head=True)
    shardings = state_shardings(optimizer, model, mesh, jax.eval_shape(lambda p: p, params))
    state = init_state(params, optimizer, shardings)
    step = make_step(model, mesh, optimizer, shardings, compute_dtype="float32", remat=remat,
                     grad_accum=grad_accum, batch_shape=SHAPE, lr_at=learning_rate(cfg))
    sharding = batch_sharding(SHAPE, mesh)
    tokens, segments = (jax.make_array_from_callback(SHAPE, sharding, lambda index, a=a: a[index])
                        for a in train_batch())
    state, metrics = step(state, tokens, segments)
    return state["params"], metrics


def main(coordinator, num_processes, process_id, out_dir, ckpt, mesh_spec, grad_accum):
    from harvest.runtime.distributed import initialize

    info = initialize(coordinator, int(num_processes), int(process_id), timeout_s=60)
    from jax.experimental.multihost_utils import process_allgather
    from safetensors.numpy import save_file

    from harvest.model.config import ModelConfig
    from harvest.model.weights import to_hf
    from harvest.runtime.mesh import make_mesh

    params, metrics = one_step(ckpt, make_mesh(mesh_spec), int(grad_accum))
    params = process_allgather(params, tiled=True)
    metrics = {k: np.asarray(v.addressable_data(0)) for k, v in metrics.items()}  # replicated: each has it
    if info.process_index == 0:
        tensors = to_hf(params, ModelConfig.from_dir(ckpt))
        tensors.update({f"metric.{k}": np.asarray(v, np.float32).reshape(-1) for k, v in metrics.items()})
        save_file(tensors, f"{out_dir}/step.safetensors")
    print(f"process {info.process_index}: done", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
