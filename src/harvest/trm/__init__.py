"""TinyRecursiveModels (TRM) in JAX: hyperparameters and presets (hparams.py), model, loss, optimizers, the
jitted train step, and the trainer on the training runtime (trainer.py; its command's settings: config.py)."""
