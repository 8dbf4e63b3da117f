"""Deterministic step sampler: which packed rows each optimizer step trains on.

The order of an epoch is a pure function of `(seed, epoch)`:
`np.random.default_rng([seed, epoch]).permutation(num_rows)`, or the identity when
shuffling is off. The sampler's whole state is `(epoch, cursor)`, where `cursor` counts
rows already consumed in that epoch, and both follow from the optimizer step alone. So a
resumed run jumps straight to its step: no rows are read or skipped to get there (O(1)
in data; one permutation of row indices, which never touches the dataset).

A step never straddles two epochs: each epoch yields `num_rows // rows_per_step` whole
steps and the last `num_rows % rows_per_step` rows of that epoch's order are dropped.
Because every epoch has its own order, a different tail is dropped each epoch.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from trainer.config import ConfigError


def steps_per_epoch(num_rows: int, rows_per_step: int) -> int:
    """Whole optimizer steps in one pass over `num_rows` packed rows (the tail is dropped)."""
    if rows_per_step < 1:
        raise ValueError(f"rows per step must be at least 1, got {rows_per_step}")
    if num_rows < rows_per_step:
        raise ConfigError(
            [
                f"the prepared dataset has {num_rows} packed rows but one optimizer step needs "
                f"{rows_per_step} (train.global_batch_size, or train.micro_batch_size x train.grad_accum x devices); "
                "lower train.global_batch_size (or train.micro_batch_size or train.grad_accum), lower data.seq_len, "
                f"or add data; for a small file on one device: train.micro_batch_size=1 train.grad_accum=1 (one row "
                f"a step, {num_rows} steps an epoch)"
            ]
        )
    return num_rows // rows_per_step


def run_steps(num_rows: int, rows_per_step: int, max_steps: int | None, epochs: float) -> int:
    """Optimizer steps of a whole run: `train.max_steps`, else `train.epochs` passes (a fractional
    epoch rounds up to a whole step)."""
    per_epoch = steps_per_epoch(num_rows, rows_per_step)
    return max_steps if max_steps is not None else max(1, math.ceil(epochs * per_epoch))


class StepSampler:
    """Rows of every optimizer step, for every rank, as a function of the step number."""

    def __init__(self, num_rows: int, rows_per_step: int, seed: int, shuffle: bool = True) -> None:
        self.steps_per_epoch = steps_per_epoch(num_rows, rows_per_step)
        self.num_rows = num_rows
        self.rows_per_step = rows_per_step
        self.seed = seed
        self.shuffle = shuffle
        # Only the current epoch's order is kept: a run walks epochs in sequence.
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """Row indices of `epoch` in training order (read-only)."""
        if epoch < 0:
            raise ValueError(f"epoch must be 0 or more, got {epoch}")
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        else:
            order = np.arange(self.num_rows)
        order.setflags(write=False)
        self._cached = (epoch, order)
        return order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, cursor) at the start of optimizer step `step` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be 0 or more, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        return epoch, within * self.rows_per_step

    def step_at(self, epoch: int, cursor: int) -> int:
        """Inverse of `position`; raises if `cursor` is not on a step boundary."""
        if cursor % self.rows_per_step or not 0 <= cursor < self.steps_per_epoch * self.rows_per_step:
            raise ValueError(
                f"sampler cursor {cursor} is not the start of a step of {self.rows_per_step} rows "
                f"within an epoch of {self.steps_per_epoch} steps (did the global batch or the dataset change?)"
            )
        return epoch * self.steps_per_epoch + cursor // self.rows_per_step

    def steps_for_epochs(self, epochs: float) -> int:
        """Optimizer steps in `epochs` passes (`run_steps` without a `max_steps`)."""
        return run_steps(self.num_rows, self.rows_per_step, None, epochs)

    def rows_for_step(self, step: int) -> list[int]:
        """Global row indices of optimizer step `step`, across all ranks and micro-steps."""
        epoch, cursor = self.position(step)
        return self.order(epoch)[cursor : cursor + self.rows_per_step].tolist()

    def micro_batches(self, step: int, rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
        """This rank's rows for `step`: ceil(G / (W*B)) lists of at most `micro_batch_size` row indices.

        Micro-step m covers global rows [m*W*B, (m+1)*W*B) of the step and rank r takes the r-th
        slice of B of them, so every rank sees a fresh slice every micro-step. When the global
        batch G does not divide by W*B, the last micro-step's slices are short or empty: ranks
        take uneven shares, and every rank still runs the same number of micro-steps (an empty
        slice becomes a filler micro-batch that carries no loss; see trainer/training/batches.py). The
        step's rows are the same whatever W and B: only who computes which changes.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        rows = self.rows_for_step(step)
        per_micro = micro_batch_size * world_size
        out = []
        for m in range(-(-len(rows) // per_micro)):
            start = m * per_micro + rank * micro_batch_size
            out.append(rows[start : min(start + micro_batch_size, len(rows))])
        return out

    def digest(self, step: int) -> str:
        """sha256 hex of the step's global row indices in training order (int64 little-endian):
        equal digests mean two runs trained step `step` on the same rows, whatever their world size."""
        return hashlib.sha256(np.asarray(self.rows_for_step(step), dtype="<i8").tobytes()).hexdigest()
