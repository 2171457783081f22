"""FeaturesConfig: the settings of `harvest sae features`, from a YAML file and flags (flags win), validated with
one-line errors (the fleet's `features:` section is checked by the same validation)."""

from __future__ import annotations

import dataclasses

from harvest.config import ConfigError, check_settings, setting

STREAMS = ("held-out", "all")  # or a range list such as 0-7,12


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeaturesConfig:
    sae: str = setting("the SAE run's URL (`harvest sae train --out`)")
    out: str = setting("where the site goes (index.html, its script, the latents' data, features.json) and the "
                       "pass's resumable state: a local directory, gs:// or s3://")
    run: str | None = setting("the harvest run whose tokens are read (default: the run(s) the SAE trained on)", None)
    streams: str = setting("the streams read: held-out (those the SAE never trained on; needs --holdout-streams "
                           "at training, else give all), all, or a list such as 0-7,12", "held-out")
    step: int | None = setting("the SAE checkpoint's step (default: newest)", None, minimum=0)
    tokens: int = setting("read at most this many tokens per process (0: every token of the streams)", 0, minimum=0)
    batch_tokens: int = setting("tokens encoded at a time on the devices", 1024, minimum=1)
    top: int = setting("top examples kept per latent (the tokens where it fires hardest)", 20, minimum=1)
    window: int = setting("tokens of context shown either side of an example's token (within its sample)", 8,
                          minimum=0)
    bins: int = setting("quantile bins of each latent's activations to draw examples from", 4, minimum=0)
    per_bin: int = setting("examples per quantile bin (drawn uniformly from the tokens the latent fired on)", 5,
                           minimum=1)
    logits: int = setting("tokens listed that each latent's decoder direction promotes and suppresses most "
                          "(through the model's unembedding; 0: none)", 10, minimum=0)
    model: str | None = setting("the model the run came from, for its tokenizer and unembedding (default: the one "
                                "the run's run.json names)", None)
    dense_above: float = setting("a latent firing on more than this fraction of tokens is marked dense", 0.1,
                                 minimum=0)
    neuronpedia: bool = setting("also write the SAEDashboard/Neuronpedia JSON layout under OUT/neuronpedia/", False)
    rank: int = setting("this process's share of the run's shards (with --world): processes split the run and "
                        "the last to finish merges and writes the site", 0, minimum=0)
    world: int = setting("how many processes split the run", 1, minimum=1)

    def validate(self) -> FeaturesConfig:
        check_settings(self)
        if not self.sae:
            raise ConfigError("give the SAE run's URL (`harvest sae features SAE_RUN --out DIR`)")
        if not self.out:
            raise ConfigError("--out: give the directory for the site (a local directory, gs:// or s3://)")
        if self.rank >= self.world:
            raise ConfigError(f"--rank {self.rank}: give 0 .. {self.world - 1} for --world {self.world}")
        if self.top < 1:
            raise ConfigError("--top: keep at least one example per latent")
        return self
