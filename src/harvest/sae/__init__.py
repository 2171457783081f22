"""Sparse autoencoders trained on a run's activations (`harvest sae train|eval|export`): the models as pure
functions (model.py), the step over a mesh (step.py), the data from harvest's reader (data.py), the trainer
on the training runtime (trainer.py), evaluation (evaluate.py) and export to SAELens and sparsify (export.py)."""
