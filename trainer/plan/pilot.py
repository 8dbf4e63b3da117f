"""`spotune pilot`: a short run on the real training path, measured, then the full-run forecast.

The pilot is `spotune train` itself with the same model, data, batch and precision, writing
into `<output_dir>/pilot/` (cleared first) and sharing the run's prepared-data cache. Run from
the command line it is two `spotune train` processes timed from outside, like a spot run with
one interruption: the first is stopped with SIGTERM halfway (it saves, as on a preemption
notice) and the second resumes and finishes (final/, report). So one pilot measures a fresh
start, a restart and the end of a run, every second of each process from its start to its exit.

From the attempts' `ledger.jsonl` rows (their `phases`), `metrics.jsonl` and the outside clock:

- sustained real tokens/s after `metrics.warmup_steps` of each attempt (the meter's definition);
- step-time spread within and between the processes (the forecast's interval);
- per-attempt fixed costs: imports, data (prepared or a cache hit), model load, other set-up,
  the slower warm-up steps, and after the steps final/, upload flush, report, interpreter exit;
- a first process that loaded cold (libraries and weights read from disk: a new machine, or a
  page cache reclaimed while idle) is left out of the fixed costs of the run that follows on
  this now-warm machine; what it paid over the last is the restart's `cold_start_extra_seconds`,
  since a replacement machine starts cold;
- with `model.compile`, the compile seconds of a first attempt and of a resumed one (which loads
  the first one's compiled artifacts when it can), each an item of its own;
- the restart: resolve + restore on top of the start-up; checkpoint save seconds and bytes;
  evaluation seconds when the recipe evaluates; peak memory, data-stall share, MFU.

All of that goes to `<output_dir>/pilot/pilot.json` (schema below), which `spotune estimate`
picks up; trainer/plan/timeline.py turns it into itemised forecasts.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from trainer.plan import PlanError
from trainer.restart.local.checkpoint import CheckpointManager

DEFAULT_STEPS = 20
PILOT_SCHEMA = "spotune.pilot/2"
START_PHASES = ("imports", "store", "data", "model", "resolve", "restore")
"""Ledger phases before the first step; `setup` is the start-up they leave unexplained."""
END_PHASES = ("final", "flush", "report")


def summarise(
    run_dir: Path,
    warmup_steps: int,
    device: str,
    outside_seconds: dict[int, float] | None = None,
    earlier_seconds: float = 0.0,
) -> dict[str, Any]:
    """pilot.json's content from a finished pilot's metrics.jsonl and ledger.jsonl.

    `outside_seconds`: attempt number -> its process's wall time as timed by the parent (start
    to exit); the ledger row ends before interpreter exit, which this measures. `earlier_seconds`:
    process time before the pilot that a `spotune train` process would not have (an in-process
    pilot started from a long-lived process), taken out of the first attempt's imports."""
    from trainer.restart.books.ledger import read_rows

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ledger = read_rows(run_dir)
    if not ledger:
        raise PlanError(f"{run_dir}/ledger.jsonl is missing: the pilot did not finish cleanly")
    steps = [r for r in rows if r.get("step_time_s") is not None]
    first_step = {
        a: min(r["step"] for r in steps if r.get("attempt", 1) == a) for a in {r.get("attempt", 1) for r in steps}
    }
    # Each process warms up on its own (allocator, kernels, caches): its first steps are not sustained.
    warm = [r for r in steps if r["step"] - first_step[r.get("attempt", 1)] < warmup_steps]
    sustained = [r for r in steps if r not in warm]
    if len(sustained) < 2:
        raise PlanError(
            f"the pilot in {run_dir} logged {len(sustained)} step(s) after metrics.warmup_steps={warmup_steps}; "
            "give more --steps or --minutes"
        )
    times = np.array([r["step_time_s"] for r in sustained])
    mean_step = float(times.mean())
    # Real tokens of each step: the cumulative counter's increase (the pilot logs every step;
    # a later row of the same step, after a resume, wins).
    counter = {r["step"]: r["real_tokens"] for r in steps if r.get("real_tokens") is not None}
    tokens = sum(float(r["real_tokens"] - counter.get(r["step"] - 1, 0)) for r in sustained)
    world = int(ledger[-1].get("world_size", 1))
    attempts = [_attempt(row, steps, warmup_steps, mean_step, outside_seconds or {}) for row in ledger]
    if earlier_seconds:
        attempts[0]["phases"]["imports"] = max(0.0, attempts[0]["phases"].get("imports", 0.0) - earlier_seconds)
        attempts[0]["startup_seconds"] = max(0.0, attempts[0]["startup_seconds"] - earlier_seconds)
        attempts[0]["wall_seconds"] -= earlier_seconds
    stall = [r["data_stall_share"] for r in sustained if r.get("data_stall_share") is not None]
    evals = [r["eval_seconds"] for r in rows if r.get("eval_seconds") is not None]
    last = ledger[-1]
    return {
        "schema": PILOT_SCHEMA,
        "device": device,
        "world_size": world,
        "steps": len(steps),
        "warmup_steps": len(warm),
        "sustained_tokens_per_s": tokens / float(times.sum()),
        "sustained_mfu": sustained[-1].get("sustained_mfu"),
        "real_tokens_per_step": tokens / len(sustained),
        "step_time_s": _spread(sustained, mean_step),
        "warmup_extra_seconds": statistics.fmean(a["warmup_extra_seconds"] for a in attempts),
        "attempts": attempts,
        "fixed": _fixed(attempts),
        "restart": _restart(attempts),
        "startup_seconds": attempts[0]["startup_seconds"],
        # One save per process: at its end (the preemption save, the final one).
        "save_seconds": sum(float(r["checkpoint_seconds"]) for r in ledger) / world / len(ledger),
        "checkpoint_bytes": _checkpoint_bytes(run_dir),
        "eval_seconds": statistics.fmean(evals) if evals else None,
        "wall_seconds": sum(a["wall_seconds"] for a in attempts),
        "peak_memory_gib": max((r.get("peak_memory_gib") or 0.0) for r in steps),
        "data_stall_share": statistics.fmean(stall) if stall else None,
        "exit_reason": last.get("exit_reason"),
    }


