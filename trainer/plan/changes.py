"""What makes a run fit a GPU it does not fit as set: the changes a user can make, smallest first, each
with the GiB per GPU it gives (`spotune estimate`: trainer/plan/estimate.py and fit.py put them on the
rows of the GPUs that do not fit).

Smallest first: what changes only speed (gradient checkpointing, then activation offloading on top),
then what changes the numerics a little (QLoRA: the frozen base in 4 bits), then what changes the data
(a shorter data.seq_len: longer examples are cut or dropped), then what takes more GPUs (FSDP over N).
QLoRA, the shorter seq_len and FSDP are priced with the most frugal memory settings the recipe does
not already have (checkpointing and offloading on: the overrides say so). Relies on `Job.memory`
alone: pure arithmetic. `annotate` puts them, and what the recipe's `auto` settings choose on each GPU
(`How`, asked of the run's own rule by trainer/cli/world.py), on the estimate's rows; `cheapest` names
the fitting row of least cost per pricing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from trainer.plan import memory as mem
from trainer.plan.job import Job

How = Callable[[float], dict[str, Any] | None]
"""GPU memory (GiB) -> what the run's `auto` settings choose on it: {setting, gib, fits}, or None when no
memory setting is `auto` (trainer/cli/world.py asks trainer/training/autofit.py: `choice_on`)."""

SEQ_STEP = 128
"""The shorter seq_len offered is a multiple of this (kernels and packing like round lengths)."""


def frugal(job: Job) -> tuple[Job, list[str]]:
    """`job` with checkpointing and activation offloading on, and the overrides that say so (none for a
    setting the recipe has on or `auto` already: `Job.memory` counts `auto` at its most frugal)."""
    overrides = []
    if job.model.gradient_checkpointing is False:
        overrides.append("model.gradient_checkpointing=true")
    if job.model.activation_offload == "off":
        overrides.append("model.activation_offload=on")
    model = dataclasses.replace(
        job.model,
        gradient_checkpointing=job.model.gradient_checkpointing or True,
        activation_offload="on" if job.model.activation_offload == "off" else job.model.activation_offload,
    )
    return dataclasses.replace(job, model=model), overrides


def fit_changes(job: Job, devices: int, memory_gib: float) -> list[dict[str, Any]]:
    """Each change that lowers the per-device memory of `job` on `devices` GPUs, smallest first:
    {change: the overrides as typed, gib: per GPU with it, fits: within `memory_gib`}; an FSDP entry
    also has `gpus` (the fewest that hold it, null when not within 64)."""
    room = memory_gib * mem.GIB
    out: list[dict[str, Any]] = []

    def add(change: str, total: float, **extra: Any) -> None:
        out.append({"change": change, "gib": total / mem.GIB, "fits": total <= room, **extra})

    if job.model.gradient_checkpointing is False:
        ckpt = dataclasses.replace(job.model, gradient_checkpointing=True)
        add("model.gradient_checkpointing=true", dataclasses.replace(job, model=ckpt).memory(devices).total)
    lean, overrides = frugal(job)
    if job.model.activation_offload == "off":
        add(" ".join(overrides), lean.memory(devices).total)
    if job.adapter.method == "lora":
        q = dataclasses.replace(lean, adapter=dataclasses.replace(job.adapter, method="qlora", quant_bits=4))
        add(" ".join(["adapter.method=qlora", *overrides]), q.memory(devices).total)
    seq = longest_seq_len(lean, devices, room)
    if seq is not None and seq < job.seq_len:
        total = dataclasses.replace(lean, seq_len=seq).memory(devices).total
        add(" ".join([f"data.seq_len={seq}", *overrides]), total)
    n = lean.fsdp_devices(memory_gib)
    if not lean.shardable:  # FSDP is no change that can make it fit
        return out
    if n is not None and n > 1:
        add(" ".join([f"train.distributed=fsdp --gpus {n}", *overrides]), lean.memory(n, fsdp=True).total, gpus=n)
    elif n is None:
        out.append(
            {"change": " ".join(["train.distributed=fsdp", *overrides]), "gib": None, "fits": False, "gpus": None}
        )
    return out


def longest_seq_len(job: Job, devices: int, room: float) -> int | None:
    """The longest multiple of `SEQ_STEP` below `job.seq_len` whose memory fits `room` bytes (None: not
    even `SEQ_STEP`). Memory grows with the sequence, so a bisection finds it."""
    lo, hi = 1, (job.seq_len - 1) // SEQ_STEP  # in units of SEQ_STEP

    def fits(units: int) -> bool:
        return dataclasses.replace(job, seq_len=units * SEQ_STEP).memory(devices).total <= room

    if hi < 1 or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo * SEQ_STEP


def smallest(changes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first change that fits (they come smallest first), or None."""
    return next((c for c in changes if c["fits"]), None)


def annotate(rows: list[dict[str, Any]], job: Job, devices: int, how: How | None) -> None:
    """Each GPU row gets how the run fits it: `setting`, what the recipe's `auto` memory settings choose
    there ({setting, gib, fits}, null when none is `auto`), and, where it does not fit as set,
    `fit_changes`: what would make it fit, smallest first, each with its GiB (trainer/plan/changes.py)."""
    seen: dict[float, tuple[dict[str, Any] | None, list[dict[str, Any]] | None]] = {}
    for row in rows:
        gib = row.get("memory_gib")
        if gib is None:  # the device a pilot ran on, outside the catalogue
            row.update(setting=None, fit_changes=None)
            continue
        if gib not in seen:  # the same memory size, the same answer (on-demand and spot rows)
            seen[gib] = (how(gib) if how else None, None if row["fits"] else fit_changes(job, devices, gib))
        setting, fixes = seen[gib]
        row.update(setting=setting, fit_changes=fixes)


def cheapest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pricing, the fitting row of least expected cost (with an estimate's hours and money): {gpu,
    gpus, price_per_gpu_hour, wall_hours, cost} or null."""
    out: dict[str, Any] = {}
    for pricing in ("on-demand", "spot"):
        fitting = [r for r in rows if r["pricing"] == pricing and r["fits"] and r["cost"]["expected"] is not None]
        best = min(fitting, key=lambda r: (r["cost"]["expected"], r["wall_hours"]["expected"]), default=None)
        out[pricing] = (
            None
            if best is None
            else {
                "gpu": best["gpu"],
                "gpus": best["gpus"],
                "price_per_gpu_hour": best["price_per_gpu_hour"],
                "wall_hours": best["wall_hours"]["expected"],
                "cost": best["cost"]["expected"],
                "setting": (best.get("setting") or {}).get("setting"),
            }
        )
    return out
