"""The meter: every figure a run reports (throughput, MFU, data stall, memory, cost), defined once.

Where its rows go (the JSONL file, the console, trackers) is trainer/training/telemetry.py.

Definitions (one place, see DESIGN.md):
- trainable tokens: tokens whose label is not -100 (after the shift), summed over ranks;
  real tokens: non-padding tokens. "tokens/s" below means real tokens per second.
- window tokens/s: real tokens of the steps since the previous row over the wall time of
  those steps; checkpoint and evaluation time are excluded (they are not training).
- sustained tokens/s: the same over every step after `metrics.warmup_steps` of this attempt.
- data-stall share: time the loop was blocked waiting for the next batch / step time.
- MFU: model FLOPs (trainer/model/flops.py `MFU`: the published LoRA count, 4 per frozen matmul
  weight per token plus attention per packed document, no recompute; the other counts are
  defined beside it) / (seconds x devices x peak FLOP/s of one device).
- time: wall-clock seconds (Unix) when the row was written.
- device-hours: wall time x devices, summed over every attempt (earlier attempts come in
  as `prior_device_seconds`); cost = device-hours x `metrics.price_per_hour`.

Only rank 0 builds sinks; the meter itself is cheap host arithmetic on numbers the loop
already reads once per step.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.config import ConfigError

FlopsFn = Callable[[float, float, float], float]
"""(real tokens, sum of squared document lengths, tokens that reach the output head) -> training FLOPs."""


@dataclass
class Meter:
    """Accumulates per-step timings and token counts; `row()` turns them into one metrics row."""

    world_size: int
    warmup_steps: int
    flops_fn: FlopsFn | None = None
    peak_flops: float | None = None
    """Peak FLOP/s of one device; MFU is null without it."""
    price_per_hour: float | None = None
    prior_device_seconds: float = 0.0
    device_seconds_fn: Callable[[], float] | None = None
    """Device-seconds of the whole run from elsewhere (the ledger); else counted here."""
    start_step: int = 0
    total_steps: int | None = None
    """Steps the run will take in all, for the projected total cost."""
    attempt_start: float = field(default_factory=time.monotonic)
    # window (since the previous row) and sustained (after warm-up) accumulators
    _w_seconds: float = 0.0
    _w_stall: float = 0.0
    _w_steps: int = 0
    _w_real: float = 0.0
    _w_flops: float = 0.0
    _s_seconds: float = 0.0
    _s_steps: int = 0
    _s_real: float = 0.0
    _s_flops: float = 0.0
    _paused: float = 0.0

    def step(
        self,
        step: int,
        seconds: float,
        stall_seconds: float,
        real_tokens: float,
        doc_len_sq_sum: float,
        head_tokens: float | None = None,
    ) -> None:
        """One optimizer step: its wall time (data wait included), the part spent waiting for
        data, and its real tokens and sum of squared document lengths over every rank.
        `head_tokens`: tokens whose logits the loop computed (default: every real token)."""
        head = real_tokens if head_tokens is None else head_tokens
        flops = self.flops_fn(real_tokens, doc_len_sq_sum, head) if self.flops_fn else 0.0
        self._w_seconds += seconds
        self._w_stall += stall_seconds
        self._w_steps += 1
        self._w_real += real_tokens
        self._w_flops += flops
        if step - self.start_step >= self.warmup_steps:
            self._s_steps += 1
            self._s_seconds += seconds
            self._s_real += real_tokens
            self._s_flops += flops

    def pause(self, seconds: float) -> None:
        """Checkpoint or evaluation time: counted in device-hours, excluded from throughput."""
        self._paused += seconds

    def device_seconds(self) -> float:
        if self.device_seconds_fn is not None:
            return self.device_seconds_fn()
        return self.prior_device_seconds + (time.monotonic() - self.attempt_start) * self.world_size

    def cost(self) -> float | None:
        if self.price_per_hour is None:
            return None
        return self.device_seconds() / 3600.0 * self.price_per_hour

    def _mfu(self, flops: float, seconds: float) -> float | None:
        if not self.peak_flops or not self.flops_fn or seconds <= 0:
            return None
        return flops / (seconds * self.world_size * self.peak_flops)

    def row(self, **fields: Any) -> dict[str, Any]:
        """A metrics row: the caller's fields (step, loss, lr, ...) plus rates; resets the window."""
        w_s = self._w_seconds
        row = dict(fields)
        row.update(
            tokens_per_s=_rate(self._w_real, w_s),
            sustained_tokens_per_s=_rate(self._s_real, self._s_seconds),
            step_time_s=w_s / self._w_steps if self._w_steps else None,
            data_stall_share=self._w_stall / w_s if w_s > 0 else None,
            mfu=self._mfu(self._w_flops, w_s),
            sustained_mfu=self._mfu(self._s_flops, self._s_seconds),
            peak_memory_gib=peak_memory_bytes() / 2**30,
            gpu_util=gpu_utilisation(),
            device_hours=self.device_seconds() / 3600.0,
            cost=self.cost(),
            projected_cost=self.projected_cost(fields.get("step")),
            paused_s=self._paused,
            time=time.time(),
        )
        self._w_seconds = self._w_stall = self._w_real = self._w_flops = 0.0
        self._w_steps = 0
        return row

    def projected_cost(self, step: int | None) -> float | None:
        """Cost so far plus the remaining steps at the sustained step time (the window's before
        warm-up ends). Checkpoint and evaluation time ahead are not projected: a lower bound."""
        cost = self.cost()
        if cost is None or self.total_steps is None or step is None:
            return None
        if self._s_steps:
            per_step = self._s_seconds / self._s_steps
        elif self._w_steps:
            per_step = self._w_seconds / self._w_steps
        else:
            return None
        remaining = max(0, self.total_steps - step)
        return cost + remaining * per_step * self.world_size / 3600.0 * (self.price_per_hour or 0.0)

    def summary(self) -> dict[str, Any]:
        return dict(
            sustained_tokens_per_s=_rate(self._s_real, self._s_seconds),
            sustained_mfu=self._mfu(self._s_flops, self._s_seconds),
            device_hours=self.device_seconds() / 3600.0,
            cost=self.cost(),
        )


