"""`harvest sae features`: what each latent of an SAE run means, from a run's stored activations and tokens.
build.py runs it: plan (inputs, checked) -> scan (the pass, resumable, split over ranks) -> state (merged) ->
contexts and logits -> the writers (writer.py: site.py, dashboard.py) and features.json."""
