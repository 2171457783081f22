"""TinyRecursiveModels (TRM) in JAX: config and presets, model, loss, optimizers and the jitted train step.

Pure functions over params pytrees; the `harvest train` job wires them to data, checkpoints and metrics.
"""
