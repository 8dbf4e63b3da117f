"""`spotune estimate`: memory fit, GPU-hours and cost per catalogue GPU, on demand against spot.

The pieces: workload.py counts the tokens, flops.py the FLOPs per token, memory.py the
bytes per GPU, throughput.py the rate, forecast.py the hours and money, table.py the text.
This module takes numbers and config sections, never the run: the CLI glue in
trainer/cli/world.py reads the model config, the data and pilot.json and builds a `Job`.
`estimate` works in three parts: the run's totals, one option per GPU and pricing, and the
JSON document.

`--json` schema `spotune.estimate/1` (tests/test_plan_estimate.py pins the keys):
  model{name_or_path, arch, params, trainable_params, weight_format, shardable (FSDP can train it), flops_per_token},
  data{source: manifest|sample|given, exact, rows_per_epoch, real_tokens_per_epoch, ..., truncation{seq_len,
       examples, tokens, truncated, dropped, tokens_lost, p99} | null (trainer/data/stats.py)},
  run{steps, gpus, global_batch_rows, seq_len, epochs, real_tokens, trainable_tokens, train_flops,
      pairs_per_step (preference objectives; null for SFT), pairs_are (`pairs`, or KTO's `answers`)},
  memory_gib{weights, adapter, gradients, optimizer, activations, logits, backward_workspace,
             overhead, total, pilot_measured_peak, sharded_over (FSDP devices, 1 under DDP), settings (the memory
             settings the figure is for: `auto` at its most frugal)}, throughput{source: pilot|given|mfu, ...},
  checkpoint{save_seconds, every_minutes, every_steps, restart_seconds, saves_on_measured_device},
  timeline{attempt[{name, seconds, source}], attempt_seconds, restart[...], restart_seconds,
           fixed_sd_seconds, interval}, constraints{...},
  options[{gpu, gpus, pricing, price_per_gpu_hour, fits, tokens_per_s, throughput_basis,
           compute_hours/wall_hours/gpu_hours/cost{low, expected, high}, startup_hours,
           checkpoint_hours, eval_hours, interruptions, restart_hours, recommended_checkpoint_minutes,
           saves, fixed_spread_hours, fsdp_gpus (where it does not fit: the fewest such GPUs under FSDP),
           mtbi_hours (spot: the mean time between interruptions priced), setting{setting, gib, fits} (what the
           recipe's `auto` memory settings choose on that GPU) | null, fit_changes[{change, gib, fits, gpus?}]
           (where it does not fit: what would, smallest first; trainer/plan/changes.py) | null}],
  recommendation{index, gpu, pricing, wall_hours, cost, why, next_cheaper (what the option just cheaper
  lacks, or null)} | null, cheapest{on-demand, spot: {gpu, gpus, price_per_gpu_hour, wall_hours, cost,
  setting} | null}, assumptions[str] (the spot interruption rates among them).
Without data (trainer/plan/fit.py): data{source: none, problem}, options one per GPU {gpu, gpus, memory_gib,
fits, fsdp_gpus, on_demand_price, spot_price, mtbi_hours, tokens_per_s, throughput_basis,
per_million_tokens{on-demand, spot}, setting, fit_changes}, throughput, cheapest{on-demand, spot: {gpu, gpus,
price_per_gpu_hour, per_million_tokens, setting} | null}, needs.
Throughput is in real (non-padding) tokens per second, the unit of the training metrics.

The interval: on the device the pilot ran on, high is the expected wall time + two standard
deviations of what the pilot measured, low the time at a rate that much faster (expected / (1 + r),
never 0): its step-time spread taken whole (a machine's
speed drifts slowly, so it does not average out over a run; throughput.measured_sd), the
spread of its processes' mean step times and of their fixed costs, and the same relative
step-time spread on the fixed costs. Elsewhere the throughput's range (an assumed MFU's
+/-30%, or the pilot's p10/p90 carried by peak FLOP/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainer import catalog as cat
from trainer.config import CheckpointConfig, batch_split, runs_reference
from trainer.data.sampler import run_steps
from trainer.model import flops
from trainer.plan import PlanError, changes, lacks
from trainer.plan import forecast as fc
from trainer.plan import memory as mem
from trainer.plan import timeline as tl
from trainer.plan import workload as wl
from trainer.plan.job import Constraints, Job, Measured, Totals
from trainer.plan.throughput import GIVEN_SPREAD, MFU_SPREAD, Rate, Throughput, machine_cv, measured_sd, rate_on

SCHEMA = "spotune.estimate/1"
MULTI_GPU_EFFICIENCY = 0.9  # data-parallel scaling from the measured device count to more GPUs
INTERVAL_SIGMAS = 2.0  # the printed range: expected -/+ 2 standard deviations (about 95%)
EVAL_COST_SHARE = 1.0 / 3.0  # an eval token is a forward pass only: ~1/3 of a training token


def estimate(
    job: Job,
    work: wl.Workload,
    rate: Throughput,
    catalog: list[cat.GPU],
    constraints: Constraints | None = None,
    measured: Measured | None = None,
    target: tl.Target | None = None,
    how: changes.How | None = None,
) -> dict[str, Any]:
    """The whole estimate as plain data (schema `spotune.estimate/1`); `how`: what the recipe's `auto`
    memory settings choose on a GPU of a given size (trainer/plan/changes.py)."""
    constraints = constraints or Constraints()
    if constraints.gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {constraints.gpus}")
    try:
        gpus = [cat.find_gpu(constraints.gpu, catalog)] if constraints.gpu is not None else catalog
    except cat.CatalogError as e:
        raise PlanError(str(e)) from None
    measured = measured or Measured()
    target = target or tl.Target()
    totals = _totals(job, work, constraints.gpus)
    memory = job.memory(constraints.gpus)
    save_s = measured.get("save_seconds")
    save_s = float(save_s) if save_s is not None else _default_save_seconds(job)
    attempt = tl.attempt_items(measured.pilot, target)
    restart = tl.restart_items(measured.pilot, target, measured.get("checkpoint_bytes") or _adapter_bytes(job))
    # The fixed costs vary with the machine's speed too (imports and loading are CPU and disk
    # work), besides what the pilot's processes measured between them.
    sd_s = math.hypot(measured.fixed_sd, machine_cv(measured.get("step_time_s")) * tl.total(attempt))
    fixed = Fixed(tl.total(attempt), tl.total(restart), sd_s, save_s)
    options, rows = _options(job, work, totals, rate, gpus, catalog, constraints, memory.total, fixed, measured)
    changes.annotate(rows, job, constraints.gpus, how)
    return {
        "schema": SCHEMA,
        **_described(job, work, totals, constraints),
        "memory_gib": memory.as_gib()
        | {
            "pilot_measured_peak": measured.get("peak_memory_gib"),
            "sharded_over": constraints.gpus if job.fsdp else 1,
            "settings": memory_settings(job),
        },
        "throughput": rate.as_dict() | {"flops_per_token": totals.flops_per_token},
        "checkpoint": {
            "save_seconds": save_s,
            "every_minutes": job.checkpoint.every_minutes,
            "every_steps": job.checkpoint.every_steps,
            "restart_seconds": fixed.restart_s,
        },
        "timeline": {
            "attempt": tl.as_dicts(attempt),
            "attempt_seconds": fixed.attempt_s,
            "restart": tl.as_dicts(restart),
            "restart_seconds": fixed.restart_s,
            "fixed_sd_seconds": fixed.sd_s,
            "interval": f"expected -/+ {INTERVAL_SIGMAS:g} standard deviations of the pilot's measured variation"
            if rate.source == "pilot"
            else "the throughput's assumed range",
        },
        "constraints": {"deadline_hours": constraints.deadline_hours, "budget": constraints.budget},
        "options": rows,
        "recommendation": _recommendation(options, rows, constraints, memory.total / mem.GIB, job),
        "cheapest": changes.cheapest(rows),
        "assumptions": _assumptions(rate, work, constraints.gpus, {r["throughput_basis"] for r in rows})
        + [spot_rates(gpus)],
    }


def memory_settings(job: Job) -> str:
    """The memory settings the `memory_gib` figure is for: `auto` counted at its most frugal (`Job.memory`)."""
    m, t = job.model, job.train
    micro = t.micro_batch_size if isinstance(t.micro_batch_size, int) else "1 (auto)"
    ckpt = str(m.gradient_checkpointing).lower() if isinstance(m.gradient_checkpointing, bool) else "true (auto)"
    offload = {"auto": "on (auto)"}.get(m.activation_offload, m.activation_offload)
    return f"micro_batch_size={micro}, gradient_checkpointing={ckpt}, activation_offload={offload}"


def model_facts(job: Job) -> dict[str, Any]:
    """The estimate's `model` section (without data, `spotune estimate` gives it too: plan/fit.py)."""
    return {
        "name_or_path": job.name_or_path,
        "arch": job.shape.arch,
        "hf_model_type": job.hf_model_type,
        "params": job.shape.total_params(),
        "trainable_params": job.lora_params,
        "weight_format": job.weight_format,
        "shardable": job.shardable,
    }


