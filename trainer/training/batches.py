"""A step's rows -> this rank's micro-batches, and the loader that prefetches them.

Built in a DataLoader worker (on CUDA) from the packed rows of `spotune prepare`: per
micro-batch input_ids, labels and position_ids (position_ids restart at every packed
document), the document bounds of the micro-batch flattened to one row (`cu_seq_lens`,
`max_length`: what varlen attention kernels need), and the flat index of the positions
whose hidden state predicts a label, with those labels (`label_index`, `label_targets`:
what the head and loss need). Everything is computed here, on the host, so the device
never waits on a data-dependent shape. Per step, the counts the loss normalisation and
the meter need.

Preference rows (prepared with pairs: a `num_pairs` column) hold their pairs as documents in the order
chosen, rejected, chosen, rejected..., then at most the trailing padding (trainer/data/pairs.py); a
micro-batch then also carries `num_pairs` and the labelled tokens of each of its sequences in that order
(the loss sums each sequence's log-probabilities over them): `seq_lengths` as host ints (the split sizes)
and `seq_tokens`, the same as an int64 tensor that moves to the device with the rest (pinned, asynchronous),
so the loss never copies host values to the device itself (a stream sync: trainer/training/loop.py has one
host sync per step).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch

from trainer.data.packed import PackedRows
from trainer.data.template import IGNORE_INDEX
from trainer.model.objective import Counts
from trainer.restart.signals.preemption import SIGNALS
from trainer.training.shutdown import close_loader

COLUMNS = ("input_ids", "labels", "position_ids")
"""The columns of a packed row that a forward pass needs."""
PAIRS = "num_pairs"
"""The column of preference rows: how many pairs (two documents each, chosen first) the row starts with."""
DESIRABLE = "desirable"
"""The column of KTO rows (trainer/data/unpaired.py): per row, its units' labels (1 desirable, 0 not), in order."""


class StepBatch(NamedTuple):
    """Everything one rank needs for one optimizer step (built in a DataLoader worker).

    A NamedTuple so the DataLoader's pin-memory thread pins every tensor inside it.
    """

    step: int
    micro: list[dict[str, Any]]
    """Per micro-batch, see `micro_batch`."""
    counts: torch.Tensor
    """This rank's `Counts` (trainer/model/objective.py) as its int64 tensor."""


class StepDataset(torch.utils.data.Dataset):
    """Map-style "optimizer step -> this rank's micro-batches", so order is a pure function of
    (seed, step): a resumed run starts its DataLoader at the step, reading nothing before it."""

    def __init__(
        self,
        rows: PackedRows,
        sampler: Any,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        total_steps: int,
    ) -> None:
        self.pairs = PAIRS in rows.column_names
        self.kto = DESIRABLE in rows.column_names
        extra = [*([PAIRS] if self.pairs else []), *([DESIRABLE] if self.kto else [])]
        self.rows = rows.select([*COLUMNS, "num_real", *extra])
        self.sampler = sampler
        self.rank, self.world_size = rank, world_size
        self.micro_batch_size = micro_batch_size
        self.total_steps = total_steps

    def __len__(self) -> int:
        return self.total_steps

    def __getitem__(self, step: int) -> StepBatch:
        micro, counts = [], []
        for indices in self.sampler.micro_batches(step, self.rank, self.world_size, self.micro_batch_size):
            if not indices:
                # This rank's share of an uneven global batch ran out: every rank still runs the
                # same micro-steps (DDP's gradient sync is collective), so it runs a filler row
                # that carries no label and counts no token (and no pair).
                filler = self.rows.take(self.sampler.rows_for_step(step)[:1])
                ids, labels, positions = (torch.from_numpy(stack_column(filler[k])) for k in COLUMNS)
                no_pairs = [0] if self.pairs else None
                filled = micro_batch(ids, torch.full_like(labels, IGNORE_INDEX), positions, no_pairs)
                micro.append(with_labels(filled, [] if self.kto else None))
                continue
            cols = self.rows.take(indices)
            row_pairs = [int(n) for n in cols[PAIRS]] if self.pairs else None
            ids, labels, positions = (torch.from_numpy(stack_column(cols[k])) for k in COLUMNS)
            batch = with_labels(micro_batch(ids, labels, positions, row_pairs), units_of(cols) if self.kto else None)
            counts.append(counts_of(batch, cols["num_real"]))
            micro.append(batch)
        return StepBatch(step, micro, Counts.total(counts).tensor())


def units_of(cols: Any) -> list[int]:
    """KTO rows' unit labels, row after row (the order of their sequences)."""
    return [int(x) for row in cols[DESIRABLE] for x in np.asarray(row).tolist()]


def with_labels(micro: dict[str, Any], desirable: list[int] | None) -> dict[str, Any]:
    """`micro` with KTO's per-unit labels (`desirable`, a bool tensor in unit order) when there are any to carry."""
    if desirable is not None:
        assert len(desirable) == micro["num_pairs"], "a KTO row lists one label per unit"
        micro["desirable"] = torch.tensor(desirable, dtype=torch.bool)
    return micro


