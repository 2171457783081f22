"""The TRM's hyperparameters (the model's; its command's settings are config.py's): the shape and recursion
(TrmConfig), the optimizers (TrmOptim), and the presets that reproduce the paper's runs ("Less is More:
Recursive Reasoning with Tiny Networks", Jolicoeur-Martineau 2025, arXiv 2510.04871) with the reference code's
hyperparameters (SamsungSAILMontreal/TinyRecursiveModels). The dataset fixes vocab_size, seq_len and
num_puzzle_identifiers: `for_dataset` fills them from a built puzzle dataset's marker."""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest.config import ConfigError, check_settings, setting
from harvest.errors import UserError


@dataclasses.dataclass(frozen=True)
class TrmConfig:
    vocab_size: int = setting("token ids (from the dataset)", 0, minimum=1)
    seq_len: int = setting("tokens per example, the flattened grid (from the dataset)", 0, minimum=1)
    num_puzzle_identifiers: int = setting("rows of the puzzle-embedding table (from the dataset)", 1, minimum=1)
    ignore_label_id: int | None = setting("labels with this id carry no loss (the dataset's; None: all count)", 0)
    hidden: int = setting("width of the one shared network", 512, minimum=1)
    heads: int = setting("attention heads (hidden / heads per head)", 8, minimum=1)
    expansion: float = setting("SwiGLU width as a multiple of its input (2/3 of it, rounded up to 256)", 4.0)
    L_layers: int = setting("post-norm blocks in the network", 2, minimum=1)
    H_cycles: int = setting("T: answer updates per supervision step; all but the last run without gradients",
                            3, minimum=1)
    L_cycles: int = setting("n: latent updates before each answer update", 6, minimum=1)
    halt_max_steps: int = setting("N_sup: supervision steps a sample gets at most", 16, minimum=1)
    halt_exploration_prob: float = setting("chance that a sample must run a random 2..N_sup steps before halting",
                                           0.1)
    mlp_t: bool = setting("mix tokens with an MLP over positions instead of attention (the Sudoku variant)", False)
    puzzle_emb_ndim: int = setting("width of a puzzle's learned embedding, 0 = none", 512, minimum=0)
    puzzle_emb_len: int = setting("prefix tokens the puzzle embedding fills (0: ceil(ndim / hidden))", 16,
                                  minimum=0)
    pos_encodings: str = setting("position encoding", "rope", choices=("rope", "learned", "none"))
    rope_theta: float = setting("RoPE base", 10000.0)
    rms_norm_eps: float = setting("RMSNorm epsilon", 1e-5)
    compute_dtype: str = setting("dtype of the forward pass (params stay float32; CPU: float32)", "float32",
                                 choices=("float32", "bfloat16"))

    @property
    def prefix_len(self) -> int:
        """Puzzle-embedding positions in front of the grid (none without a puzzle embedding)."""
        if self.puzzle_emb_ndim == 0:
            return 0
        return self.puzzle_emb_len or -(-self.puzzle_emb_ndim // self.hidden)

    @property
    def total_len(self) -> int:
        return self.seq_len + self.prefix_len

    def validate(self) -> TrmConfig:
        check_settings(self)
        if not self.mlp_t and self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.puzzle_emb_ndim > self.prefix_len * self.hidden:
            raise ConfigError(f"puzzle_emb_ndim {self.puzzle_emb_ndim} does not fit in puzzle_emb_len "
                              f"{self.puzzle_emb_len} x hidden {self.hidden}")
        if not 0 <= self.halt_exploration_prob <= 1:
            raise ConfigError(f"halt_exploration_prob {self.halt_exploration_prob}: must be in [0, 1]")
        return self

    def for_dataset(self, info: Any) -> TrmConfig:
        """This config sized for a built puzzle dataset (its DatasetInfo)."""
        return dataclasses.replace(self, vocab_size=info.vocab_size, seq_len=info.seq_len,
                                   num_puzzle_identifiers=info.num_puzzle_identifiers,
                                   ignore_label_id=info.ignore_label_id).validate()


@dataclasses.dataclass(frozen=True)
class TrmOptim:
    """The reference's two optimizers, their schedule (linear warmup, then constant: its cosine schedule with
    lr_min_ratio 1) and its training length in epochs (one puzzle per group per epoch)."""

    batch_size: int = setting("global batch: examples per step", 768, minimum=1)
    epochs: int = setting("passes over the groups (one puzzle of each per epoch)", 100_000, minimum=1)
    lr: float = setting("AdamATan2 peak learning rate", 1e-4, minimum=0)
    warmup: int = setting("linear warmup steps (both optimizers)", 2000, minimum=0)
    weight_decay: float = setting("AdamATan2 decoupled weight decay (all weights)", 0.1, minimum=0)
    b1: float = setting("AdamATan2 beta1", 0.9, minimum=0)
    b2: float = setting("AdamATan2 beta2", 0.95, minimum=0)
    puzzle_emb_lr: float = setting("sign-SGD learning rate of the puzzle embeddings", 1e-2, minimum=0)
    puzzle_emb_weight_decay: float = setting("decoupled weight decay of the puzzle embeddings in a batch", 0.1,
                                             minimum=0)
    ema_rate: float | None = setting("EMA of the weights used for evaluation (None: off)", 0.999)

    def validate(self) -> TrmOptim:
        check_settings(self)
        return self

    def total_steps(self, info: Any, split: str = "train") -> int:
        """The reference's length: epochs x groups x mean examples per puzzle / batch."""
        groups = info.splits[split]["groups"]
        return int(self.epochs * groups * info.mean_puzzle_examples(split) / self.batch_size)


@dataclasses.dataclass(frozen=True)
class Preset:
    model: TrmConfig
    optim: TrmOptim
    published: dict  # benchmark -> exact accuracy the paper reports for this setup (Table 1 / Table 5)
    data: str        # the reference's dataset build for it


# Sudoku-Extreme, 1k puzzles x 1000 augmentations: the README's `pretrain_mlp_t_sudoku` (1 L40S, < 36 h).
# 5M params; the paper's Table 1: 87.4% exact on Sudoku-Extreme (the attention variant: 74.7%).
_SUDOKU = Preset(
    TrmConfig(mlp_t=True, pos_encodings="none", H_cycles=3, L_cycles=6),
    TrmOptim(lr=1e-4, puzzle_emb_lr=1e-4, weight_decay=1.0, puzzle_emb_weight_decay=1.0, epochs=50_000),
    {"sudoku-extreme": 0.874},
    "sudoku: 1000 training puzzles (--subsample 1000) x 1000 augmentations (--augment 1000)")

# Maze-Hard 30x30, 1k mazes: the README's `pretrain_att_maze30x30` (4 L40S, < 24 h). 7M params; 85.3% exact.
_MAZE = Preset(
    TrmConfig(H_cycles=3, L_cycles=4),
    TrmOptim(lr=1e-4, puzzle_emb_lr=1e-4, weight_decay=1.0, puzzle_emb_weight_decay=1.0, epochs=50_000),
    {"maze-hard": 0.853},
    "maze: 1000 training mazes of 30x30 (--subsample 1000) x 8 dihedral augmentations (--augment 7)")

# ARC-AGI with concept tasks, 1000 augmentations per task: the README's `pretrain_att_arc1concept_4` (4 H100,
# ~3 days) with cfg_pretrain.yaml's optimizer. 7M params; pass@2 44.6% on ARC-AGI-1, 7.8% on ARC-AGI-2.
_ARC = Preset(
    TrmConfig(H_cycles=3, L_cycles=4),
    TrmOptim(lr=1e-4, puzzle_emb_lr=1e-2, weight_decay=0.1, puzzle_emb_weight_decay=0.1, epochs=100_000),
    {"arc-agi-1": 0.446, "arc-agi-2": 0.078},
    "arc: ARC-AGI-1 or -2 training + evaluation train pairs, 1000 augmentations per task (--augment 1000)")

PRESETS = {"trm-sudoku-mlp": _SUDOKU, "trm-maze": _MAZE, "trm-arc": _ARC}


def preset(name: str, **overrides: Any) -> Preset:
    """A preset by name, its model fields overridden (e.g. H_cycles=2); an unknown name is a one-line error."""
    if name not in PRESETS:
        raise UserError(f"unknown TRM preset {name!r}; choose one of {', '.join(PRESETS)}")
    chosen = PRESETS[name]
    return dataclasses.replace(chosen, model=dataclasses.replace(chosen.model, **overrides))
