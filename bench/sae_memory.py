"""Memory per device of one `harvest sae train` step, from the compiler, for SAEs too large for this machine.

The step is compiled (never run) from the state's shapes for a mesh of --model fake CPU devices, latents over
`model`, with the rows one data slot of a pod holds (--batch / --data): what each device of a
data x model pod mesh holds is the same program. XLA's memory analysis gives the arguments (the state: params
and Adam's moments, donated, so the outputs reuse them), and the temporaries (gradients, activations).

Run:  .venv/bin/python bench/sae_memory.py     # 1M latents on a 4096-wide residual, v5e-256 as data=16 x model=16
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--latents", type=int, default=2**20)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--architecture", default="topk")
    parser.add_argument("--batch", type=int, default=4096, help="tokens per step, over the whole pod")
    parser.add_argument("--data", type=int, default=16, help="data slots of the pod mesh")
    parser.add_argument("--model", type=int, default=16, help="devices the latents are split over")
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.model}"

    import jax
    import jax.numpy as jnp

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M
    from harvest.sae.step import fresh_state, make_optimizer, make_step, state_shardings

    mesh = make_mesh(f"model={args.model}")
    rows = args.batch // args.data
    specs = {"sae": M.Spec(args.architecture, args.width, args.latents, args.k, args.width // 2, 1 / 32)}
    optimizers = {"sae": make_optimizer(1e-4, 1000, 10_000, "linear")}
    shapes = {"sae": jax.eval_shape(lambda: M.init_params(jax.random.key(0), specs["sae"], jnp.zeros(args.width)))}
    shardings = state_shardings(specs, optimizers, mesh, shapes)
    state = jax.eval_shape(lambda p: fresh_state(p, optimizers, specs), shapes)
    step = make_step(specs, optimizers, shardings, mesh, dead_tokens=10_000_000, scales={"sae": 1.0},
                     compute_dtype="float32")
    batch = {"sae": jax.ShapeDtypeStruct((rows, args.width), jnp.float32)}
    memory = step.lower(state, batch).compile().memory_analysis()
    gb = 1e9
    print(f"{args.architecture} SAE, {args.latents:,} latents x {args.width} wide, {rows} rows a device "
          f"({args.batch} tokens / {args.data} data slots), latents over model={args.model}, AuxK on")
    print("| per device | GB |\n|---|---|")
    print(f"| state (params + Adam), arguments | {memory.argument_size_in_bytes / gb:.2f} |")
    print(f"| outputs not aliased to the donated state | "
          f"{(memory.output_size_in_bytes - memory.alias_size_in_bytes) / gb:.2f} |")
    print(f"| temporaries (gradients, activations) | {memory.temp_size_in_bytes / gb:.2f} |")
    total = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    print(f"| peak bound | {(total + memory.temp_size_in_bytes) / gb:.2f} |")


if __name__ == "__main__":
    main()