def counts_of(batch: dict[str, Any], num_real: Any) -> Counts:
    """The `Counts` of one micro-batch (see `micro_batch`) whose rows hold `num_real` real tokens each."""
    real = doc_sq = 0
    for positions, n_real in zip(batch["position_ids"].numpy(), num_real, strict=True):
        lengths = document_lengths(positions[: int(n_real)])
        real += int(n_real)
        doc_sq += int((lengths.astype(np.int64) ** 2).sum())
    pairs, chosen = (batch["num_pairs"], sum(batch["seq_lengths"][0::2])) if PAIRS in batch else (0, 0)
    return Counts(count_trainable(batch["labels"]), real, doc_sq, pairs, chosen)


def document_lengths(positions: np.ndarray) -> np.ndarray:
    """Lengths of the packed documents in a row: a document starts where position_ids is 0."""
    starts = np.flatnonzero(positions == 0)
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return np.diff(np.append(starts, len(positions)))


def stack_column(column: Any) -> np.ndarray:
    """A [rows, seq_len] int64 array from a numpy-formatted column (2-D, or 1-D of row arrays)."""
    arr = np.asarray(column)
    if arr.dtype == object:
        arr = np.stack([np.asarray(r) for r in column])
    return arr.astype(np.int64, copy=False)


def identity_collate(item: StepBatch) -> StepBatch:
    return item


def micro_batch(
    input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor, row_pairs: list[int] | None = None
) -> dict[str, Any]:
    """One micro-batch of B packed rows of S tokens, with its document bounds and label index.

    - input_ids, labels, position_ids: int64 [B, S] as packed (labels aligned with input_ids).
    - cu_seq_lens: int32 [D+1], start offsets of the D documents of the micro-batch flattened
      to one row of B*S tokens (a document starts where position_ids is 0; each row starts one,
      and a row's trailing padding is one pseudo-document), and max_length (a host int) the
      longest one. The loss runs the model on that one row, so every attention kernel sees the
      same bounds: varlen kernels from these, mask-based ones from position_ids.
    - label_index: int64 [T], flat positions b*S+p whose hidden state predicts a label
      (logit p predicts label p+1), and label_targets: int64 [T], those labels.
    - with `row_pairs` (preference rows: pairs per row), num_pairs and seq_tokens (see the module docstring).
    """
    flat_pos = position_ids.reshape(-1)
    starts = (flat_pos == 0).nonzero().squeeze(1)
    if len(starts) == 0 or int(starts[0]) != 0:  # defensive: a row always starts a document
        starts = torch.cat([torch.zeros(1, dtype=starts.dtype), starts])
    cu = torch.cat([starts, torch.tensor([flat_pos.numel()])]).to(torch.int32)
    seq_len = labels.size(1)
    shifted = labels[:, 1:]
    rows, cols = (shifted != IGNORE_INDEX).nonzero(as_tuple=True)
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seq_lens": cu,
        "max_length": int((cu[1:] - cu[:-1]).max()),
        "label_index": rows * seq_len + cols,
        "label_targets": shifted[rows, cols],
    }
    if row_pairs is not None:
        out["num_pairs"] = sum(row_pairs)
        out["seq_lengths"] = sequence_tokens(labels, cu, row_pairs)
        out["seq_tokens"] = torch.tensor(out["seq_lengths"], dtype=torch.int64)
    return out


def sequence_tokens(labels: torch.Tensor, cu: torch.Tensor, row_pairs: list[int]) -> list[int]:
    """Labelled tokens of each sequence of preference rows, chosen then rejected per pair, in the order
    of `label_index`. Asserts what the loss relies on: a row's first 2 x pairs documents each carry a
    label, and nothing after them does (padding is never scored, nor counted as a sequence)."""
    flat = torch.cat([torch.zeros(1, dtype=torch.int64), (labels.reshape(-1) != IGNORE_INDEX).to(torch.int64)])
    cumulative = flat.cumsum(0)
    per_doc = (cumulative[cu[1:].long()] - cumulative[cu[:-1].long()]).tolist()
    starts, seq_len = cu.tolist(), labels.size(1)
    out: list[int] = []
    doc = 0
    for row, pairs in enumerate(row_pairs):
        first = doc
        while doc < len(per_doc) and starts[doc] < (row + 1) * seq_len:
            doc += 1
        docs = per_doc[first:doc]
        scored, rest = docs[: 2 * pairs], docs[2 * pairs :]
        if len(scored) != 2 * pairs or not all(scored) or any(rest):
            raise ValueError(
                f"row {row} of a micro-batch claims {pairs} preference pair(s) but its documents carry {docs} "
                "labelled tokens: the prepared data is not preference rows of this version; prepare it again "
                "(delete its entry under data.cache_dir)"
            )
        out += scored
    return out


