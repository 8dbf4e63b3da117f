"""Fences for tests of the store's rules: a writer of a given lease generation, the lease itself not under test."""

from __future__ import annotations

from trainer.restart.store.lifecycle import Fence


class Generation(Fence):
    """A lease holder of `generation` that may write (the fence is not what is tested here)."""

    def __init__(self, generation: int) -> None:
        self._generation = generation

    @property
    def generation(self) -> int | None:
        return self._generation
