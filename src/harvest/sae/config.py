"""SaeConfig: the settings of `harvest sae train` on top of the runtime's, from a YAML file and flags (flags win),
validated with one-line errors."""

from __future__ import annotations

import dataclasses
import math

from harvest.config import ConfigError, check_settings, setting, str_list
from harvest.model.points import from_tl_hook
from harvest.store.format import tensor_name
from harvest.training.config import RuntimeConfig, compute_dtype_setting, like, param_dtype_setting

ARCHITECTURES = ("topk", "batchtopk", "jumprelu", "relu")
DEFAULT_MAX_NORM = 10.0  # --max-norm's default R (bench/outliers.py; docs/saes.md, Massive activations)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaeConfig(RuntimeConfig):
    run: list[str] = setting("harvest run URL(s) to train on, a YAML list or comma-separated (every batch takes "
                             "equal parts of each)")
    tensors: list[str] = setting("tensor(s) of the run, a YAML list or comma-separated, e.g. resid_post.12 (or its "
                                 "TransformerLens name blocks.12.hook_resid_post); one SAE each, all in one pass")
    out: str = like(RuntimeConfig, "out", help="the SAE run's URL (checkpoints, metrics, run.json): a local "
                                               "directory, gs:// or s3://")
    architecture: str = setting("activation and sparsity penalty", "topk", choices=ARCHITECTURES)
    latents: int | None = setting("latents per SAE (default: --expansion x the tensor's width)", None, minimum=1)
    expansion: int = setting("latents as a multiple of the width, when --latents is not given", 16, minimum=1)
    k: int = setting("active latents per token (topk, batchtopk: the batch's mean)", 32, minimum=1)
    aux_k: int | None = setting("dead latents the AuxK loss uses (default: half the width)", None, minimum=1)
    aux_coeff: float = setting("weight of the AuxK loss on dead latents (0 = off, as sparsify's default)", 0.0,
                               minimum=0)
    l1_coeff: float = setting("relu: weight of the L1 penalty (times decoder norms); jumprelu: of the L0 penalty",
                              5.0, minimum=0)
    jumprelu_bandwidth: float = setting("jumprelu: width of the straight-through estimator's window", 0.001,
                                        minimum=0)
    jumprelu_init_threshold: float = setting("jumprelu: initial threshold", 0.001, minimum=0)
    dead_tokens: int = setting("a latent is dead when it fired on none of the last W tokens, W = this many (or every "
                               "token trained, while fewer): the dead fraction logged, and the latents AuxK trains "
                               "(once W tokens were trained); `sae eval` counts over the tokens it reads",
                               10_000_000, minimum=1)
    lr: float | None = setting("Adam's peak learning rate (default: 2e-4 / sqrt(latents / 2^14), as sparsify)",
                               None, minimum=0)
    warmup: int = setting("linear warmup steps (from 0, as sparsify's adam)", 1000, minimum=0)
    schedule: str = setting("learning rate after warmup (linear: to 0 at the budget, as sparsify)", "linear",
                            choices=("linear", "cosine", "constant"))
    batch_tokens: int = setting("tokens per optimizer step (global)", 4096, minimum=1)
    tokens: int = setting("the budget: train until this many tokens", 100_000_000, minimum=0)
    normalize: str = setting("inputs as stored, or scaled to E||x||^2 = width with the run's own stats",
                             "none", choices=("none", "run-stats"))
    b_dec_init: str = setting("decoder bias at the start: the first batch's mean or geometric median", "mean",
                              choices=("mean", "geometric-median", "zeros"))
    skip_first: int = setting("leave out each sample's first N tokens (attention sinks, whose norms dwarf the rest) "
                              "from training, and from `sae eval` (its reconstruction and the CE splice)", 0,
                              minimum=0)
    max_norm: float | None = setting("leave out every token whose L2 norm exceeds R x the run's median token norm "
                                     "(massive activations, wherever they sit; the median from a seeded sample of "
                                     "the run, recorded in run.json) from training, and from `sae eval` (its "
                                     f"reconstruction and the CE splice); default {DEFAULT_MAX_NORM:g} (off with "
                                     "--follow: no median yet); 0 = off", None, minimum=0)
    follow: bool = setting("train while `harvest extract` still writes --run: the first epoch takes each shard once as "
                           "it is committed, waits (saying for what) when it has read every committed shard, and ends "
                           "when every stream of the run is complete; later epochs read the whole run, reshuffled. A "
                           "run not started yet is waited for; the shards each round took are recorded in "
                           "OUT/follow/. Training still ends at --tokens", False)
    follow_poll: float = setting("--follow: seconds between listings of the run while waiting for shards", 30.0,
                                 minimum=0)
    holdout_streams: int = setting("streams of the run left out of training, chosen by --seed, for `sae eval`", 0,
                                   minimum=0)
    mesh: str | None = like(RuntimeConfig, "mesh", help="data=..,fsdp=..,model=.. : latents over model, the batch "
                                                         "over data x fsdp (default: every device on data)")
    param_dtype: str = param_dtype_setting()
    compute_dtype: str | None = compute_dtype_setting()
    seed: int = setting("seed of the init and of the reader's order", 0, minimum=0)
    profile: bool = setting("at each log line, the ms per step spent waiting for the reader's batch and in the "
                            "step: which of the two binds (the step is waited for, so they no longer overlap; the "
                            "first line includes compilation)", False)
    eval_every: int = setting("every this many steps: fvu, l0 and dead fraction on up to 8 batches of the "
                              "held-out streams (--holdout-streams), logged as eval_*; 0 = off", 0, minimum=0)

    # Settings a resumed run must keep: they decide which data and which SAEs the checkpoint holds.
    RUN_FIELDS = ("run", "tensors", "architecture", "latents", "expansion", "k", "batch_tokens", "normalize",
                  "skip_first", "max_norm", "holdout_streams", "mesh", "param_dtype", "seed")

    def __post_init__(self):
        """`run` and `tensors` as lists, also where Python code gives a comma-separated string."""
        object.__setattr__(self, "run", str_list(self.run))
        object.__setattr__(self, "tensors", str_list(self.tensors))

    @property
    def runs(self) -> tuple[str, ...]:
        return tuple(self.run)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The run's tensors; a TransformerLens hook name (blocks.12.hook_resid_post) as harvest names it."""
        return tuple(t if (hook := from_tl_hook(t, f"--tensors {t!r}: ")) is None else tensor_name(*hook)
                     for t in self.tensors)

    def num_latents(self, width: int) -> int:
        return self.latents or self.expansion * width

    def learning_rate(self, latents: int) -> float:
        return self.lr if self.lr is not None else 2e-4 / math.sqrt(latents / 2**14)

    @property
    def norm_ratio(self) -> float:
        """--max-norm's R in force: as given, else the default (0, off, with --follow)."""
        if self.max_norm is not None:
            return float(self.max_norm)
        return 0.0 if self.follow else DEFAULT_MAX_NORM

    @property
    def steps(self) -> int:
        return self.tokens // self.batch_tokens

    def validate(self) -> SaeConfig:
        check_settings(self)
        if not self.runs:
            raise ConfigError("--run: give at least one harvest run URL")
        if not self.tensor_names:
            raise ConfigError("--tensors: give at least one tensor of the run, e.g. resid_post.12")
        if self.follow and self.follow_poll <= 0:
            raise ConfigError(f"--follow-poll {self.follow_poll}: give the seconds between listings, more than 0")
        if self.follow and self.normalize == "run-stats":
            raise ConfigError("--normalize run-stats needs the whole run's statistics, which --follow does not have "
                              "until the run is complete; use --normalize none, or train once the run is complete")
        if self.follow and self.max_norm:  # the default is off with --follow
            raise ConfigError("--max-norm needs the run's median token norm, which a run followed may not hold yet; "
                              "use --skip-first, or train once the run is complete")
        if self.follow and self.eval_every:
            raise ConfigError("--eval-every reads held-out rows at the start, which a run followed may not hold yet; "
                              "drop it and measure with `harvest sae eval` once the run is complete")
        if self.eval_every and not self.holdout_streams:
            raise ConfigError("--eval-every needs held-out streams to evaluate on: give --holdout-streams N")
        if self.batch_tokens % len(self.runs):
            raise ConfigError(f"--batch-tokens {self.batch_tokens} does not split into equal parts of the "
                              f"{len(self.runs)} runs")
        return self