def identical_pairs(rows: PackedRows) -> list[int]:
    """Packed rows (of `rows`, a preference dataset) holding a pair whose chosen and rejected sequences are
    the same tokens. Such a pair teaches nothing (its DPO gradient is 0) yet counts as a pair of the step,
    shrinking every other pair's share, and as a wrong ranking in reward accuracy: data preparation drops
    it (`identical_answers`), and a run refuses prepared data that still holds one rather than train on it."""
    if PAIRS not in rows.column_names or DESIRABLE in rows.column_names:  # KTO: a unit's KL sequence may repeat it
        return []
    found = []
    names = ["input_ids", "position_ids", PAIRS]
    cols = rows.select(names)
    for first in range(0, len(cols), 1024):  # read in chunks: one Arrow read per 1,024 rows
        chunk = cols.take(slice(first, first + 1024))
        for i, (ids, positions, pairs) in enumerate(zip(*(stack_column(chunk[c]) for c in names), strict=True)):
            starts = np.flatnonzero(positions == 0).tolist() + [len(ids)]
            if any(
                np.array_equal(ids[starts[2 * k] : starts[2 * k + 1]], ids[starts[2 * k + 1] : starts[2 * k + 2]])
                for k in range(int(pairs))
            ):
                found.append(first + i)
    return found


def to_device(micro: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors to `device` (asynchronously from pinned memory); host ints (max_length) stay host ints."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in micro.items()}


def count_trainable(labels: torch.Tensor) -> int:
    """Tokens that carry a loss after the shift: labels[:, 1:] != -100."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def step_loader(
    dataset: StepDataset, start: int, device: torch.device, seed: int, workers: int | None = None
) -> torch.utils.data.DataLoader:
    """Prefetch whole optimizer steps from `start` on; by default one worker on CUDA hides
    reading and collating behind the GPU's work (on CPU a worker would only compete for cores).

    The DataLoader gets its own generator so creating it never draws from the global torch RNG
    (which a resumed run has just restored and must leave untouched).
    """
    if workers is None:
        workers = 1 if device.type == "cuda" else 0
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=None,
        sampler=range(start, dataset.total_steps),
        collate_fn=identity_collate,  # type: ignore[arg-type]  # batch_size=None: called per item, not per list
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=_ignore_stop_signals if workers else None,
    )


@contextlib.contextmanager
def prefetching(loader: torch.utils.data.DataLoader) -> Iterator[Iterator[StepBatch]]:
    """The loader's iterator, whose workers end when the block does, on every path (an
    exception's traceback would otherwise keep them alive until exit: trainer/training/shutdown.py)."""
    iterator = iter(loader)
    try:
        yield iterator
    finally:
        close_loader(iterator)


def _ignore_stop_signals(worker_id: int) -> None:
    """A data worker ignores preemption signals (Slurm signals every process of the job):
    the main process finishes the step, saves, and shuts the worker down itself."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def eval_micro_batches(rows: PackedRows, rank: int, world: int, micro_batch_size: int) -> Iterator[dict[str, Any]]:
    """This rank's share of the held-out rows (every world-th row), as micro-batches.

    Every rank yields the same number of micro-batches: a rank past its share gets a filler
    row whose labels are all ignored, so no rank waits alone in a collective.
    """
    pairs, kto = PAIRS in rows.column_names, DESIRABLE in rows.column_names
    rows = rows.select([*COLUMNS, *([PAIRS] if pairs else []), *([DESIRABLE] if kto else [])])
    per_rank = -(-len(rows) // world)
    for start in range(0, per_rank, micro_batch_size):
        idx = [rank + world * i for i in range(start, min(start + micro_batch_size, per_rank))]
        cols = rows.take([min(i, len(rows) - 1) for i in idx])
        ids, labels, positions = (torch.from_numpy(stack_column(cols[k])) for k in COLUMNS)
        beyond = torch.tensor([i >= len(rows) for i in idx])
        labels[beyond] = IGNORE_INDEX  # a filler row: forward for lockstep, no loss
        row_pairs = (
            [0 if out else int(n) for out, n in zip(beyond.tolist(), cols[PAIRS], strict=True)] if pairs else None
        )
        units = None
        if kto:
            units = [int(x) for out, row in zip(beyond.tolist(), cols[DESIRABLE], strict=True) if not out for x in row]
        yield with_labels(micro_batch(ids, labels, positions, row_pairs), units)


def eval_counts(rows: PackedRows) -> torch.Tensor:
    """The `Counts` tensor of the whole held-out set (every rank reads all of it: the same totals
    everywhere), for normalising the evaluation's loss as a step's is normalised."""
    pairs = PAIRS in rows.column_names
    cols = rows.select([*COLUMNS, "num_real", *([PAIRS] if pairs else [])])
    counts = []
    for start in range(0, len(rows), 256):
        chunk = cols.take(slice(start, start + 256))
        ids, labels, positions = (torch.from_numpy(stack_column(chunk[k])) for k in COLUMNS)
        row_pairs = [int(n) for n in chunk[PAIRS]] if pairs else None
        counts.append(counts_of(micro_batch(ids, labels, positions, row_pairs), chunk["num_real"]))
    return Counts.total(counts).tensor()
