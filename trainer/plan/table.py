"""The readable `spotune estimate` report, rendered from the estimate document."""

from __future__ import annotations

from typing import Any

from trainer.data.stats import truncation_lines

DATA_SOURCES = {
    "manifest": "exact, counted when the data was prepared",
    "given": "given with --tokens: rows packed full, every token trained",
    "sample": "extrapolated from {n:,} sampled rows (data not prepared yet)",
}
"""Where the data's figures come from, as printed (the estimate's `data.source`)."""


def format_estimate(result: dict[str, Any]) -> str:
    """The readable report: workload, memory, throughput, then one line per GPU and pricing; every
    figure with its unit and where it comes from (measured by a pilot, counted, sampled, assumed)."""
    if result["data"]["source"] == "none":
        return format_memory_fit(result)
    m, d, r, t = result["model"], result["data"], result["run"], result["throughput"]
    mem_g = result["memory_gib"]
    where = DATA_SOURCES[d["source"]].format(n=d.get("sampled_examples") or 0)
    devices = "dev-h" if any(o.get("memory_gib") is None for o in result["options"]) else "GPU-h"
    lines = [
        *cheapest_lines(result),
        *_model_line(m),
        f"data    {d['rows_per_epoch']:,.0f} rows/epoch, {d['real_tokens_per_epoch']:,.0f} real tokens/epoch "
        f"({d['trainable_tokens_per_epoch']:,.0f} trainable): {where}",
        *_truncation(d),
        f"run     {r['steps']:,} steps x {r['global_batch_rows']} rows x {r['seq_len']} token slots = "
        f"{r['steps'] * r['global_batch_rows'] * r['seq_len']:,} token slots, of which {r['real_tokens']:,.0f} real "
        f"(non-padding) tokens, on {_devices(result)}, {r['train_flops']:.3g} FLOPs"
        + (
            f", {r['pairs_per_step']:.1f} {r.get('pairs_are', 'pairs')} per step (mean)"
            if r.get("pairs_per_step")
            else ""
        ),
        _memory_line(mem_g),
        *_timeline(result),
        "",
        f"{'GPU':<14}{'fit':<5}{'pricing':<10}{'$/' + devices:>8}{'tok/s':>9}{'compute lo-exp-hi':>20}"
        f"{'+start':>8}{'+ckpt':>7}{'+eval':>7}{'+interr':>8}{'= wall':>8}{devices:>8}{'cost lo-exp-hi':>26}"
        f"{'ckpt every':>11}",
    ]
    for i, o in enumerate(result["options"]):
        c, w = o["cost"], o["compute_hours"]
        cost = "-".join(_money(c[k]) for k in ("low", "expected", "high")) if c["expected"] is not None else "n/a"
        price = f"${o['price_per_gpu_hour']:.2f}" if o["price_per_gpu_hour"] is not None else "n/a"
        rec = o.get("recommended_checkpoint_minutes")
        star = " *" if result["recommendation"] and result["recommendation"]["index"] == i else ""
        lines.append(
            f"{o['gpu'][:13]:<14}{'yes' if o['fits'] else 'NO':<5}{o['pricing']:<10}{price:>8}{_si(o['tokens_per_s']):>9}"
            f"{'-'.join(_hours(w[k]) for k in ('low', 'expected', 'high')):>20}"
            f"{_hours(o['startup_hours']):>8}{_hours(o['checkpoint_hours']):>7}{_hours(o['eval_hours']):>7}"
            f"{_hours(o['restart_hours']):>8}{_hours(o['wall_hours']['expected']):>8}"
            f"{o['gpu_hours']['expected']:>8.2f}{cost:>26}{(f'{rec:.0f} min' if rec and o['pricing'] == 'spot' else ''):>11}{star}"
        )
    rec = result["recommendation"]
    lines += _fsdp_hint(result)
    lines += settings_lines(result["options"])
    lines += changes_lines(result["options"], result["memory_gib"]["total"])
    lines.append("")
    if rec:
        lines.append(
            f"recommended: {rec['gpu']} {rec['pricing']}, ~{_hours(rec['wall_hours'])}, "
            f"~{_money(rec['cost'])} ({rec['why']}; the row marked *)"
        )
        if rec.get("next_cheaper"):
            lines.append(f"  next cheaper: {rec['next_cheaper']}")
    elif result["constraints"]["deadline_hours"] is not None or result["constraints"]["budget"] is not None:
        lines.append("recommended: none meets the deadline/budget; relax one, add GPUs (--gpus) or shorten the run")
    lines.append(f"throughput: {throughput_source(t)}")
    lines += [f"  - {a}" for a in result["assumptions"]]
    lines += [
        f"tok/s: real (non-padding) tokens per second of the run, all its GPUs; times in h/m/s; {devices} = wall x "
        f"{'devices' if devices == 'dev-h' else 'GPUs'}; cost = {devices} x price, in $ (the catalogue's USD "
        "prices; --catalog YAML for yours), low-expected-high",
        "wall = compute + start-up + checkpoint saves + evaluation + (spot) expected interruptions x "
        "(restart + half a checkpoint interval)",
    ]
    return "\n".join(lines)


