"""`harvest sae features`: what each latent of an SAE run means, from a run's stored activations and tokens.
build.py runs it: plan (inputs, checked) -> scan (the pass, resumable, split over ranks) -> state (merged) ->
contexts and logits -> the writers (site.py, dashboard.py) and features.json."""

BLOCK = 64  # latents per block handed to the writers (and per page of the site's data)
