"""StepSampler: order is a pure function of (seed, epoch), positioning is O(1), steps never straddle epochs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from trainer.data.sampler import StepSampler


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a, b = StepSampler(103, 8, seed=7), StepSampler(103, 8, seed=7)
    b.order(5)  # a different history of calls must not matter
    for epoch in (0, 1, 2):
        assert np.array_equal(a.order(epoch), b.order(epoch))
        assert np.array_equal(a.order(epoch), np.random.default_rng([7, epoch]).permutation(103))
    # Control: other epochs and other seeds give other orders.
    assert not np.array_equal(a.order(0), a.order(1))
    assert not np.array_equal(a.order(0), StepSampler(103, 8, seed=8).order(0))
    assert sorted(a.order(0).tolist()) == list(range(103))


def test_no_shuffle_is_identity() -> None:
    s = StepSampler(10, 3, seed=1, shuffle=False)
    assert s.order(4).tolist() == list(range(10))
    assert s.rows_for_step(0) == [0, 1, 2] and s.rows_for_step(2) == [6, 7, 8]
    assert s.rows_for_step(3) == [0, 1, 2]  # row 9 dropped: the step would straddle epochs


def test_steps_cover_each_epoch_once_and_drop_the_tail() -> None:
    s = StepSampler(103, 8, seed=3)
    assert s.steps_per_epoch == 12
    for epoch in range(3):
        rows = [r for step in range(epoch * 12, epoch * 12 + 12) for r in s.rows_for_step(step)]
        assert len(rows) == len(set(rows)) == 96
        assert rows == s.order(epoch)[:96].tolist()
    assert s.position(11) == (0, 88) and s.position(12) == (1, 0) and s.position(25) == (2, 8)
    for step in range(40):
        assert s.step_at(*s.position(step)) == step
    with pytest.raises(ValueError, match="not the start of a step"):
        s.step_at(0, 5)


def test_positioning_is_o1_in_the_step() -> None:
    """Jumping to step 10^9 costs what jumping to step 10 costs: nothing is replayed."""
    s = StepSampler(50_000, 16, seed=0)
    t0 = time.perf_counter()
    near = s.rows_for_step(10)
    t_near = time.perf_counter() - t0
    t0 = time.perf_counter()
    far = s.rows_for_step(10**9)
    t_far = time.perf_counter() - t0
    assert len(near) == len(far) == 16
    assert t_far < 10 * t_near + 0.05
    fresh = StepSampler(50_000, 16, seed=0)
    assert fresh.rows_for_step(10**9) == far


def test_micro_batches_partition_the_step_across_ranks() -> None:
    s = StepSampler(200, 2 * 3 * 2, seed=0)  # micro 2, accum 3, world 2
    step_rows = s.rows_for_step(5)
    got = [s.micro_batches(5, r, 2, 2) for r in range(2)]
    assert all(len(m) == 3 and all(len(b) == 2 for b in m) for m in got)
    flat = sorted(x for m in got for b in m for x in b)
    assert flat == sorted(step_rows)
    assert got[0][0] == step_rows[0:2] and got[1][0] == step_rows[2:4] and got[0][1] == step_rows[4:6]
    with pytest.raises(ValueError, match="outside world size"):
        s.micro_batches(5, 2, 2, 2)


def test_uneven_split_covers_the_step_once_on_any_world_size() -> None:
    """A global batch of 8 on 3 ranks: shares 3/3/2, the last micro-step short on rank 2."""
    s = StepSampler(100, 8, seed=1)
    rows = s.rows_for_step(4)
    for world, micro in [(1, 1), (1, 3), (2, 2), (3, 1), (3, 2), (5, 1), (8, 1)]:
        parts = [s.micro_batches(4, r, world, micro) for r in range(world)]
        assert len({len(p) for p in parts}) == 1, "every rank runs the same number of micro-steps"
        flat = [x for m in range(len(parts[0])) for p in parts for x in p[m]]
        assert flat == rows, (world, micro)  # the step's rows, in training order, whatever the split
    shares = [sum(len(b) for b in s.micro_batches(4, r, 3, 1)) for r in range(3)]
    assert shares == [3, 3, 2]


def test_digest_names_the_rows_of_a_step() -> None:
    s, other = StepSampler(100, 8, seed=1), StepSampler(100, 8, seed=2)
    assert s.digest(3) == StepSampler(100, 8, seed=1).digest(3)
    assert s.digest(3) != s.digest(4) and s.digest(3) != other.digest(3)  # control: other rows, other digest


def test_too_few_rows_names_the_keys() -> None:
    with pytest.raises(ValueError, match="train.micro_batch_size.*train.grad_accum.*data.seq_len"):
        StepSampler(3, 4, seed=0)


def test_steps_for_epochs() -> None:
    s = StepSampler(100, 10, seed=0)
    assert s.steps_for_epochs(1.0) == 10 and s.steps_for_epochs(2.5) == 25 and s.steps_for_epochs(0.01) == 1
