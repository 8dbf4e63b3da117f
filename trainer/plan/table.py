"""The readable `spotune estimate` report, rendered from the estimate document."""

from __future__ import annotations

from typing import Any


def format_estimate(result: dict[str, Any]) -> str:
    """The readable report: workload, memory, throughput, then one line per GPU and pricing."""
    if result["data"]["source"] == "none":
        return format_memory_fit(result)
    m, d, r, t = result["model"], result["data"], result["run"], result["throughput"]
    mem_g = result["memory_gib"]
    exact = {
        "manifest": "exact, from the prepared manifest",
        "given": "given with --tokens",
        "sample": f"estimate from {d['sampled_examples']} sampled examples",
    }[d["source"]]
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
        *_timeline(result),
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
    lines += _fsdp_hint(result)
    lines.append("")
    if rec:
        lines.append(
            f"recommended: {rec['gpu']} {rec['pricing']}, ~{_hours(rec['wall_hours'])}, ~{rec['cost']:,.2f} ({rec['why']})"
        )
        if rec.get("next_cheaper"):
            lines.append(f"  next cheaper: {rec['next_cheaper']}")
    elif result["constraints"]["deadline_hours"] is not None or result["constraints"]["budget"] is not None:
        lines.append("recommended: none meets the deadline/budget; relax one, add GPUs (--gpus) or shorten the run")
    lines.append(f"throughput: {t['source']}" + (f" on {t['device']}" if t.get("device") else ""))
    lines += [f"  - {a}" for a in result["assumptions"]]
    lines.append(
        "wall = compute + startup + checkpoint saves + evaluation + (spot) expected interruptions x "
        "(restart + half a checkpoint interval); GPU-h = wall x GPUs; cost = GPU-h x price"
    )
    return "\n".join(lines)


def format_memory_fit(result: dict[str, Any]) -> str:
    """The report of an estimate without data (trainer/plan/fit.py): memory per GPU, then what time and cost need."""
    m, mem_g = result["model"], result["memory_gib"]
    lines = [
        f"model   {m['name_or_path']} ({m['arch']}, {m['params'] / 1e6:,.1f}M params, {m['weight_format']}), "
        f"LoRA {m['trainable_params'] / 1e6:,.2f}M trainable",
        "memory  "
        + ", ".join(f"{k} {v:.3g}" for k, v in mem_g.items() if k not in ("total", "sharded_over"))
        + f" -> {mem_g['total']:.3g} GiB per GPU",
        "",
        f"{'GPU':<14}{'GiB':>6}  fit",
    ]
    for o in result["options"]:
        lines.append(f"{o['gpu'][:13]:<14}{o['memory_gib']:>6.0f}  {'yes' if o['fits'] else 'NO'}")
    lines += _fsdp_hint(result)
    lines += ["", f"data: {result['data']['problem']}", result["needs"]]
    return "\n".join(lines)


def _fsdp_hint(result: dict[str, Any]) -> list[str]:
    """Where the run does not fit: how many of each GPU hold it with the base sharded (FSDP)."""
    fits: dict[str, int | None] = {}
    for o in result["options"]:
        if not o["fits"] and o.get("memory_gib"):
            fits[o["gpu"]] = o.get("fsdp_gpus")
    if not fits:
        return []
    sharded = result["memory_gib"].get("sharded_over", 1) > 1
    where = ", ".join(f"{g} x{n}" if n else f"{g} (not within 64)" for g, n in fits.items())
    how = "with more of them (--gpus N)" if sharded else "with train.distributed=fsdp (--gpus N)"
    return ["", f"does not fit: per-device memory under FSDP fits {how} on: {where}"]


def _timeline(result: dict[str, Any]) -> list[str]:
    """Each fixed cost of a process and of a restart, with where its figure comes from."""
    tl, ck = result["timeline"], result["checkpoint"]
    where = result["throughput"].get("device") if result["throughput"]["source"] == "pilot" else None
    lines = [f"fixed costs per process{f' (measured on {where})' if where else ''}:"]
    lines += [f"  {i['name']:<48}{_secs(i['seconds']):>9}  {i['source']}" for i in tl["attempt"]]
    sd = f", sd {_secs(tl['fixed_sd_seconds'])} (pilot's processes, machine speed)" if tl["fixed_sd_seconds"] else ""
    lines.append(f"  {'= per process':<48}{_secs(tl['attempt_seconds']):>9}{sd}")
    lines.append(f"  + steps, evaluations and {_secs(ck['save_seconds'])} per checkpoint save (table below)")
    lines.append("each spot interruption costs:")
    lines += [f"  {i['name']:<48}{_secs(i['seconds']):>9}  {i['source']}" for i in tl["restart"]]
    lines.append(f"  {'= per restart, + half a checkpoint interval redone':<48}{_secs(tl['restart_seconds']):>9}")
    lines.append(f"range: {tl['interval']}")
    return lines


def _secs(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else f"{s:,.0f} s"


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
