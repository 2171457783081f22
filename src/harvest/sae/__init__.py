"""Sparse autoencoders trained on a run's activations (`harvest sae train|eval|export`): the models as pure
functions (model.py), the step over a mesh (step.py), the data from harvest's reader (data.py), the loop
on the training runtime (job.py), evaluation (evaluate.py) and export to SAELens and sparsify (export.py)."""
