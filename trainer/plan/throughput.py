"""How fast the run goes: real tokens/s per GPU, where that figure comes from, and its range.

Three sources, best first: a pilot's measurement, a rate the user gives, or the catalogue
GPU's peak bf16 FLOP/s x an assumed MFU. `rate_on` carries a rate to another GPU.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from trainer import catalog as cat
from trainer.plan import PlanError

DEFAULT_MFU = {"lora": 0.35, "qlora": 0.25}
"""Assumed model-FLOPs utilisation without a measurement: typical of LoRA on one modern GPU
with packed sequences; 4-bit dequantisation costs QLoRA about a third more time."""
MFU_SPREAD = 0.3  # an assumed MFU is a guess: +/-30% on throughput
GIVEN_SPREAD = 0.1  # a throughput the user gives us: +/-10%

Source = Literal["pilot", "given", "mfu"]


@dataclass(frozen=True)
class Throughput:
    """A rate and its provenance; `low_factor`/`high_factor` scale it to the range's ends."""

    source: Source
    tokens_per_s_per_gpu: float | None
    """None for `mfu`: the rate follows from each GPU's peak."""
    device: str | None
    """The device the rate was measured on (or named with it)."""
    measured_gpus: int
    mfu: float | None
    assumed_mfu: float
    """The MFU used for GPUs the measurement cannot be carried to."""
    low_factor: float
    high_factor: float

    def as_dict(self) -> dict[str, Any]:
        """The `throughput` part of the estimate document."""
        d = asdict(self)
        d["range_factors"] = [d.pop("low_factor"), d.pop("high_factor")]
        return d


def choose(
    method: str, pilot: dict[str, Any] | None, given: float | None, given_device: str | None, mfu: float | None
) -> Throughput:
    """The best rate available: a pilot's, else the user's, else an assumed MFU (`method`: lora|qlora)."""
    assumed = mfu if mfu is not None else DEFAULT_MFU[method]
    if not 0 < assumed <= 1:
        raise PlanError(f"--mfu must be within (0, 1], got {assumed}")
    if pilot is not None:
        world = int(pilot.get("world_size", 1))
        # The sustained rate goes with the mean step time; p10/p90 steps bound the range
        # (at least +/-5%: a short pilot on a quiet machine understates the spread).
        mean, p10, p90 = (pilot["step_time_s"][k] for k in ("mean", "p10", "p90"))
        return Throughput(
            source="pilot",
            tokens_per_s_per_gpu=pilot["sustained_tokens_per_s"] / world,
            device=pilot.get("device"),
            measured_gpus=world,
            mfu=pilot.get("sustained_mfu"),
            assumed_mfu=assumed,
            low_factor=min(mean / p90, 0.95) if p90 else 0.95,
            high_factor=max(mean / p10, 1.05) if p10 else 1.05,
        )
    if given is not None:
        if given <= 0:
            raise PlanError(f"--throughput must be above 0 tokens/s, got {given}")
        return Throughput("given", given, given_device, 1, None, assumed, 1 - GIVEN_SPREAD, 1 + GIVEN_SPREAD)
    return Throughput("mfu", None, None, 1, assumed, assumed, 1 - MFU_SPREAD, 1 + MFU_SPREAD)


@dataclass(frozen=True)
class Rate:
    """A throughput carried to one GPU."""

    tokens_per_s_per_gpu: float
    slow: float
    fast: float
    basis: str
    """`measured`, `given`, `scaled from <GPU>` or `assumed MFU <x>`."""


def rate_on(t: Throughput, g: cat.GPU | None, catalog: list[cat.GPU], flops_per_token: float) -> Rate:
    """The rate on catalogue GPU `g` (None: the device the rate was measured on)."""
    if g is None:
        assert t.tokens_per_s_per_gpu is not None, "only a measured rate has a device of its own"
        return Rate(t.tokens_per_s_per_gpu, t.low_factor, t.high_factor, "measured")
    ref = cat.match_device(t.device, catalog) if t.device else None
    if t.tokens_per_s_per_gpu is not None and ref is not None:
        # Same MFU on a faster or slower GPU: scale by peak FLOP/s.
        basis = "measured" if ref.name == g.name else f"scaled from {ref.name}"
        scaled = t.tokens_per_s_per_gpu * g.peak_bf16_flops / ref.peak_bf16_flops
        return Rate(scaled, t.low_factor, t.high_factor, basis)
    if t.source == "given" and t.device is None:
        assert t.tokens_per_s_per_gpu is not None
        return Rate(t.tokens_per_s_per_gpu, t.low_factor, t.high_factor, "given")  # taken for every GPU
    # Nothing measured on a catalogue GPU (an MFU estimate, or a pilot on CPU): peak x MFU.
    if not flops_per_token:
        raise PlanError("cannot derive a throughput: the run has no tokens")
    per_gpu = g.peak_bf16_flops * t.assumed_mfu / flops_per_token
    return Rate(per_gpu, 1 - MFU_SPREAD, 1 + MFU_SPREAD, f"assumed MFU {t.assumed_mfu:.2f}")


def measured_sd(step: dict[str, Any]) -> float:
    """Relative standard deviation of a run's total step time, from a pilot's step times.

    Three parts. The machine's own speed varies over time, and on a shared or virtual machine
    that variation is slow (the steps of minutes run fast or slow together), so the steps'
    spread is taken whole, not divided by the number of steps (cv). The pilot's mean is itself
    an estimate (sd / sqrt(n)). And a new process runs at its own speed (`between_sd`,
    measured between the pilot's processes)."""
    mean = float(step["mean"])
    if mean <= 0:
        return 0.0
    sd, n = float(step.get("sd") or 0.0), max(1, int(step.get("n") or 1))
    between = float(step.get("between_sd") or 0.0)
    return math.sqrt(sd**2 + sd**2 / n + between**2) / mean


def machine_cv(step: dict[str, Any] | None) -> float:
    """The pilot's step-time coefficient of variation: how much this machine's speed varies."""
    if not step or not step.get("mean"):
        return 0.0
    return float(step.get("sd") or 0.0) / float(step["mean"])