def _described(job: Job, work: wl.Workload, totals: Totals, constraints: Constraints) -> dict[str, Any]:
    """The estimate's model, data and run sections: what is being forecast."""
    return {
        "model": model_facts(job) | {"flops_per_token": totals.flops_per_token},
        "data": {
            "source": work.source,
            "exact": work.exact,
            "rows_per_epoch": work.rows,
            "real_tokens_per_epoch": work.real_tokens,
            "trainable_tokens_per_epoch": work.trainable_tokens,
            "examples": work.examples,
            "sampled_examples": work.sampled_examples,
            "manifest": work.manifest_path,
            "truncation": work.truncation,
        },
        "run": {
            "steps": totals.steps,
            "gpus": constraints.gpus,
            "global_batch_rows": totals.global_rows,
            "seq_len": job.seq_len,
            "epochs": totals.steps * totals.global_rows / work.rows if work.rows else None,
            # Packing puts a varying number of pairs in a row: the mean a step of these rows trains on.
            "pairs_per_step": totals.global_rows * work.pairs / work.rows if work.pairs and work.rows else None,
            # KTO's units are single answers, each with its thumbs-up or down, not pairs.
            "pairs_are": "answers" if job.train.objective == "kto" else "pairs",
            "real_tokens": totals.tokens,
            "trainable_tokens": totals.trainable,
            "train_flops": totals.train_flops,
        },
    }


