"""A torch IterableDataset over a run's token batches, for DataLoader(num_workers=k).

The dataset is made in the rank's own process and holds a snapshot of the run (plain data: run.json and
the committed shards' sidecars, slimmed to what reading needs), taken there once; DataLoader hands it to
every worker, so the k workers split the same shards, whatever is committed while they start, and
together serve the rank's share once. A worker lists nothing: it reads the shards its snapshot names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from harvest.errors import UserError
from harvest.read.batches import TokenBatches
from harvest.read.errors import StateError
from harvest.storage import Storage
from harvest.store.snapshot import Snapshot, pinned


class TokenDataset(torch.utils.data.IterableDataset):
    """Batches of torch tensors; use with DataLoader(ds, batch_size=None). Built by `Run.torch_dataset`."""

    def __init__(self, url: str, view: Snapshot, batch_size: int, names: list[str], settings: dict[str, Any]):
        super().__init__()
        settings = dict(settings)
        given = settings.pop("snapshot", None)
        counts, generations = (None, {}) if given is None else pinned(given)
        if counts is None and int(settings.get("world", 1)) > 1 and not view.complete(settings.get("streams")):
            raise UserError(f"{url}: the run is still being written, and each rank's dataset would list it at "
                            "another moment: give every rank's dataset the same snapshot= (run.snapshot(), taken once)")
        if counts is not None and (any(len(view.of_stream(s)) < n for s, n in counts.items())
                                   or not view.holds(generations)):
            view = Snapshot.take(Storage(url))  # the snapshot given was taken after this Run was opened
        view.check_generations(generations)
        try:
            view = view if counts is None else view.limited(counts)
        except ValueError as e:
            raise StateError(f"{url}: the snapshot given is not this run's ({e})") from None
        if settings.get("normalize"):
            settings["stats"] = {n: view.stats(n) for n in names}
        self.url, self.batch_size, self.names, self.settings = url, batch_size, names, settings
        self.view = view.slim(names)

    @property
    def snapshot(self) -> dict[int, list]:
        """{stream: [shards, generation]} this dataset reads: give it to the other ranks' datasets (snapshot=...)."""
        return self.view.shared()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(TokenBatches(Storage(self.url), self.view, self.batch_size, self.names, as_torch=True,
                                 snapshot=self.view.shared(), **self.settings))
