"""What the option just cheaper than the recommended one lacks, in one line for `spotune estimate`
('L4 on-demand: needs 27.1 GiB per GPU, has 24'), so a user sees why the recommendation costs
what it does. Options are the estimate's rows (trainer/plan/estimate.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainer.plan import memory as mem
from trainer.plan.job import Job


def frugal_gib(job: Job, devices: int) -> float:
    """Per-device GiB with checkpointing and activation offloading on: the least this run can
    ask of a GPU without changing what it trains."""
    model = dataclasses.replace(job.model, gradient_checkpointing=True, activation_offload="on")
    return dataclasses.replace(job, model=model).memory(devices).total / mem.GIB


def next_cheaper(
    options: list[dict[str, Any]], chosen: int, need_gib: float, frugal: float, deadline_hours: float | None
) -> str | None:
    """The option with the highest expected cost below the chosen one's, and why it was not chosen."""
    cost = options[chosen]["cost"]["expected"]
    cheaper = [o for o in options if o["cost"]["expected"] is not None and o["cost"]["expected"] < cost]
    if not cheaper:
        return None
    o = max(cheaper, key=lambda x: x["cost"]["expected"])
    count = f" x{o['gpus']}" if o["gpus"] > 1 else ""
    name = f"{o['gpu']}{count} {o['pricing']}"
    if not o["fits"]:
        has = o.get("memory_gib")
        line = f"{name}: needs {need_gib:.1f} GiB per GPU, has {has:g}" if has else f"{name}: does not fit"
        if has and frugal <= has < need_gib:
            line += (
                f" (needs {frugal:.1f} with model.gradient_checkpointing=true and model.activation_offload=on, "
                "or set both to auto)"
            )
        if o.get("fsdp_gpus"):
            line += f"; {o['fsdp_gpus']} of them hold it under train.distributed=fsdp"
        return line
    wall = o["wall_hours"]["expected"]
    if deadline_hours is not None and wall > deadline_hours:
        return f"{name}: takes {wall:.1f} h, over the {deadline_hours:g} h deadline"
    return f"{name}: fits, but takes {wall:.1f} h against {options[chosen]['wall_hours']['expected']:.1f} h"