# ---------------------------------------------------------------------------- pieces


def _attempt(
    row: dict[str, Any], steps: list[dict[str, Any]], warmup: int, mean_step: float, outside: dict[int, float]
) -> dict[str, Any]:
    """One pilot process: its fixed costs by phase (wall seconds, not device seconds)."""
    world = int(row.get("world_size", 1))
    number = int(row.get("attempt", 1))
    phases = {k: float(v) for k, v in (row.get("phases") or {}).items()}
    startup = float(row["startup_seconds"]) / world
    mine = [r for r in steps if r.get("attempt", 1) == number]
    first = min((r["step"] for r in mine), default=0)
    warm_times = [r["step_time_s"] for r in mine if r["step"] - first < warmup]
    wall = float(row["wall_seconds"])
    exit_s = max(0.0, outside[number] - wall) if number in outside else None
    return {
        "attempt": number,
        "exit_reason": row.get("exit_reason"),
        "steps": len(mine),
        "wall_seconds": wall,
        "outside_seconds": outside.get(number),
        "startup_seconds": startup,
        "phases": phases,
        "data_reused": row.get("data_reused"),
        # Start-up that no phase names: accelerator, optimizer, sampler, ledger, loader.
        "setup_seconds": max(0.0, startup - sum(phases.get(k, 0.0) for k in START_PHASES)),
        # model.compile compiles in the first steps: an item of its own, not warm-up.
        "warmup_extra_seconds": max(0.0, sum(warm_times) - len(warm_times) * mean_step - phases.get("compile", 0.0)),
        "compile_seconds": phases.get("compile"),
        "compile_cache": row.get("compile_cache"),
        "exit_seconds": exit_s,
    }


