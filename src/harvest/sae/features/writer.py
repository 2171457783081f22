"""What build.py hands the outputs (the site, the Neuronpedia layout): each tensor's latents in blocks of BLOCK,
in order from latent 0, then `close()`. BlockOrder holds a writer to that order, so no output is cut short or
shuffled without a one-line error."""

from __future__ import annotations

from typing import Protocol

from harvest.sae.features.record import FeaturesRecord, Latent

BLOCK = 64  # latents per block handed to the writers (and per data file of the site)


class Writer(Protocol):
    def add(self, tensor: str, block: list[Latent]) -> None: ...

    def close(self) -> None: ...


class BlockOrder:
    """How many latents of each tensor a writer has been given, checked block by block."""

    def __init__(self, record: FeaturesRecord):
        self.latents = {summary.tensor: summary.latents for summary in record.tensors}
        self.added = dict.fromkeys(self.latents, 0)

    def take(self, tensor: str, block: list[Latent]) -> int:
        """The block's number, once it is the next whole block (or the last) of a tensor of the record."""
        if tensor not in self.added:
            raise ValueError(f"tensor {tensor!r} is not in the record (it has {', '.join(self.added)})")
        first = self.added[tensor]
        if first % BLOCK or not block or [latent.index for latent in block] != list(range(first, first + len(block))):
            raise ValueError(f"{tensor}: expected a block of latents {first}.., whole blocks of {BLOCK} but the last; "
                             f"got {[latent.index for latent in block][:3]}..")
        self.added[tensor] += len(block)
        return first // BLOCK

    def check_complete(self) -> None:
        for tensor, latents in self.latents.items():
            if self.added[tensor] != latents:
                raise ValueError(f"{tensor}: {self.added[tensor]} of its {latents} latents were added")