def throughput_source(t: dict[str, Any]) -> str:
    """Where the tokens/s come from, in words (the estimate's `throughput.source`)."""
    if t["source"] == "pilot":
        return f"measured by a pilot (`spotune pilot`) on {t.get('device')}"
    if t["source"] == "given":
        return f"given with --throughput ({t['tokens_per_s_per_gpu']:,.0f} real tokens/s per GPU)"
    return f"assumed, not measured: each GPU's peak bf16 FLOP/s x MFU {t['assumed_mfu']:.2f} (model FLOPs utilisation)"


def format_memory_fit(result: dict[str, Any]) -> str:
    """The report of an estimate without data (trainer/plan/fit.py): memory per GPU, then what time and cost need."""
    lines = [
        *cheapest_lines(result),
        *_model_line(result["model"]),
        _memory_line(result["memory_gib"]),
        "",
        f"{'GPU':<14}{'GiB':>6}  {'fit':<5}{'$/GPU-h':>8}{'spot':>7}{'$/1M tok':>9}{'spot':>8}{'MTBI':>6}  "
        "how (GiB per GPU)",
    ]
    for o in result["options"]:
        spot = f"${o['spot_price']:.2f}" if o.get("spot_price") is not None else "-"
        mtbi = f"{o['mtbi_hours']:g}h" if o.get("mtbi_hours") else "-"
        per = {k: "-" if v is None else f"${v:.3f}" for k, v in o["per_million_tokens"].items()}
        lines.append(
            f"{o['gpu'][:13]:<14}{o['memory_gib']:>6.0f}  {'yes' if o['fits'] else 'NO':<5}"
            f"{'$' + format(o['on_demand_price'], '.2f'):>8}{spot:>7}{per['on-demand']:>9}{per['spot']:>8}"
            f"{mtbi:>6}  {_how(o)}"
        )
    lines += _fsdp_hint(result)
    lines.append(
        f"$/1M tok: what a million trained tokens cost there, throughput {throughput_source(result['throughput'])} (spot: before "
        "interruptions, whose cost needs the run's length); how: what the recipe's `auto` memory settings choose on "
        "that GPU (the fastest that fits), or, where it does not fit, the smallest change that makes it fit; MTBI: "
        "mean time between spot interruptions (catalogue; --mtbi-hours to set yours)"
    )
    lines += ["", f"data: {result['data']['problem']}", result["needs"]]
    return "\n".join(lines)


def _devices(result: dict[str, Any]) -> str:
    """What the run is forecast on: GPUs (the catalogue's rows), and the device a pilot ran on when that is
    not one of them (this CPU)."""
    n = result["run"]["gpus"]
    gpus = f"{n} GPU{'s' if n > 1 else ''}"
    elsewhere = [o["gpu"] for o in result["options"] if o.get("memory_gib") is None]
    if not elsewhere:
        return gpus
    device = elsewhere[0]
    shown = "CPU" if device.lower() == "cpu" else device
    return f"{n} x {shown} (where the pilot ran), or {gpus} (the catalogue's rows)"


def cheapest_lines(result: dict[str, Any]) -> list[str]:
    """The answer first: the cheapest GPU that fits, on demand and spot, and the setting it trains with."""
    found = result.get("cheapest") or {}
    priced = result["data"]["source"] != "none"
    parts = []
    for pricing in ("on-demand", "spot"):
        c = found.get(pricing)
        if c is None:
            continue
        count = f" x{c['gpus']}" if c["gpus"] > 1 else ""
        money = (
            f"~{_money(c['cost'])}, ~{_hours(c['wall_hours'])}"
            if priced and c.get("cost") is not None
            else f"${c['per_million_tokens']:.3f} per 1M tokens (${c['price_per_gpu_hour']:.2f}/GPU-h)"
        )
        parts.append(f"{pricing} {c['gpu']}{count} {money}")
    if not parts:
        return ["cheapest GPU that fits: none in the catalogue as set (see what makes one fit below)"]
    how = next((c["setting"] for c in (found.get("spot"), found.get("on-demand")) if c and c.get("setting")), None)
    basis = (
        "" if priced else f" (by cost per million trained tokens; throughput {throughput_source(result['throughput'])})"
    )
    lines = [f"cheapest GPU that fits{basis}: {'; '.join(parts)}"]
    if how:
        lines.append(f"  trains there with {how}")
    return lines