def _rate(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def peak_memory_bytes() -> int:
    """Peak allocated device memory on CUDA; on CPU the process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


_NVML: Any = None


def gpu_utilisation() -> float | None:
    """Instantaneous GPU utilisation (percent) of this process's device via NVML, when available."""
    global _NVML
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    try:
        if _NVML is None:
            import pynvml  # optional: the nvidia-ml-py package

            pynvml.nvmlInit()
            _NVML = pynvml
        index = torch.cuda.current_device()
        handle = _NVML.nvmlDeviceGetHandleByIndex(index)
        return float(_NVML.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NVML missing, or no permission inside a container: the field stays null
        return None


def resolve_peak_flops(explicit: float | None, gpu_name: str | None, device: torch.device) -> float | None:
    """`metrics.peak_flops`, else the catalogue's dense bf16 peak for `metrics.gpu` (a catalogue
    name such as H100-SXM, or a device name) or for the detected CUDA device; None on CPU."""
    if explicit:
        return explicit
    from trainer import catalog

    if gpu_name is not None:
        try:
            return catalog.find_gpu(gpu_name).peak_bf16_flops
        except catalog.CatalogError as e:
            raise ConfigError([f"metrics.gpu: {e}; or set metrics.peak_flops to the device's peak FLOP/s"]) from None
    if device.type == "cuda":
        return catalog.peak_flops_for(torch.cuda.get_device_name(device))
    return None  # CPU: no meaningful peak, MFU stays null


# ---------------------------------------------------------------------------- sinks