def _recommendation(
    options: list[Any], rows: list[dict[str, Any]], constraints: Constraints, needs_gib: float, job: Job
) -> dict[str, Any] | None:
    """The cheapest fitting option within the deadline (or the fastest within the budget), or None;
    with what the option just cheaper than it lacks."""
    fitting = [o for o, r in zip(options, rows, strict=True) if r["fits"] and not math.isnan(o.price_per_gpu_hour)]
    best = fc.cheapest(fitting, constraints.deadline_hours, constraints.budget)
    if best is None:
        return None
    return {
        "index": options.index(best),
        "gpu": best.gpu,
        "pricing": best.pricing,
        "wall_hours": best.wall_hours.expected,
        "cost": best.cost.expected,
        "why": _why(constraints.deadline_hours, constraints.budget),
        "next_cheaper": lacks.next_cheaper(
            rows, options.index(best), needs_gib, lacks.frugal_gib(job, constraints.gpus), constraints.deadline_hours
        ),
    }


# ---------------------------------------------------------------------------- the three parts


def _totals(job: Job, work: wl.Workload, gpus: int) -> Totals:
    fixed = job.train.global_batch_size
    # An `auto` micro-batch is chosen by the run on its GPU; the rows per step are the recipe's.
    global_rows = fixed if job.train.micro_batch_size == "auto" and fixed else batch_split(job.train, gpus).global_rows
    steps = run_steps(int(work.rows), global_rows, job.train.max_steps, job.train.epochs)
    rows_done = steps * global_rows
    tokens = rows_done * work.real_tokens_per_row
    trainable = rows_done * (work.trainable_tokens / work.rows if work.rows else 0.0)
    doc_sq = work.doc_len_sq_sum * rows_done / work.rows if work.rows else 0.0
    # The loop computes logits only where a label is (as the training meter counts them), so
    # the output head costs trainable tokens, not every real one.
    run_flops = flops.train_flops(
        job.shape, tokens, doc_sq, job.shape.matmul_params(), job.lora_params, head_tokens=trainable
    )
    if runs_reference(job.train.objective):  # DPO: the reference's forward over the same tokens
        run_flops += flops.reference_forward_flops(job.shape, tokens, doc_sq, trainable)
    return Totals(steps, global_rows, tokens, trainable, doc_sq, run_flops)


def flops_per_token(job: Job, gpus: int) -> float:
    """Training FLOPs per real token of this run's model and settings when its data is not at hand: rows packed
    full at `seq_len`, one document per row (workload.from_tokens), which bounds the attention's share from above."""
    return _totals(job, wl.from_tokens(float(job.seq_len) * 1024, job.seq_len), gpus).flops_per_token