def settings_lines(options: list[dict[str, Any]]) -> list[str]:
    """What the `auto` memory settings choose on each GPU, one line per distinct choice."""
    by: dict[str, list[str]] = {}
    for o in options:
        s = o.get("setting")
        if s and s["fits"] and o["gpu"] not in by.get(s["setting"], []):
            by.setdefault(f"{s['setting']} ({s['gib']:.1f} GiB)", []).append(o["gpu"])
    if not by:
        return []
    return ["", "auto memory settings chosen per GPU (the fastest that fits):"] + [
        f"  {', '.join(dict.fromkeys(gpus))}: {setting}" for setting, gpus in by.items()
    ]


def changes_lines(options: list[dict[str, Any]], needs_gib: float) -> list[str]:
    """Where the run does not fit as set: per GPU, the smallest change that makes it fit, and the others."""
    lines, seen = [], set()
    for o in options:
        if o["fits"] or not o.get("fit_changes") or o["gpu"] in seen:
            continue
        seen.add(o["gpu"])
        lines.append(f"  {o['gpu']} ({o['memory_gib']:g} GiB): {_changes(o['fit_changes'])}")
    if not lines:
        return []
    return ["", f"does not fit as set ({needs_gib:.1f} GiB per GPU); what makes it fit, smallest change first:", *lines]


def _how(o: dict[str, Any]) -> str:
    s = o.get("setting")
    if o["fits"]:
        return f"{s['setting']} ({s['gib']:.1f})" if s and s["fits"] else "as set"
    return _changes(o.get("fit_changes") or [])


def _changes(found: list[dict[str, Any]]) -> str:
    fits = [c for c in found if c["fits"]]
    if not fits:
        return "nothing listed fits: " + ", ".join(_change(c) for c in found) if found else "does not fit"
    first, rest = fits[0], fits[1:]
    return f"fits with {_change(first)}" + (f"; or {', or '.join(_change(c) for c in rest)}" if rest else "")


def _change(c: dict[str, Any]) -> str:
    if c["gib"] is None:
        return f"{c['change']} (not within 64 GPUs)"
    return f"{c['change']} ({c['gib']:.1f} GiB)"


def _model_line(m: dict[str, Any]) -> list[str]:
    flop = f", {_si(m['flops_per_token'])} FLOP/token" if m.get("flops_per_token") else ""
    return [
        f"model   {m['name_or_path']} ({m['arch']}, {m['params'] / 1e6:,.1f}M params, {m['weight_format']}), "
        f"LoRA {m['trainable_params'] / 1e6:,.2f}M trainable{flop}"
    ]


_NOT_TERMS = ("total", "allocated", "reserved", "offloaded", "pilot_measured_peak", "sharded_over", "settings")
"""`memory_gib` keys that are not terms of the sum (subtotals, host memory, the pilot's figure, a count)."""


def _memory_line(mem_g: dict[str, Any]) -> str:
    """Every term of the per-GPU sum with its unit, the total, and what is not on the GPU."""
    terms = " + ".join(f"{k} {v:.3g}" for k, v in mem_g.items() if k not in _NOT_TERMS and v)
    line = f"memory  GiB per GPU, estimated from the model's shape and the recipe: {terms} = {mem_g['total']:.3g} GiB"
    if mem_g.get("settings"):
        line += f" with {mem_g['settings']}"
    if mem_g.get("offloaded"):
        line += f" (+ {mem_g['offloaded']:.3g} GiB of host memory for offloaded activations)"
    if mem_g.get("pilot_measured_peak"):
        line += f"; the pilot measured a peak of {mem_g['pilot_measured_peak']:.3g} GiB"
    return line


def _truncation(d: dict[str, Any]) -> list[str]:
    """What seq_len loses (trainer/data/stats.py), from the same source as the data's counts."""
    tr = d.get("truncation")
    if not tr:
        return []
    where = f" (in {d['sampled_examples']:,} sampled rows)" if d["source"] == "sample" else ""
    return ["        " + line for line in truncation_lines(tr, tr.get("p99"), where)]


def _money(x: float) -> str:
    return f"${x:,.2f}"


def _fsdp_hint(result: dict[str, Any]) -> list[str]:
    """Where the run does not fit: how many of each GPU hold it with the base sharded (FSDP), where FSDP can."""
    if not result["model"].get("shardable", True):
        return []
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
