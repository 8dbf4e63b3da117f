"""`spotune estimate`: memory fit, GPU-hours and cost per catalogue GPU, on demand against spot.

The pieces: workload.py counts the tokens, flops.py the FLOPs per token, memory.py the
bytes per GPU, forecast.py the hours and money. This module picks the throughput
(measured by a pilot, given, or assumed from peak FLOP/s x MFU), assembles one option per
GPU and pricing, and renders the result as a table or a stable JSON document.

`--json` schema `spotune.estimate/1` (tests/test_plan_estimate.py pins the keys):
  model{name_or_path, arch, params, trainable_params, weight_format, flops_per_token},
  data{source: manifest|sample, exact, rows_per_epoch, real_tokens_per_epoch, ...},
  run{steps, gpus, global_batch_rows, seq_len, epochs, real_tokens, trainable_tokens, train_flops},
  memory_gib{weights, adapter, gradients, optimizer, activations, logits, backward_workspace,
             overhead, total, pilot_measured_peak}, throughput{source: pilot|given|mfu, ...},
  checkpoint{save_seconds, every_minutes, every_steps, restart_seconds}, constraints{...},
  options[{gpu, gpus, pricing, price_per_gpu_hour, fits, tokens_per_s, throughput_basis,
           compute_hours/wall_hours/gpu_hours/cost{low, expected, high}, startup_hours,
           checkpoint_hours, eval_hours, interruptions, restart_hours, recommended_checkpoint_minutes, ...}],
  recommendation{index, gpu, pricing, wall_hours, cost, why} | null, assumptions[str].
Throughput is in real (non-padding) tokens per second, the unit of the training metrics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trainer import flops
from trainer.config import BUILTIN_TINY_DATA, BUILTIN_TINY_MODEL, RunConfig
from trainer.plan import PlanError
from trainer.plan import catalog as cat
from trainer.plan import forecast as fc
from trainer.plan import memory as mem
from trainer.plan import workload as wl

SCHEMA = "spotune.estimate/1"
DEFAULT_MFU = {"lora": 0.35, "qlora": 0.25}
"""Assumed model-FLOPs utilisation without a measurement: typical of LoRA on one modern GPU
with packed sequences; 4-bit dequantisation costs QLoRA about a third more time."""
MFU_SPREAD = 0.3  # an assumed MFU is a guess: +/-30% on throughput
GIVEN_SPREAD = 0.1  # a throughput the user gives us: +/-10%
MULTI_GPU_EFFICIENCY = 0.9  # data-parallel scaling from the measured device count to more GPUs
DEFAULT_RESTART_S = 300.0  # process start, model load, resume, without a pilot to measure it
EVAL_COST_SHARE = 1.0 / 3.0  # an eval token is a forward pass only: ~1/3 of a training token


def run_estimate(
    cfg: RunConfig,
    *,
    throughput: float | None = None,
    pilot_json: Path | None = None,
    gpus: int = 1,
    deadline_hours: float | None = None,
    budget: float | None = None,
    catalog_path: Path | None = None,
    as_json: bool = False,
    gpu: str | None = None,
    mfu: float | None = None,
    manifest: dict[str, Any] | None = None,
    sample_size: int = 2000,
) -> dict[str, Any]:
    """The whole estimate as plain data (schema `spotune.estimate/1`; `as_json` is for the CLI)."""
    del as_json  # the same document backs the table and --json
    from trainer import tiny

    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    full_catalog = cat.load_catalog(catalog_path)
    gpus_list = [cat.find_gpu(gpu, full_catalog)] if gpu is not None else full_catalog
    shape, hf_name = _shape(cfg, tiny.resolve_model(cfg.model.name_or_path))
    a = cfg.adapter
    lora = flops.lora_params(shape, a.r, a.target_modules)
    work = _workload(cfg, manifest, sample_size)

    global_rows = cfg.train.micro_batch_size * cfg.train.grad_accum * gpus
    steps = wl.steps_for(work.rows, global_rows, cfg.train.max_steps, cfg.train.epochs)
    rows_done = steps * global_rows
    tokens = rows_done * work.real_tokens_per_row
    trainable = rows_done * (work.trainable_tokens / work.rows if work.rows else 0.0)
    doc_sq = work.doc_len_sq_sum * rows_done / work.rows if work.rows else 0.0
    # The loop computes logits only where a label is (as the training meter counts them), so
    # the output head costs trainable tokens, not every real one.
    run_flops = flops.train_flops(shape, tokens, doc_sq, shape.matmul_params(), lora, head_tokens=trainable)
    flops_per_token = run_flops / tokens if tokens else 0.0

    memory = mem.estimate_memory(
        shape,
        weight_format=_weight_format(cfg),
        compute_dtype=cfg.model.dtype,
        lora_params=lora,
        lora_r=a.r,
        target_modules=a.target_modules,
        lora_dropout=a.dropout > 0,
        optimizer=cfg.train.optimizer,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_len=cfg.data.seq_len,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        eager_attention=cfg.model.attn_implementation == "eager",
    )
    pilot = json.loads(Path(pilot_json).read_text()) if pilot_json else None
    rate = _throughput(cfg, pilot, throughput, mfu, flops_per_token)
    save_s = (
        float(pilot["save_seconds"]) if pilot and pilot.get("save_seconds") is not None else _default_save_seconds(lora)
    )
    # Fixed per-attempt time: startup, the slower warm-up steps and teardown (writing final/).
    startup_s = (
        sum(float(pilot.get(k) or 0.0) for k in ("startup_seconds", "warmup_extra_seconds", "teardown_seconds"))
        if pilot
        else DEFAULT_RESTART_S
    )

    options: list[fc.Option] = []
    rows: list[dict[str, Any]] = []
    measured_elsewhere = rate["device"] is not None and cat.match_device(rate["device"], full_catalog) is None
    targets: list[tuple[str, cat.GPU | None]] = [(g.name, g) for g in gpus_list]
    if measured_elsewhere and gpu is None:
        targets.insert(0, (rate["device"], None))  # the machine the pilot ran on (e.g. this CPU)
    for name, g in targets:
        per_gpu, slow, fast, basis = _rate_on(rate, g, full_catalog)
        speed = per_gpu * gpus * (MULTI_GPU_EFFICIENCY if gpus > rate["measured_gpus"] else 1.0)
        compute = fc.Range(
            fc.hours_for(tokens, speed * fast), fc.hours_for(tokens, speed), fc.hours_for(tokens, speed * slow)
        )
        step_hours = compute.expected / steps
        interval = _interval_hours(cfg, step_hours)
        eval_h = _eval_hours(cfg, work, steps, speed)
        fits = g is None or memory.total <= g.memory_gib * mem.GIB
        mtbi = g.mtbi_hours if g is not None else None
        recommended = fc.young_daly_interval_hours(save_s, mtbi) if mtbi else None
        prices: list[tuple[fc.Pricing, float | None]] = [
            ("on-demand", g.on_demand_price if g is not None else cfg.metrics.price_per_hour),
            ("spot", g.spot_price if g is not None else None),
        ]
        for pricing, price in prices:
            if price is None:
                if pricing == "spot":
                    continue
                price = float("nan")  # unknown price: hours still shown, cost null
            o = fc.plan_option(
                gpu=name,
                gpus=gpus,
                pricing=pricing,
                price_per_gpu_hour=price,
                compute_hours=compute,
                eval_hours=eval_h,
                save_seconds=save_s,
                checkpoint_interval_hours=interval,
                startup_hours=startup_s / 3600.0,
                mtbi_hours=mtbi,
                restart_hours=startup_s / 3600.0,
            )
            options.append(o)
            row = _clean(o.as_dict())
            row.update(
                fits=fits,
                memory_gib=g.memory_gib if g else None,
                throughput_basis=basis,
                tokens_per_s=speed,
                recommended_checkpoint_minutes=recommended * 60 if recommended else None,
            )
            rows.append(row)

    fitting = [o for o, r in zip(options, rows, strict=False) if r["fits"] and not math.isnan(o.price_per_gpu_hour)]
    best = fc.cheapest(fitting, deadline_hours, budget)
    recommendation = None
    if best is not None:
        recommendation = {
            "index": options.index(best),
            "gpu": best.gpu,
            "pricing": best.pricing,
            "wall_hours": best.wall_hours.expected,
            "cost": best.cost.expected,
            "why": _why(deadline_hours, budget),
        }
    return {
        "schema": SCHEMA,
        "model": {
            "name_or_path": cfg.model.name_or_path,
            "arch": shape.arch,
            "hf_model_type": hf_name,
            "params": shape.total_params(),
            "trainable_params": lora,
            "weight_format": _weight_format(cfg),
            "flops_per_token": flops_per_token,
        },
        "data": {
            "source": work.source,
            "exact": work.exact,
            "rows_per_epoch": work.rows,
            "real_tokens_per_epoch": work.real_tokens,
            "trainable_tokens_per_epoch": work.trainable_tokens,
            "examples": work.examples,
            "sampled_examples": work.sampled_examples,
            "manifest": work.manifest_path,
        },
        "run": {
            "steps": steps,
            "gpus": gpus,
            "global_batch_rows": global_rows,
            "seq_len": cfg.data.seq_len,
            "epochs": steps * global_rows / work.rows if work.rows else None,
            "real_tokens": tokens,
            "trainable_tokens": trainable,
            "train_flops": run_flops,
        },
        "memory_gib": memory.as_gib() | {"pilot_measured_peak": pilot.get("peak_memory_gib") if pilot else None},
        "throughput": {k: v for k, v in rate.items() if k not in ("low_factor", "high_factor")}
        | {"range_factors": [rate["low_factor"], rate["high_factor"]]},
        "checkpoint": {
            "save_seconds": save_s,
            "every_minutes": cfg.checkpoint.every_minutes,
            "every_steps": cfg.checkpoint.every_steps,
            "restart_seconds": startup_s,
        },
        "constraints": {"deadline_hours": deadline_hours, "budget": budget},
        "options": rows,
        "recommendation": recommendation,
        "assumptions": _assumptions(rate, work, gpus, pilot is not None, {r["throughput_basis"] for r in rows}),
    }


# ---------------------------------------------------------------------------- inputs


def _shape(cfg: RunConfig, path: str) -> tuple[flops.ModelShape, str]:
    from trainer.plan.models import load_config

    hf = load_config(path, revision=cfg.model.revision, trust_remote_code=cfg.model.trust_remote_code)
    text = hf.get_text_config()  # a vision-language model (Gemma 3 4B+) is planned for its language model
    return flops.model_shape(text), str(getattr(hf, "model_type", ""))


def _workload(cfg: RunConfig, manifest: dict[str, Any] | None, sample_size: int) -> wl.Workload:
    from trainer import tiny

    if manifest is not None:
        return wl.from_manifest(manifest)
    data_path = tiny.resolve_data(cfg.data.path)
    found = wl.find_manifest(cfg.data, data_path, wl.cache_root_for(cfg.data, cfg.output_dir))
    if found is not None:
        return wl.from_manifest(*found)
    tok = cfg.data.tokenizer or tiny.resolve_model(cfg.model.name_or_path)
    if cfg.data.tokenizer is None and cfg.data.path == BUILTIN_TINY_DATA and not Path(tok).exists():
        # `spotune estimate <hub id>` plans on the built-in demo data: count it with the demo
        # tokenizer it was made with, so planning needs no tokenizer download either.
        tok = tiny.resolve_model(BUILTIN_TINY_MODEL)
    return wl.from_sample(cfg.data, data_path, tok, sample_size=sample_size, seed=cfg.seed)


def _weight_format(cfg: RunConfig) -> mem.WeightFormat:
    if cfg.adapter.method == "qlora":
        return "nf4" if cfg.adapter.quant_bits == 4 else "int8"
    return cfg.model.dtype  # type: ignore[return-value]


def _throughput(
    cfg: RunConfig, pilot: dict[str, Any] | None, given: float | None, mfu: float | None, flops_per_token: float
) -> dict[str, Any]:
    """Real tokens/s per GPU and where it came from; low/high factors scale the rate."""
    assumed = mfu if mfu is not None else DEFAULT_MFU[cfg.adapter.method]
    if not 0 < assumed <= 1:
        raise PlanError(f"--mfu must be within (0, 1], got {assumed}")
    common = {"flops_per_token": flops_per_token, "assumed_mfu": assumed}
    if pilot is not None:
        world = int(pilot.get("world_size", 1))
        # The sustained rate goes with the mean step time; p10/p90 steps bound the range
        # (at least +/-5%: a short pilot on a quiet machine understates the spread).
        mean, p10, p90 = (pilot["step_time_s"][k] for k in ("mean", "p10", "p90"))
        return {
            "source": "pilot",
            "tokens_per_s_per_gpu": pilot["sustained_tokens_per_s"] / world,
            "device": pilot.get("device"),
            "measured_gpus": world,
            "mfu": pilot.get("sustained_mfu"),
            "low_factor": min(mean / p90, 0.95) if p90 else 0.95,
            "high_factor": max(mean / p10, 1.05) if p10 else 1.05,
        } | common
    if given is not None:
        if given <= 0:
            raise PlanError(f"--throughput must be above 0 tokens/s, got {given}")
        ref = cfg.metrics.gpu
        return {
            "source": "given",
            "tokens_per_s_per_gpu": given,
            "device": ref,
            "measured_gpus": 1,
            "mfu": None,
            "low_factor": 1 - GIVEN_SPREAD,
            "high_factor": 1 + GIVEN_SPREAD,
        } | common
    return {
        "source": "mfu",
        "tokens_per_s_per_gpu": None,
        "device": None,
        "measured_gpus": 1,
        "mfu": assumed,
        "low_factor": 1 - MFU_SPREAD,
        "high_factor": 1 + MFU_SPREAD,
    } | common


def _rate_on(rate: dict[str, Any], g: cat.GPU | None, catalog: list[cat.GPU]) -> tuple[float, float, float, str]:
    """(tokens/s per GPU, slow factor, fast factor, basis) on `g`; None means the measured device."""
    measured = (rate["tokens_per_s_per_gpu"], rate["low_factor"], rate["high_factor"])
    if g is None:
        return (*measured, "measured")
    ref = cat.match_device(rate["device"], catalog) if rate["device"] else None
    if rate["source"] != "mfu" and ref is not None:
        # Same MFU on a faster or slower GPU: scale by peak FLOP/s.
        basis = "measured" if ref.name == g.name else f"scaled from {ref.name}"
        return (measured[0] * g.peak_bf16_flops / ref.peak_bf16_flops, measured[1], measured[2], basis)
    if rate["source"] == "given" and rate["device"] is None:
        return (*measured, "given")  # no device named: the given rate is taken for every GPU
    # Nothing measured on a catalogue GPU (an MFU estimate, or a pilot on CPU): peak x MFU.
    if not rate["flops_per_token"]:
        raise PlanError("cannot derive a throughput: the run has no tokens")
    per_gpu = g.peak_bf16_flops * rate["assumed_mfu"] / rate["flops_per_token"]
    return (per_gpu, 1 - MFU_SPREAD, 1 + MFU_SPREAD, f"assumed MFU {rate['assumed_mfu']:.2f}")


def _default_save_seconds(lora_params: int) -> float:
    """Adapter (fp32) + AdamW state written at ~200 MB/s plus 2 s of fsync and bookkeeping."""
    return 2.0 + 12.0 * lora_params / 200e6


def _interval_hours(cfg: RunConfig, step_hours: float) -> float | None:
    c = cfg.checkpoint
    candidates = [
        h
        for h in (
            c.every_steps * step_hours if c.every_steps else None,
            c.every_minutes / 60.0 if c.every_minutes else None,
        )
        if h
    ]
    return min(candidates) if candidates else None


def _eval_hours(cfg: RunConfig, work: wl.Workload, steps: int, speed: float) -> float:
    if not cfg.train.eval_every or not work.eval_real_tokens:
        return 0.0
    evals = steps // cfg.train.eval_every
    return evals * fc.hours_for(work.eval_real_tokens * EVAL_COST_SHARE, speed)


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


def _why(deadline: float | None, budget: float | None) -> str:
    if deadline is not None and budget is not None:
        return f"cheapest option finishing within {deadline:g} h and costing at most {budget:g}"
    if deadline is not None:
        return f"cheapest option finishing within {deadline:g} h"
    if budget is not None:
        return f"fastest option costing at most {budget:g}"
    return "cheapest option that fits in memory"


def _assumptions(rate: dict[str, Any], work: wl.Workload, gpus: int, piloted: bool, bases: set[str]) -> list[str]:
    out = []
    if rate["source"] == "mfu":
        out.append(
            f"throughput assumed from peak bf16 FLOP/s x MFU {rate['mfu']:.2f} (+/-{MFU_SPREAD:.0%}); "
            "run `spotune pilot` to measure it"
        )
    elif rate["source"] == "given":
        out.append(
            f"throughput given: {rate['tokens_per_s_per_gpu']:.0f} real tokens/s per GPU (+/-{GIVEN_SPREAD:.0%})"
        )
    else:
        out.append(f"throughput measured by a pilot on {rate['device']}; range from its p10/p90 step times")
    if any(b.startswith("scaled") for b in bases):
        out.append("other GPUs scaled by peak bf16 FLOP/s (same MFU as measured)")
    if rate["source"] != "mfu" and any(b.startswith("assumed") for b in bases):
        out.append(
            f"catalogue GPUs: peak bf16 FLOP/s x assumed MFU {rate['assumed_mfu']:.2f} (+/-{MFU_SPREAD:.0%}); "
            "the measurement was not on a catalogue GPU"
        )
    if gpus > rate["measured_gpus"]:
        out.append(f"{MULTI_GPU_EFFICIENCY:.0%} data-parallel scaling efficiency beyond {rate['measured_gpus']} GPU(s)")
    if not work.exact:
        out.append(f"token counts extrapolated from {work.sampled_examples} sampled examples (data not prepared yet)")
    if not piloted:
        out.append(
            f"checkpoint save and startup/restart times are defaults ({DEFAULT_RESTART_S:.0f} s restart); "
            "a pilot measures them"
        )
    out.append("spot: each interruption costs a restart plus half a checkpoint interval of redone work")
    return out


# ---------------------------------------------------------------------------- output


def format_estimate(result: dict[str, Any]) -> str:
    """The readable report: workload, memory, throughput, then one line per GPU and pricing."""
    m, d, r, t = result["model"], result["data"], result["run"], result["throughput"]
    mem_g = result["memory_gib"]
    exact = (
        "exact, from the prepared manifest" if d["exact"] else f"estimate from {d['sampled_examples']} sampled examples"
    )
    lines = [
        f"model   {m['name_or_path']} ({m['arch']}, {m['params'] / 1e6:,.1f}M params, {m['weight_format']}), "
        f"LoRA {m['trainable_params'] / 1e6:,.2f}M trainable, {_si(m['flops_per_token'])} FLOP/token",
        f"data    {d['rows_per_epoch']:,.0f} rows/epoch, {d['real_tokens_per_epoch']:,.0f} real tokens/epoch "
        f"({d['trainable_tokens_per_epoch']:,.0f} trainable) [{exact}]",
        f"run     {r['steps']:,} steps x {r['global_batch_rows']} rows x {r['seq_len']} = {r['real_tokens']:,.0f} real tokens "
        f"on {r['gpus']} GPU(s), {r['train_flops']:.3g} FLOPs",
        "memory  "
        + ", ".join(f"{k} {v:.3g}" for k, v in mem_g.items() if k not in ("total", "pilot_measured_peak"))
        + f" -> {mem_g['total']:.3g} GiB per GPU"
        + (f" (pilot measured {mem_g['pilot_measured_peak']:.3g} GiB)" if mem_g.get("pilot_measured_peak") else ""),
        f"checkpoint save {result['checkpoint']['save_seconds']:.2g} s, startup/restart {result['checkpoint']['restart_seconds']:.0f} s",
        "",
        f"{'GPU':<14}{'fit':<5}{'pricing':<10}{'$/GPU-h':>8}{'tok/s':>9}{'compute lo-exp-hi':>20}"
        f"{'+start':>8}{'+ckpt':>7}{'+eval':>7}{'+interr':>8}{'= wall':>8}{'GPU-h':>8}{'cost lo-exp-hi':>22}{'ckpt every':>11}",
    ]
    for i, o in enumerate(result["options"]):
        c, w = o["cost"], o["compute_hours"]
        cost = "-".join(f"{c[k]:,.2f}" for k in ("low", "expected", "high")) if c["expected"] is not None else "n/a"
        price = f"{o['price_per_gpu_hour']:.2f}" if o["price_per_gpu_hour"] is not None else "n/a"
        rec = o.get("recommended_checkpoint_minutes")
        star = " *" if result["recommendation"] and result["recommendation"]["index"] == i else ""
        lines.append(
            f"{o['gpu'][:13]:<14}{'yes' if o['fits'] else 'NO':<5}{o['pricing']:<10}{price:>8}{_si(o['tokens_per_s']):>9}"
            f"{'-'.join(_hours(w[k]) for k in ('low', 'expected', 'high')):>20}"
            f"{_hours(o['startup_hours']):>8}{_hours(o['checkpoint_hours']):>7}{_hours(o['eval_hours']):>7}"
            f"{_hours(o['restart_hours']):>8}{_hours(o['wall_hours']['expected']):>8}"
            f"{o['gpu_hours']['expected']:>8.2f}{cost:>22}{(f'{rec:.0f} min' if rec and o['pricing'] == 'spot' else ''):>11}{star}"
        )
    rec = result["recommendation"]
    lines.append("")
    if rec:
        lines.append(
            f"recommended: {rec['gpu']} {rec['pricing']}, ~{_hours(rec['wall_hours'])}, ~{rec['cost']:,.2f} ({rec['why']})"
        )
    elif result["constraints"]["deadline_hours"] is not None or result["constraints"]["budget"] is not None:
        lines.append("recommended: none meets the deadline/budget; relax one, add GPUs (--gpus) or shorten the run")
    lines.append(f"throughput: {t['source']}" + (f" on {t['device']}" if t.get("device") else ""))
    lines += [f"  - {a}" for a in result["assumptions"]]
    lines.append(
        "wall = compute + startup + checkpoint saves + evaluation + (spot) expected interruptions x "
        "(restart + half a checkpoint interval); GPU-h = wall x GPUs; cost = GPU-h x price"
    )
    return "\n".join(lines)


def _si(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.1f}{unit}"
    return f"{x:.0f}"


def _hours(h: float) -> str:
    if h == 0:
        return "0"
    if h < 1 / 60:
        return f"{h * 3600:.0f}s"
    return f"{h * 60:.0f}m" if h < 1 else f"{h:.1f}h"


def estimate_command(cfg: RunConfig, args: Any) -> int:
    """`spotune estimate`: print the table (or JSON); exit 0."""
    pilot = args.pilot
    if pilot is None:
        default = Path(cfg.output_dir) / "pilot" / "pilot.json"
        pilot = default if default.is_file() else None
    result = run_estimate(
        cfg,
        throughput=args.throughput,
        pilot_json=pilot,
        gpus=args.gpus,
        deadline_hours=args.deadline_hours,
        budget=args.budget,
        catalog_path=args.catalog,
        as_json=args.json,
        gpu=args.gpu,
        mfu=args.mfu,
    )
    print(json.dumps(result, indent=2) if args.json else format_estimate(result))
    return 0