def _options(
    job: Job,
    work: wl.Workload,
    totals: Totals,
    rate: Throughput,
    gpus: list[cat.GPU],
    catalog: list[cat.GPU],
    constraints: Constraints,
    memory_bytes: float,
    fixed: Fixed,
    measured: Measured,
) -> tuple[list[fc.Option], list[dict[str, Any]]]:
    """One option per GPU and pricing (on-demand, spot where offered), with its table row."""
    options: list[fc.Option] = []
    rows: list[dict[str, Any]] = []
    measured_elsewhere = rate.device is not None and cat.match_device(rate.device, catalog) is None
    targets: list[tuple[str, cat.GPU | None]] = [(g.name, g) for g in gpus]
    if measured_elsewhere and constraints.gpu is None:
        assert rate.device is not None
        targets.insert(0, (rate.device, None))  # the machine the pilot ran on (e.g. this CPU)
    n = constraints.gpus
    for name, g in targets:
        on = rate_on(rate, g, catalog, totals.flops_per_token)
        speed = on.tokens_per_s_per_gpu * n * (MULTI_GPU_EFFICIENCY if n > rate.measured_gpus else 1.0)
        compute = _compute_hours(totals.tokens, speed, on, measured, pilot_gpus=n == rate.measured_gpus)
        step_hours = compute.expected / totals.steps
        interval = _interval_hours(job.checkpoint, step_hours)
        eval_each = measured.get("eval_seconds") if on.basis == "measured" else None
        eval_h = _eval_hours(job.train.eval_every, work, totals.steps, speed, eval_each)
        saves = tl.save_count(
            totals.steps, job.checkpoint.every_steps, job.checkpoint.every_minutes, step_hours * 3600.0
        )
        fits = g is None or memory_bytes <= g.memory_gib * mem.GIB
        fsdp_devices = job.fsdp_devices(g.memory_gib) if g is not None and not fits else None
        mtbi = g.mtbi_hours if g is not None else None
        recommended = fc.young_daly_interval_hours(fixed.save_s, mtbi) if mtbi else None
        prices: list[tuple[fc.Pricing, float | None]] = [
            ("on-demand", g.on_demand_price if g is not None else job.price_per_hour),
            ("spot", g.spot_price if g is not None else None),
        ]
        for pricing, price in prices:
            if price is None:
                if pricing == "spot":
                    continue
                price = float("nan")  # unknown price: hours still shown, cost null
            o = fc.plan_option(
                gpu=name,
                gpus=n,
                pricing=pricing,
                price_per_gpu_hour=price,
                compute_hours=compute,
                eval_hours=eval_h,
                save_seconds=fixed.save_s,
                saves=saves,
                checkpoint_interval_hours=interval,
                startup_hours=fixed.attempt_s / 3600.0,
                mtbi_hours=mtbi,
                restart_hours=fixed.restart_s / 3600.0,
                fixed_spread_hours=INTERVAL_SIGMAS * fixed.sd_s / 3600.0,
            )
            options.append(o)
            row = _clean(o.as_dict())
            row.update(
                fits=fits,
                memory_gib=g.memory_gib if g else None,
                throughput_basis=on.basis,
                tokens_per_s=speed,
                saves=saves,
                fsdp_gpus=fsdp_devices,
                mtbi_hours=mtbi if pricing == "spot" else None,
                recommended_checkpoint_minutes=recommended * 60 if recommended else None,
            )
            rows.append(row)
    return options, rows


def _compute_hours(tokens: float, speed: float, on: Rate, measured: Measured, pilot_gpus: bool) -> fc.Range:
    """Hours of training compute: the pilot's measured spread where it ran (same device and GPU
    count), else the throughput's assumed range."""
    expected = fc.hours_for(tokens, speed)
    step = measured.get("step_time_s")
    if on.basis == "measured" and step and step.get("sd") is not None and pilot_gpus:
        # Where the pilot ran: the spread it measured. A time is work over a rate, so the fast end is
        # the rate that much faster (expected / (1 + r)): never 0, however wide a busy machine's spread.
        rel = INTERVAL_SIGMAS * measured_sd(step)
        return fc.Range(expected / (1.0 + rel), expected, expected * (1.0 + rel))
    return fc.Range(fc.hours_for(tokens, speed * on.fast), expected, fc.hours_for(tokens, speed * on.slow))


@dataclass(frozen=True)
class Fixed:
    """Seconds that do not scale with the run: one process's fixed costs, one restart's, their spread, a save."""

    attempt_s: float
    restart_s: float
    sd_s: float
    save_s: float


# ---------------------------------------------------------------------------- pieces


