"""Time, cost and spot-interruption arithmetic: pure functions over work, rates and prices.

Units: `work` is whatever the rate counts (tokens, samples, rows); rates are per second;
durations are hours unless the name says seconds; prices are per GPU-hour.

The spot model: a job exposed for `hours` to interruptions arriving on average every
`mtbi_hours` expects hours / mtbi interruptions. Each costs the restart (process start,
model load, resume) plus the work redone since the last checkpoint: on average half a
checkpoint interval. Checkpoints themselves cost `save_seconds` each; the interval that
balances the two is Young/Daly's sqrt(2 * save_time * MTBI).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

Pricing = Literal["on-demand", "spot"]


@dataclass(frozen=True)
class Range:
    """A low / expected / high triple (for durations: fast / expected / slow)."""

    low: float
    expected: float
    high: float

    def scale(self, factor: float) -> Range:
        return Range(self.low * factor, self.expected * factor, self.high * factor)

    def plus(self, amount: float) -> Range:
        return Range(self.low + amount, self.expected + amount, self.high + amount)


def hours_for(work: float, rate_per_second: float) -> float:
    """Hours to get through `work` units at `rate_per_second`."""
    if rate_per_second <= 0:
        raise ValueError(f"throughput must be above 0, got {rate_per_second}")
    return work / rate_per_second / 3600.0


def gpu_hours(hours: float, gpus: int) -> float:
    return hours * gpus


def cost(hours: float, gpus: int, price_per_gpu_hour: float) -> float:
    """Price x GPU-hours."""
    return gpu_hours(hours, gpus) * price_per_gpu_hour


def expected_interruptions(hours: float, mtbi_hours: float | None) -> float:
    """Mean number of interruptions over `hours` of exposure (0 without an interruption rate)."""
    if not mtbi_hours:
        return 0.0
    return hours / mtbi_hours


def interruption_loss_hours(restart_hours: float, checkpoint_interval_hours: float) -> float:
    """What one interruption costs: the restart plus, on average, half an interval of redone work."""
    return restart_hours + checkpoint_interval_hours / 2.0


def young_daly_interval_hours(save_seconds: float, mtbi_hours: float) -> float:
    """Checkpoint interval that minimises save time + expected redone work: sqrt(2 * C * MTBI)."""
    return math.sqrt(2.0 * (save_seconds / 3600.0) * mtbi_hours)


def checkpoint_hours(run_hours: float, interval_hours: float | None, save_seconds: float) -> float:
    """Time spent saving: one save per started interval (the last one is the final save)."""
    saves = max(1, math.ceil(run_hours / interval_hours - 1e-9)) if interval_hours else 1
    return saves * save_seconds / 3600.0


@dataclass(frozen=True)
class Option:
    """One way to run the job: a GPU, a count, a pricing; every duration in wall hours."""

    gpu: str
    gpus: int
    pricing: Pricing
    price_per_gpu_hour: float
    compute_hours: Range
    eval_hours: float
    checkpoint_hours: float
    startup_hours: float
    interruptions: float
    restart_hours: float
    """Expected total time lost to interruptions (restarts + redone work)."""
    checkpoint_interval_hours: float | None
    fixed_spread_hours: float = 0.0
    """Half-width of the fixed costs' own range; combined with the compute range in quadrature
    (independent sources of variation)."""

    @property
    def wall_hours(self) -> Range:
        c = self.compute_hours
        middle = c.expected + self.eval_hours + self.checkpoint_hours + self.startup_hours + self.restart_hours
        below = math.hypot(c.expected - c.low, self.fixed_spread_hours)
        above = math.hypot(c.high - c.expected, self.fixed_spread_hours)
        # The fast end as a rate that much faster (middle / (1 + r)): never 0 however wide the spread.
        return Range(middle / (1.0 + below / middle) if middle > 0 else 0.0, middle, middle + above)

    @property
    def gpu_hours(self) -> Range:
        return self.wall_hours.scale(self.gpus)

    @property
    def cost(self) -> Range:
        return self.gpu_hours.scale(self.price_per_gpu_hour)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["compute_hours"] = asdict(self.compute_hours)
        for name in ("wall_hours", "gpu_hours", "cost"):
            out[name] = asdict(getattr(self, name))
        return out


def plan_option(
    *,
    gpu: str,
    gpus: int,
    pricing: Pricing,
    price_per_gpu_hour: float,
    compute_hours: Range,
    eval_hours: float = 0.0,
    save_seconds: float = 0.0,
    checkpoint_interval_hours: float | None = None,
    startup_hours: float = 0.0,
    mtbi_hours: float | None = None,
    restart_hours: float = 0.0,
    saves: int | None = None,
    fixed_spread_hours: float = 0.0,
) -> Option:
    """Assemble one option; on spot, interruptions are counted over the expected exposure.

    `saves`: the number of checkpoints when known exactly (trainer/plan/timeline.py: save_count);
    else one per started checkpoint interval."""
    if saves is not None:
        ckpt = saves * save_seconds / 3600.0
    else:
        ckpt = checkpoint_hours(compute_hours.expected, checkpoint_interval_hours, save_seconds)
    exposure = compute_hours.expected + eval_hours + ckpt + startup_hours
    n = expected_interruptions(exposure, mtbi_hours) if pricing == "spot" else 0.0
    # Without periodic checkpoints a restart redoes everything done so far: half the run on average.
    interval = checkpoint_interval_hours if checkpoint_interval_hours else compute_hours.expected
    lost = n * interruption_loss_hours(restart_hours, interval)
    return Option(
        gpu=gpu,
        gpus=gpus,
        pricing=pricing,
        price_per_gpu_hour=price_per_gpu_hour,
        compute_hours=compute_hours,
        eval_hours=eval_hours,
        checkpoint_hours=ckpt,
        startup_hours=startup_hours,
        interruptions=n,
        restart_hours=lost,
        checkpoint_interval_hours=checkpoint_interval_hours,
        fixed_spread_hours=fixed_spread_hours,
    )


def cheapest(
    options: Iterable[Option], deadline_hours: float | None = None, budget: float | None = None
) -> Option | None:
    """The cheapest option whose expected wall time meets the deadline and cost meets the budget.

    With only a budget, the fastest option within it is returned instead (spending the
    budget to finish sooner is what a budget usually means)."""
    ok = [
        o
        for o in options
        if (deadline_hours is None or o.wall_hours.expected <= deadline_hours)
        and (budget is None or o.cost.expected <= budget)
    ]
    if not ok:
        return None
    if budget is not None and deadline_hours is None:
        return min(ok, key=lambda o: (o.wall_hours.expected, o.cost.expected))
    return min(ok, key=lambda o: (o.cost.expected, o.wall_hours.expected))
