"""`spotune pilot`: a short run on the real training path, measured, then the full-run forecast.

The pilot is `trainer.run.train` itself with the same model, data, batch and precision,
writing into `<output_dir>/pilot/` (cleared first; it never resumes) and sharing the run's
prepared-data cache. It logs every step, stops after N steps (or M minutes through the
device-hours budget guard) and saves one checkpoint at the end, so the save is measured too.
From its metrics.jsonl and ledger.jsonl:

- sustained real tokens/s after `metrics.warmup_steps` (the meter's own definition);
- step-time spread p10/p50/p90 over the same steps (the forecast's low/high range);
- `warmup_extra_seconds`: how much longer the warm-up steps took than sustained steps;
- startup seconds (process start to first step, less a first-time data preparation that
  the real run will reuse), teardown (writing final/), checkpoint save seconds, peak memory,
  data-stall share, MFU when the device's peak is known.

All of that goes to `<output_dir>/pilot/pilot.json`, which `spotune estimate` picks up.
"""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from trainer.plan import PlanError

DEFAULT_STEPS = 20
PILOT_SCHEMA = "spotune.pilot/1"


def summarise(
    run_dir: Path, warmup_steps: int, device: str, prepare_seconds: float = 0.0, earlier_seconds: float = 0.0
) -> dict[str, Any]:
    """pilot.json's content from a finished pilot's metrics.jsonl and ledger.jsonl.

    The ledger's clock starts at process start; `prepare_seconds` (a first-time data
    preparation) and `earlier_seconds` (process time before the pilot that a `spotune
    train` process would not have) are taken out of startup and wall time."""
    from trainer.restart.ledger import read_rows

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if r.get("step_time_s") is not None]
    warm = [r for r in steps if r["step"] <= warmup_steps]
    sustained = [r for r in steps if r["step"] > warmup_steps]
    if len(sustained) < 2:
        raise PlanError(
            f"the pilot in {run_dir} logged {len(sustained)} step(s) after metrics.warmup_steps={warmup_steps}; "
            "give more --steps or --minutes"
        )
    times = np.array([r["step_time_s"] for r in sustained])
    mean_step = float(times.mean())
    ledger = read_rows(run_dir)
    if not ledger:
        raise PlanError(f"{run_dir}/ledger.jsonl is missing: the pilot did not finish cleanly")
    last = ledger[-1]
    world = int(last.get("world_size", 1))
    # Real tokens per step from the cumulative counter, over the sustained steps.
    first_real = warm[-1]["real_tokens"] if warm else 0
    tokens_per_step = (sustained[-1]["real_tokens"] - first_real) / len(sustained)
    stall = [r["data_stall_share"] for r in sustained if r.get("data_stall_share") is not None]
    startup = max(0.0, float(last["startup_seconds"]) / world - prepare_seconds - earlier_seconds)
    save = float(last["checkpoint_seconds"]) / world
    wall = float(last["wall_seconds"]) - prepare_seconds - earlier_seconds
    # Whatever the wall time holds beyond startup, steps and the save: writing final/, exit.
    teardown = max(0.0, wall - startup - sum(r["step_time_s"] for r in steps) - save)
    return {
        "schema": PILOT_SCHEMA,
        "device": device,
        "world_size": world,
        "steps": len(steps),
        "warmup_steps": len(warm),
        "sustained_tokens_per_s": sustained[-1].get("sustained_tokens_per_s") or tokens_per_step / mean_step,
        "sustained_mfu": sustained[-1].get("sustained_mfu"),
        "real_tokens_per_step": tokens_per_step,
        "step_time_s": {
            "mean": mean_step,
            "p10": float(np.percentile(times, 10)),
            "p50": float(np.percentile(times, 50)),
            "p90": float(np.percentile(times, 90)),
        },
        "warmup_extra_seconds": max(0.0, sum(r["step_time_s"] for r in warm) - len(warm) * mean_step),
        "startup_seconds": startup,
        "teardown_seconds": teardown,
        "prepare_seconds": prepare_seconds,
        "save_seconds": save,
        "wall_seconds": wall,
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in steps),
        "data_stall_share": statistics.fmean(stall) if stall else None,
        "exit_reason": last.get("exit_reason"),
    }


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()})"


def format_pilot(p: dict[str, Any]) -> str:
    st = p["step_time_s"]
    mfu = f", MFU {p['sustained_mfu']:.1%}" if p.get("sustained_mfu") else ""
    stall = f"{p['data_stall_share']:.1%}" if p.get("data_stall_share") is not None else "n/a"
    return "\n".join(
        [
            f"pilot on {p['device']} x{p['world_size']}: {p['steps']} steps ({p['warmup_steps']} warm-up)",
            f"  sustained {p['sustained_tokens_per_s']:,.0f} real tokens/s{mfu}",
            f"  step time p10/p50/p90 {st['p10']:.3f} / {st['p50']:.3f} / {st['p90']:.3f} s; data stall {stall}",
            f"  startup {p['startup_seconds']:.1f} s (+{p['prepare_seconds']:.1f} s preparing data, once), "
            f"checkpoint save {p['save_seconds']:.2f} s, peak memory {p['peak_memory_gib']:.2f} GiB",
        ]
    )
