"""The worked cases of the planning spec, through the pure forecast functions."""

from __future__ import annotations

import math

import pytest

from trainer.plan import forecast as fc

P = 2.0  # any price per GPU-hour; the cases are stated in multiples of it


def test_300k_samples_at_1100_per_minute_on_one_gpu() -> None:
    hours = fc.hours_for(100_000 * 3, 1100 / 60)
    assert hours * 60 == pytest.approx(272.7, abs=0.05)  # "about 273 minutes"
    assert hours == pytest.approx(4.55, abs=0.01)
    on_demand = fc.cost(hours, 1, P)
    assert on_demand == pytest.approx(4.55 * P, rel=0.002)
    # Spot at half the price, with 10% extra time for one interruption: ~2.5P, a 45% saving.
    spot = fc.cost(hours * 1.10, 1, 0.5 * P)
    assert spot == pytest.approx(2.5 * P, rel=0.001)
    assert 1 - spot / on_demand == pytest.approx(0.45, abs=1e-9)


def test_12_hour_job_with_an_interruption_every_8_hours() -> None:
    n = fc.expected_interruptions(12, 8)
    assert n == 1.5
    # 5 minutes lost each: as a restart of 5 minutes with no redone work (interval 0).
    lost_hours = n * fc.interruption_loss_hours(restart_hours=5 / 60, checkpoint_interval_hours=0)
    assert lost_hours * 60 == pytest.approx(7.5)


def test_400k_sequences_at_1200_per_minute() -> None:
    assert fc.hours_for(200_000 * 2, 1200 / 60) == pytest.approx(5.56, abs=0.01)


def test_young_daly_interval() -> None:
    # 60 s saves, an interruption every 8 h: sqrt(2 * 60 s * 28800 s) = 1859 s = 31 min.
    assert fc.young_daly_interval_hours(60, 8) * 60 == pytest.approx(math.sqrt(2 * 60 * 8 * 3600) / 60)
    assert fc.young_daly_interval_hours(60, 8) * 60 == pytest.approx(30.98, abs=0.01)


def test_spot_option_adds_interruption_loss_and_ranks_by_cost() -> None:
    compute = fc.Range(4.0, 4.55, 5.0)
    od = fc.plan_option(
        gpu="X",
        gpus=1,
        pricing="on-demand",
        price_per_gpu_hour=P,
        compute_hours=compute,
        save_seconds=30,
        checkpoint_interval_hours=0.5,
        mtbi_hours=8,
        restart_hours=0.1,
    )
    spot = fc.plan_option(
        gpu="X",
        gpus=1,
        pricing="spot",
        price_per_gpu_hour=0.5 * P,
        compute_hours=compute,
        save_seconds=30,
        checkpoint_interval_hours=0.5,
        mtbi_hours=8,
        restart_hours=0.1,
    )
    assert od.interruptions == 0 and od.restart_hours == 0
    saves = 10  # 9 periodic saves in 4.55 h, then the final one
    assert od.checkpoint_hours == pytest.approx(saves * 30 / 3600)
    exposure = 4.55 + saves * 30 / 3600
    assert spot.interruptions == pytest.approx(exposure / 8)
    assert spot.restart_hours == pytest.approx(exposure / 8 * (0.1 + 0.25))
    assert spot.wall_hours.expected == pytest.approx(exposure + spot.restart_hours)
    assert spot.cost.expected == pytest.approx(spot.wall_hours.expected * 0.5 * P)
    assert spot.wall_hours.low < spot.wall_hours.expected < spot.wall_hours.high
    # Cheapest overall is spot; a deadline between the two wall times forces on-demand.
    assert fc.cheapest([od, spot]) is spot
    deadline = (od.wall_hours.expected + spot.wall_hours.expected) / 2
    assert fc.cheapest([od, spot], deadline_hours=deadline) is od
    assert fc.cheapest([od, spot], deadline_hours=1.0) is None
    # A budget alone picks the fastest option within it.
    assert fc.cheapest([od, spot], budget=100 * P) is od
    assert fc.cheapest([od, spot], budget=spot.cost.expected) is spot


def test_checkpoint_count() -> None:
    assert fc.checkpoint_hours(2.0, 0.5, 36) == pytest.approx(4 * 0.01)  # saves at 0.5, 1, 1.5 and 2 (final)
    assert fc.checkpoint_hours(2.1, 0.5, 36) == pytest.approx(5 * 0.01)
    assert fc.checkpoint_hours(2.0, None, 36) == pytest.approx(0.01)  # only the final save


def test_gpus_multiply_gpu_hours_and_cost() -> None:
    o = fc.plan_option(gpu="X", gpus=4, pricing="on-demand", price_per_gpu_hour=P, compute_hours=fc.Range(1, 2, 3))
    assert o.gpu_hours.expected == pytest.approx(4 * o.wall_hours.expected)
    assert o.cost.expected == pytest.approx(4 * o.wall_hours.expected * P)


def test_zero_throughput_names_the_problem() -> None:
    with pytest.raises(ValueError, match="throughput"):
        fc.hours_for(1, 0)