def _fixed(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """Fixed costs of one attempt, averaged over the pilot's processes where each measured them.

    `sd`: the standard deviation of a whole start-up (imports + model + set-up + exit) between
    processes; None with a single process."""

    def mean(values: list[float | None]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.fmean(got) if got else None

    warm = [a for a in attempts if not _cold(a, attempts)]  # a cold first process is a restart's cost
    prepared = [a["phases"].get("data") for a in attempts if a["data_reused"] is False]
    hits = [a["phases"].get("data") for a in attempts if a["data_reused"] is True]
    ended = [a for a in attempts if a["exit_reason"] in ("finished", "budget")] or attempts[-1:]
    fixed: dict[str, Any] = {
        "imports": mean([a["phases"].get("imports") for a in warm]),
        "store": mean([a["phases"].get("store") for a in attempts]),
        "data_prepare": mean(prepared),
        "data_cache_hit": mean(hits),
        "model": mean([a["phases"].get("model") for a in warm]),
        "setup": mean([a["setup_seconds"] for a in attempts]),
        "warmup_extra": mean([a["warmup_extra_seconds"] for a in attempts]),
        **{k: mean([a["phases"].get(k) for a in ended]) for k in END_PHASES},
        "exit": mean([a["exit_seconds"] for a in attempts]),
    }
    # model.compile: what a first attempt pays, compiling without an earlier attempt's artifacts.
    if (compiled := mean([a.get("compile_seconds") for a in attempts if not _compile_hit(a)])) is not None:
        fixed["compile"] = compiled
    # What every process pays the same way (a cache hit and a preparation differ by design).
    common = [_loading(a) + a["setup_seconds"] + (a["exit_seconds"] or 0.0) for a in warm]
    fixed["sd"] = statistics.stdev(common) if len(common) > 1 else None
    return fixed


COLD_RATIO = 1.5
"""A first process whose imports + model load took this many times the last one's read its
libraries and weights from disk (a new machine, or one whose page cache was reclaimed while
idle): 3-6x on the 2-core box, where warm processes differ by 10-20%."""


def _loading(a: dict[str, Any]) -> float:
    return sum(a["phases"].get(k, 0.0) for k in ("imports", "model"))


def _cold(a: dict[str, Any], attempts: list[dict[str, Any]]) -> bool:
    """`a` is the first of several processes and loaded cold (COLD_RATIO)."""
    return len(attempts) > 1 and a is attempts[0] and _loading(a) > COLD_RATIO * _loading(attempts[-1])


def _restart(attempts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured restart: the start-up of an attempt that resumed from a checkpoint, and what a
    cold page cache added to the pilot's first process (a replacement machine starts cold too)."""
    resumed = [a for a in attempts if "restore" in a["phases"]]
    if not resumed:
        return None
    a = resumed[-1]
    cold = _loading(attempts[0]) - _loading(attempts[-1]) if _cold(attempts[0], attempts) else 0.0  # as _cold measures
    return {
        "startup_seconds": a["startup_seconds"],
        "cold_start_extra_seconds": cold,
        "resolve_seconds": a["phases"].get("resolve", 0.0),
        "restore_seconds": a["phases"]["restore"],
        "warmup_extra_seconds": a["warmup_extra_seconds"],
        "data_reused": a["data_reused"],
        **({k: a[k] for k in ("compile_seconds", "compile_cache")} if a.get("compile_seconds") is not None else {}),
    }


def _compile_hit(a: dict[str, Any]) -> bool:
    """The attempt loaded an earlier attempt's compiled artifacts (trainer/model/compile_cache.py)."""
    return str(a.get("compile_cache") or "").startswith("hit")


def _spread(sustained: list[dict[str, Any]], mean_step: float) -> dict[str, Any]:
    """Step-time distribution; `between_sd`: how far the processes' own means differ beyond what
    their step-to-step noise explains (a second process on the same machine runs at its own speed)."""
    times = np.array([r["step_time_s"] for r in sustained])
    by_attempt: dict[int, list[float]] = {}
    for r in sustained:
        by_attempt.setdefault(int(r.get("attempt", 1)), []).append(r["step_time_s"])
    sd = float(times.std(ddof=1)) if len(times) > 1 else 0.0
    between = None
    groups = [g for g in by_attempt.values() if len(g) > 1]
    if len(groups) > 1:
        means = [statistics.fmean(g) for g in groups]
        noise = statistics.fmean(sd**2 / len(g) for g in groups)
        between = math.sqrt(max(0.0, statistics.variance(means) - noise))
    return {
        "mean": mean_step,
        "sd": sd,
        "n": len(times),
        "between_sd": between,
        "p10": float(np.percentile(times, 10)),
        "p50": float(np.percentile(times, 50)),
        "p90": float(np.percentile(times, 90)),
    }


def _checkpoint_bytes(run_dir: Path) -> float | None:
    """Size of the newest checkpoint: what a restart downloads and an upload sends."""
    dirs = CheckpointManager(run_dir / "checkpoints").committed()  # not a retired or half-pruned one
    if not dirs:
        return None
    return float(sum(f.stat().st_size for f in dirs[-1].rglob("*") if f.is_file()))


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.machine()})"


def format_pilot(p: dict[str, Any]) -> str:
    st, f = p["step_time_s"], p["fixed"]
    mfu = f", MFU {p['sustained_mfu']:.1%}" if p.get("sustained_mfu") else ""
    stall = f"{p['data_stall_share']:.1%}" if p.get("data_stall_share") is not None else "n/a"
    restart = p.get("restart")
    lines = [
        f"pilot on {p['device']} x{p['world_size']}: {p['steps']} steps in {len(p['attempts'])} process(es) "
        f"({p['warmup_steps']} warm-up)",
        f"  sustained {p['sustained_tokens_per_s']:,.0f} real tokens/s{mfu}",
        f"  step time p10/p50/p90 {st['p10']:.3f} / {st['p50']:.3f} / {st['p90']:.3f} s; data stall {stall}",
        "  fixed: "
        + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in f.items() if k != "sd" and v is not None),
        f"  checkpoint save {p['save_seconds']:.2f} s, peak memory {p['peak_memory_gib']:.2f} GiB",
    ]
    if restart:
        lines.append(
            f"  restart (resume from a checkpoint): start-up {restart['startup_seconds']:.1f} s "
            f"(restore {restart['restore_seconds']:.2f} s)"
        )
    return "\n".join(lines)
