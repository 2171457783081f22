"""A torch IterableDataset over a run's token batches, for DataLoader(num_workers=k).

It holds only the URL and the settings (it pickles for spawned workers); each worker opens the run
itself and reads the share store/shuffle.py deals it, so k workers together serve the rank's share once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch.utils.data


class TokenDataset(torch.utils.data.IterableDataset):
    """Batches of torch tensors; use with DataLoader(ds, batch_size=None)."""

    def __init__(self, url: str, batch_size: int, tensors: Sequence[str] | str | None, settings: dict[str, Any]):
        super().__init__()
        self.url, self.batch_size, self.tensors, self.settings = url, batch_size, tensors, dict(settings)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from harvest.store.reader import open_run

        run = open_run(self.url)
        return iter(run.token_batches(self.batch_size, self.tensors, as_torch=True, **self.settings))