def _default_save_seconds(job: Job) -> float:
    """The checkpoint's bytes written at ~200 MB/s plus 2 s of fsync and bookkeeping."""
    return 2.0 + _adapter_bytes(job) / 200e6


def _interval_hours(c: CheckpointConfig, step_hours: float) -> float | None:
    by_steps = c.every_steps * step_hours if c.every_steps else None
    by_time = c.every_minutes / 60.0 if c.every_minutes else None
    candidates = [h for h in (by_steps, by_time) if h]
    return min(candidates) if candidates else None


def _eval_hours(
    eval_every: int | None, work: wl.Workload, steps: int, speed: float, measured_seconds: float | None
) -> float:
    """One evaluation every `eval_every` steps: as the pilot timed one, else by its token count."""
    if not eval_every or not work.eval_real_tokens:
        return 0.0
    each = (
        measured_seconds / 3600.0 if measured_seconds else fc.hours_for(work.eval_real_tokens * EVAL_COST_SHARE, speed)
    )
    return (steps // eval_every) * each


def _adapter_bytes(job: Job) -> float:
    """A checkpoint without a pilot to weigh one: fp32 adapter + AdamW's two moments."""
    return 12.0 * job.lora_params


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    """NaN (unknown price) becomes null in the JSON document."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _clean(v)
        elif isinstance(v, float) and math.isnan(v):
            out[k] = None
        else:
            out[k] = v
    return out


def spot_rates(gpus: list[cat.GPU]) -> str:
    """The interruption rate behind every spot figure, per GPU, and how to set yours."""
    rates = ", ".join(f"{g.name} {g.mtbi_hours:g} h" for g in gpus if g.spot_price is not None and g.mtbi_hours)
    return (
        f"spot interruptions: one every (mean time between interruptions) {rates or 'none given'}; "
        "typical figures that vary by provider, region and month: --mtbi-hours H (every GPU) or GPU=H, "
        "or mtbi_hours in a --catalog YAML, for yours"
    )


def _why(deadline: float | None, budget: float | None) -> str:
    if deadline is not None and budget is not None:
        return f"cheapest option finishing within {deadline:g} h and costing at most {budget:g}"
    if deadline is not None:
        return f"cheapest option finishing within {deadline:g} h"
    if budget is not None:
        return f"fastest option costing at most {budget:g}"
    return "cheapest option that fits in memory"


def _assumptions(rate: Throughput, work: wl.Workload, gpus: int, bases: set[str]) -> list[str]:
    out = []
    if rate.source == "mfu":
        out.append(
            f"throughput assumed from peak bf16 FLOP/s x MFU {rate.mfu:.2f} (+/-{MFU_SPREAD:.0%}; --mfu to change "
            "it), typical of LoRA on one modern GPU; run `spotune pilot` to measure it"
        )
    elif rate.source == "given":
        out.append(f"throughput given: {rate.tokens_per_s_per_gpu:.0f} real tokens/s per GPU (+/-{GIVEN_SPREAD:.0%})")
    else:
        out.append(
            f"throughput measured by a pilot on {rate.device}; the range there comes from its measured variation "
            "(step times within and between its processes, fixed costs); carried to other GPUs with its p10/p90"
        )
    if any(b.startswith("scaled") for b in bases):
        out.append("other GPUs scaled by peak bf16 FLOP/s (same MFU as measured)")
    if rate.source != "mfu" and any(b.startswith("assumed") for b in bases):
        out.append(
            f"catalogue GPUs: peak bf16 FLOP/s x assumed MFU {rate.assumed_mfu:.2f} (+/-{MFU_SPREAD:.0%}); "
            "the measurement was not on a catalogue GPU"
        )
    if gpus > rate.measured_gpus:
        out.append(f"{MULTI_GPU_EFFICIENCY:.0%} data-parallel scaling efficiency beyond {rate.measured_gpus} GPU(s)")
    if work.source == "given":
        out.append(
            f"token count given (--tokens {work.real_tokens:.0f}): rows packed full, every token trained, one "
            "document per row (attention FLOPs an upper bound); give data.path for counts from the data"
        )
    elif not work.exact:
        out.append(f"token counts extrapolated from {work.sampled_examples} sampled examples (data not prepared yet)")
    if rate.source != "pilot":
        out.append("checkpoint save, start-up and teardown are assumed; `spotune pilot` measures them")
    elif rate.device is not None:
        out.append(f"fixed costs (timeline) measured on {rate.device}; on other GPUs they are taken as the same")
    out.append("spot: each interruption costs a restart (timeline) plus half a checkpoint interval of redone work")
    return out
