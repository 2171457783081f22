"""sparsify's own trainer (sparsify.Trainer, eai-sparsify 1.3.3) on stored activations, for the tests and
bench/sae.py: its trainer hooks a model's module, so the "model" here is a table of the rows, and each
dataset item names the rows of one sequence. The trainer runs as sparsify runs it (its init, b_dec from the
first batch, decoder renormalization, the parallel gradient removed, its Adam and linear schedule)."""

from __future__ import annotations

import os
import tempfile

import numpy as np


def _rows_model(rows: np.ndarray, clock: list[float] | None = None):
    """`clock`, when given, gets the time of every forward (one a training step)."""
    import time

    import torch
    from torch import nn

    class Point(nn.Module):
        def __init__(self, table: torch.Tensor):
            super().__init__()
            self.register_buffer("table", table, persistent=False)

        def forward(self, ids):
            if clock is not None:
                clock.append(time.perf_counter())
            return self.table[ids]

    class Base(nn.Module):
        def __init__(self, table: torch.Tensor):
            super().__init__()
            self.point = Point(table)

        def forward(self, input_ids):
            return self.point(input_ids)

    class RowsModel(nn.Module):
        """What sparsify's Trainer asks of a model: base_model, config, device, dummy_inputs, a forward."""

        def __init__(self, table: torch.Tensor):
            super().__init__()
            self.base_model = Base(table)
            self.config = type("Config", (), {"num_hidden_layers": 1})()
            self.dummy_inputs = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}

        @property
        def device(self):
            return torch.device("cpu")

        def forward(self, input_ids):
            return self.base_model(input_ids)

    return RowsModel(torch.from_numpy(np.ascontiguousarray(rows, np.float32)))


def train_sparsify(rows: np.ndarray, *, latents: int, k: int, batch: int, lr: float, warmup: int, seed: int = 0,
                   sequence: int = 16, clock: list[float] | None = None):
    """A TopK SparseCoder trained by sparsify's Trainer on `rows` in order, `batch` rows a step, Adam, AuxK off;
    `clock` gets each step's start time and, last, the end of training."""
    import time

    import torch
    from sparsify import SaeConfig, Trainer, TrainConfig

    torch.manual_seed(seed)
    steps = len(rows) // batch
    ids = torch.arange(steps * batch).reshape(-1, sequence)
    dataset = [{"input_ids": r} for r in ids]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            return dataset[i]

    cfg = TrainConfig(SaeConfig(num_latents=latents, k=k), batch_size=batch // sequence, optimizer="adam", lr=lr,
                      lr_warmup_steps=warmup, auxk_alpha=0.0, hookpoints=["point"], log_to_wandb=False,
                      save_every=10**9, save_dir=tempfile.mkdtemp(prefix="sparsify-"), init_seeds=[seed])
    trainer = Trainer(cfg, Rows(), _rows_model(rows, clock))
    os.environ.setdefault("WANDB_MODE", "disabled")
    trainer.fit()
    if clock is not None:
        clock.append(time.perf_counter())
    return trainer.saes["point"]


def sparsify_fvu_and_dead(coder, rows: np.ndarray) -> tuple[float, int]:
    """FVU of the coder on all of `rows` and how many latents never fire on them."""
    import torch

    with torch.no_grad():
        x = torch.from_numpy(np.ascontiguousarray(rows, np.float32))
        top = coder.encode(x)
        recon = coder.decode(top.top_acts, top.top_indices)
        fired = torch.zeros(coder.num_latents, dtype=torch.bool)
        fired[top.top_indices[top.top_acts > 0]] = True
    return float(((x - recon) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()), int((~fired).sum())


def train_saelens_relu(batches: list[np.ndarray], *, latents: int, l1: float, lr: float, seed: int = 0):
    """SAELens's standard (ReLU, L1 weighted by decoder norms) SAE trained by its SAETrainer on `batches` in
    order: its init (decoder rows at norm 0.1, encoder their transpose, zero biases), Adam at a constant lr,
    its gradient clipping at norm 1."""
    import torch
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    torch.manual_seed(seed)
    size = len(batches[0])
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=batches[0].shape[1], d_sae=latents, l1_coefficient=l1,
                                                        normalize_activations="none"))
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=size * len(batches), train_batch_size_samples=size,
                                          lr=lr, lr_end=lr),
                         sae, (torch.from_numpy(np.ascontiguousarray(b, np.float32)) for b in batches))
    return trainer.fit()
