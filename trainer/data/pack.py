"""Packing tokenised documents into fixed `seq_len` rows, as few as the lower bound allows.

Three packers, cheapest first (`pack_lengths` stops at the first that reaches the lower bound
ceil(total tokens / seq_len)): best-fit-decreasing, exact-fill (closes a row with one
document or a pair), and subset-sum fill (closes each row's last gap with the best subset
of the remaining documents).

Invariants every row satisfies (tested as properties in tests/test_data_pack.py):
- each document appears exactly once, whole and in order, inside one row;
- position_ids restart at 0 at every document, so transformers' packed-sequence mask
  (built from position_ids when no attention_mask is given) keeps documents apart;
- labels are copied from the document, whose first label is -100, so no label is ever
  predicted from the previous document;
- padding only at the end: pad id, label -100, positions 0..k-1 (one trailing pseudo-document).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from trainer.data.template import IGNORE_INDEX


def _check_lengths(lens: np.ndarray, capacity: int) -> None:
    if lens.size and (lens.min() < 1 or lens.max() > capacity):
        raise ValueError(f"document lengths must lie in [1, {capacity}], got [{lens.min()}, {lens.max()}]")


def best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Group document indices into bins of total length <= capacity, best fit, longest first.

    Open bins are kept in buckets keyed by remaining capacity; a sorted list of the
    non-empty bucket keys gives the tightest bin that fits by bisection, so each document
    costs O(log capacity) plus a list insert over at most `capacity` keys: 100k documents
    take well under a second.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lens, capacity)
    # Stable sort on -length: equal lengths keep input order, so the packing is deterministic.
    order = np.argsort(-lens, kind="stable")
    bins: list[list[int]] = []
    buckets: dict[int, list[int]] = {}  # remaining capacity -> open bin ids
    keys: list[int] = []  # sorted remaining capacities that have at least one open bin
    for idx in order.tolist():
        size = int(lens[idx])
        k = bisect.bisect_left(keys, size)
        if k < len(keys):
            room = keys[k]
            bucket = buckets[room]
            b = bucket.pop()
            if not bucket:
                del buckets[room]
                keys.pop(k)
        else:
            room = capacity
            b = len(bins)
            bins.append([])
        bins[b].append(idx)
        left = room - size
        if left > 0:  # a full bin can take nothing more; stop tracking it
            if left not in buckets:
                buckets[left] = []
                bisect.insort(keys, left)
            buckets[left].append(b)
    return bins


class _Pool:
    """Documents not packed yet, by length (shared by the row-at-a-time packers).

    `avail` is the sorted list of lengths with documents left, `counts[length]` how many,
    and `take(length)` removes and returns the lowest index of that length (deterministic).
    """

    def __init__(self, lens: np.ndarray, capacity: int) -> None:
        self.stacks: dict[int, list[int]] = {}
        for i in np.argsort(-lens, kind="stable")[::-1].tolist():  # pop() yields the lowest index first
            self.stacks.setdefault(int(lens[i]), []).append(i)
        self.avail = sorted(self.stacks)
        self.counts = np.zeros(capacity + 1, dtype=np.int64)
        np.add.at(self.counts, lens, 1)

    def take(self, length: int) -> int:
        i = self.stacks[length].pop()
        self.counts[length] -= 1
        if not self.stacks[length]:
            del self.stacks[length]
            self.avail.pop(bisect.bisect_left(self.avail, length))
        return i


def fill_exact_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Fill one row at a time: longest documents that fit, closing the row exactly when possible.

    Before each greedy step the row's gap g is checked against the remaining documents
    for one document of length g or a pair summing to g (a vectorised look-up over a
    count-per-length table). BFD leaves most rows with a gap smaller than the shortest
    document left; exact closing removes most of that slack (3k alpaca examples at 2048:
    338 -> 336 rows). Cost: O(capacity) numpy work per row.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lens, capacity)
    pool = _Pool(lens, capacity)
    counts, avail, take = pool.counts, pool.avail, pool.take
    bins: list[list[int]] = []
    while avail:
        gap, row = capacity, []
        while avail and gap > 0:
            if counts[gap] > 0:
                row.append(take(gap))
                break
            if 2 <= gap <= 2 * avail[-1]:
                half = gap // 2
                # pairs (a, gap - a) for a in 1..half; a == gap - a needs two documents of that length
                both = (counts[1 : half + 1] > 0) & (counts[gap - 1 : gap - half - 1 : -1] > 0)
                if gap % 2 == 0 and counts[half] < 2:
                    both[half - 1] = False
                hits = np.flatnonzero(both)
                if hits.size:
                    a = int(hits[0]) + 1  # the smallest a: uses up the longer partner first
                    row.append(take(gap - a))
                    row.append(take(a))
                    break
            k = bisect.bisect_right(avail, gap)
            if k == 0:
                break
            length = avail[k - 1]
            row.append(take(length))
            gap -= length
        bins.append(row)
    return bins


def fill_subset_sum(lengths: Sequence[int] | np.ndarray, capacity: int, reserve: int | None = None) -> list[list[int]]:
    """Fill one row at a time: longest documents first, then the best subset for the last gap.

    Each row takes the longest documents that fit until its gap is at most `reserve`
    (default twice the longest document); a subset-sum over the remaining documents that fit
    then picks the fullest fill of that gap, exact whenever one exists. Greedy exact-fill
    runs out of small documents near the end and leaves the last rows half empty; this
    keeps them for where they close a gap (GPTeacher at 2048: 336 -> 334 rows, the bound).

    The subset-sum is a bitset in one Python int (bit s set = some subset sums to s),
    lengths taken longest first and stopped as soon as the gap is reachable; walking the
    saved bitsets backwards takes a shorter document only when the sum needs it, so short
    documents are saved for later rows. Cost: O(documents that fit the gap) big-int shifts
    per row, about 0.1 ms per row on 3k documents and 1.5 ms per row on 100k.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    _check_lengths(lens, capacity)
    if reserve is None:
        reserve = 2 * int(lens.max()) if lens.size else 0
    pool = _Pool(lens, capacity)
    stacks, avail, take = pool.stacks, pool.avail, pool.take
    bins: list[list[int]] = []
    while avail:
        gap, row = capacity, []
        while avail and gap > reserve:
            k = bisect.bisect_right(avail, gap)
            if k == 0:  # nothing fits (only when reserve < the longest document)
                break
            length = avail[k - 1]
            row.append(take(length))
            gap -= length
        items: list[int] = []  # one entry per usable document, longest first
        for length in reversed(avail[: bisect.bisect_right(avail, gap)]):
            items.extend([length] * min(len(stacks[length]), gap // length))
        reach, mask, before = 1, (1 << (gap + 1)) - 1, []
        for length in items:
            before.append(reach)  # sums reachable without this item and the ones after it
            reach |= (reach << length) & mask
            if reach >> gap:
                break  # the gap closes exactly
        total = reach.bit_length() - 1  # the fullest reachable fill
        for i in range(len(before) - 1, -1, -1):
            if total == 0:
                break
            if not (before[i] >> total) & 1:  # this sum needs item i
                row.append(take(items[i]))
                total -= items[i]
        bins.append(row)
    return bins


def lower_bound_rows(lengths: Sequence[int] | np.ndarray, capacity: int) -> int:
    """No packing has fewer rows than ceil(total tokens / capacity)."""
    return -(-int(np.asarray(lengths, dtype=np.int64).sum()) // capacity)


def pack_lengths(lengths: Sequence[int] | np.ndarray, capacity: int) -> tuple[list[list[int]], str]:
    """The fewest rows of the three packers, cheapest first, stopping at the lower bound.

    Returns (bins, algorithm name). Ties go to the cheaper packer, so the result depends only
    on the lengths: deterministic.
    """
    bound = lower_bound_rows(lengths, capacity)
    best: tuple[list[list[int]], str] | None = None
    for packer in (best_fit_decreasing, fill_exact_decreasing, fill_subset_sum):
        bins = packer(lengths, capacity)
        if best is None or len(bins) < len(best[0]):
            best = (bins, packer.__name__)
        if len(best[0]) <= bound:
            break
    assert best is not None
    return best


def one_per_row(lengths: Sequence[int] | np.ndarray) -> list[list[int]]:
    """`packing: false`: every document alone in its own (padded) row, in input order."""
    return [[i] for i in range(len(lengths))]


def build_rows(
    flat_ids: np.ndarray,
    flat_labels: np.ndarray,
    offsets: np.ndarray,
    bins: list[list[int]],
    seq_len: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Materialise rows: (rows, seq_len) int32 arrays input_ids/labels/position_ids, plus num_real/num_trainable.

    Document i is flat_ids[offsets[i]:offsets[i+1]] (Arrow list layout). Fully vectorised:
    one gather from the flat token buffer into the flat row buffer.
    """
    n_rows = len(bins)
    doc_order = np.fromiter((d for b in bins for d in b), dtype=np.int64, count=sum(len(b) for b in bins))
    row_of_doc = np.repeat(np.arange(n_rows, dtype=np.int64), [len(b) for b in bins])
    starts = offsets[doc_order].astype(np.int64)
    lens = (offsets[doc_order + 1] - offsets[doc_order]).astype(np.int64)
    ends_cum = np.cumsum(lens)
    begin_cum = ends_cum - lens  # where each document starts in the concatenation of all rows' content
    real = np.bincount(row_of_doc, weights=lens, minlength=n_rows).astype(np.int64)
    if n_rows and real.max() > seq_len:
        raise ValueError(f"a row holds {int(real.max())} tokens, more than seq_len={seq_len}")
    row_content_start = np.concatenate(([0], np.cumsum(real)[:-1])) if n_rows else np.zeros(0, np.int64)
    offset_in_row = begin_cum - row_content_start[row_of_doc]

    total = int(ends_cum[-1]) if lens.size else 0
    pos = np.arange(total, dtype=np.int64) - np.repeat(begin_cum, lens)  # 0.. within each document
    src = np.repeat(starts, lens) + pos
    dst = np.repeat(row_of_doc * seq_len + offset_in_row, lens) + pos

    # Padding defaults everywhere, then the real tokens are scattered over them.
    col = np.tile(np.arange(seq_len, dtype=np.int64), n_rows)
    input_ids = np.full(n_rows * seq_len, pad_id, dtype=np.int32)
    labels = np.full(n_rows * seq_len, IGNORE_INDEX, dtype=np.int32)
    position_ids = (col - np.repeat(real, seq_len)).astype(np.int32)  # trailing pad: 0..k-1
    input_ids[dst] = flat_ids[src]
    labels[dst] = flat_labels[src]
    position_ids[dst] = pos
    labels2d = labels.reshape(n_rows, seq_len)
    return {
        "input_ids": input_ids.reshape(n_rows, seq_len),
        "labels": labels2d,
        "position_ids": position_ids.reshape(n_rows, seq_len),
        "num_real": real.astype(np.int32),
        "num_trainable": (labels2d != IGNORE_INDEX).sum(axis=1).astype(np.int32),
    }


def doc_len_sq(offsets: np.ndarray, bins: list[list[int]]) -> int:
    """Sum over the packed documents (tokens offsets[i]:offsets[i+1], i in `bins`) of length**2: attention's
    work as the meter counts it from the rows' position_ids (a pair's chosen and rejected are two)."""
    lengths = np.diff(offsets)[[i for b in bins for i in b]].astype(np.int64)
    return int((lengths**2).sum())


def batch_pad_efficiency(lengths: Sequence[int] | np.ndarray, batch_size: int, seed: int = 0) -> float:
    """Real tokens / padded tokens when random batches are padded to their longest example.

    The baseline packing is compared against (benchmarks, summary); not used for training.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        return 0.0
    perm = np.random.default_rng(seed).permutation(lens.size)
    padded = 0
    for i in range(0, lens.size, batch_size):
        chunk = lens[perm[i : i + batch_size]]
        padded += int(chunk.max()) * len(chunk)
    return float(lens.sum()) / padded
