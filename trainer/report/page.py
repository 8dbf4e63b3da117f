"""`report.html`: one self-contained page (PNGs embedded as data URIs, inline CSS, no script).

The PNGs are also written beside the page so they can be pasted elsewhere. The page is a
Jinja2 template with autoescaping on: every string from the run (paths, exit reasons,
notes) is escaped. Each headline figure carries its exact value in `data-value`, so a test
(or a script) can read the numbers without parsing the formatted text.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
import jinja2

from trainer.atomic import remove_temp_siblings, write_bytes, write_text
from trainer.report import plots, trained
from trainer.report.load import REPORT_FILE, RUNNING, Attempt, RunData, finite, load_run
from trainer.report.totals import FINISHED, Totals, headline, totals

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("trainer.report", "."),
    autoescape=True,
    undefined=jinja2.StrictUndefined,  # a misspelt field fails the test, not the reader
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(frozen=True)
class Card:
    key: str
    label: str
    text: str
    value: float | int | str | None
    sub: str = ""


def _money(x: float | None) -> str:
    return "n/a" if x is None else f"${x:,.2f}" if x >= 1 else f"${x:,.4f}"


def _num(x: float | None, fmt: str, none: str = "n/a") -> str:
    return format(x, fmt) if finite(x) else none


def _steps_text(t: Totals) -> str:
    if t.step is None:
        return "before step 1"
    return f"step {t.step}" + (f" / {t.total_steps}" if t.total_steps else "")


def _restart_cost_text(t: Totals) -> str:
    if not t.restarts:
        return "none"
    return _money(t.restart_cost) if t.restart_cost is not None else f"{t.restart_hours:,.3g} {t.hours_unit}"


def cards(t: Totals, price_known: bool) -> list[Card]:
    """The headline figures, most wanted first: status, money, time, restarts, then the model."""
    why_no_cost = "" if price_known else "set metrics.price_per_hour"
    stops = ", ".join(f"{n} {reason}" for reason, n in sorted(t.stops.items()))
    restart_sub = f"{stops}; {t.redone_steps} steps redone" if t.restarts else "no interruption"
    share = f" ({t.restart_cost / t.cost:.0%} of cost)" if t.restart_cost is not None and t.cost else ""
    return [
        Card("status", "Status", t.status, t.status, _steps_text(t)),
        Card("cost", "Cost so far", _money(t.cost), t.cost, why_no_cost),
        Card("gpu_hours", t.hours_unit, f"{t.device_hours:,.4g}", t.device_hours, f"{t.attempts} attempt(s)"),
        Card("goodput", "Goodput", f"{t.goodput:.1%}", t.goodput, "productive / paid time"),
        Card("restarts", "Restarts", str(t.restarts), t.restarts, restart_sub),
        Card(
            "restart_cost",
            "Restarts cost",
            _restart_cost_text(t),
            t.restart_cost if t.restart_cost is not None else t.restart_hours,
            f"{t.restart_hours:,.3g} {t.hours_unit} of start-up + redone work{share}",
        ),
        Card(
            "final_loss",
            "Final loss" if t.status == FINISHED else "Latest loss",
            _num(t.final_loss, ".4f"),
            t.final_loss,
            f"eval {_num(t.final_eval_loss, '.4f')}" if t.final_eval_loss is not None else "",
        ),
        Card("tokens_per_s", "Tokens/s", _num(t.tokens_per_s, ",.0f"), t.tokens_per_s, "sustained, real tokens"),
        Card("mfu", "MFU", _num(t.mfu, ".1%"), t.mfu, "" if t.mfu is not None else "peak FLOP/s unknown"),
        Card("peak_memory_gib", "Peak memory", _num(t.peak_memory_gib, ".2f") + " GiB", t.peak_memory_gib),
        Card("data_stall", "Data stall", _num(t.data_stall_share, ".1%"), t.data_stall_share, "of step time"),
        *_live_cards(t),
    ]


def _live_cards(t: Totals) -> list[Card]:
    """A run still training: when it should end and what it should cost by then."""
    if t.status != RUNNING:
        return []
    eta = t.eta_s
    if eta is None:
        when = "needs train.max_steps and a logged step"
    else:
        when = datetime.fromtimestamp(time.time() + eta, tz=timezone.utc).strftime("about %H:%M UTC; saves not counted")
    return [
        Card("eta", "ETA", _duration(eta) if eta is not None else "n/a", eta, when),
        Card(
            "projected_cost",
            "Projected cost",
            _money(t.projected_cost),
            t.projected_cost,
            "at the sustained step time" if t.projected_cost is not None else "set metrics.price_per_hour",
        ),
    ]


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def details(t: Totals) -> str:
    """What follows the headline: loss, speed, hours, money, and what the restarts cost."""
    which = "Final" if t.status == FINISHED else "Latest"
    loss = f"{which} loss {t.final_loss:.4f}" if t.final_loss is not None else "No loss logged yet"
    rate = f", {t.tokens_per_s:,.0f} tokens/s" if t.tokens_per_s is not None else ""
    cost = f", {_money(t.cost)}" if t.cost is not None else ""
    text = f"{loss}{rate}; {t.device_hours:,.4g} {t.hours_unit}{cost}; goodput {t.goodput:.1%}."
    if t.restarts:
        price = f" ({_money(t.restart_cost)})" if t.restart_cost is not None else ""
        text += f" {t.restarts} restart(s) cost {t.restart_hours:,.3g} {t.hours_unit}{price}, {t.redone_steps} steps redone."
    return text


def summary_text(t: Totals) -> str:
    """The plain-text summary printed by `spotune report` and at the end of `train`."""
    return f"{headline(t)} {details(t)}"


def forecast_rows(run: RunData, t: Totals) -> list[tuple[str, str, str]]:
    """(what, forecast, actual) from pilot.json and estimate.json, when the run has them."""
    rows: list[tuple[str, str, str]] = []
    p = run.pilot
    if p:
        sustained = [
            r for r in run.train_rows if finite(r.get("sustained_tokens_per_s")) and finite(r.get("step_time_s"))
        ]
        mean_step = sum(r["step_time_s"] for r in sustained) / len(sustained) if sustained else None
        st = p.get("step_time_s") or {}
        first = run.attempts[0] if run.attempts else None
        rows += [
            ("sustained tokens/s", _num(p.get("sustained_tokens_per_s"), ",.0f"), _num(t.tokens_per_s, ",.0f")),
            (
                "step time (s)",
                f"{_num(st.get('mean'), '.3f')} (p10–p90 {_num(st.get('p10'), '.3f')}–{_num(st.get('p90'), '.3f')})",
                _num(mean_step, ".3f"),
            ),
            ("MFU", _num(p.get("sustained_mfu"), ".1%"), _num(t.mfu, ".1%")),
            ("data stall", _num(p.get("data_stall_share"), ".1%"), _num(t.data_stall_share, ".1%")),
            ("peak memory (GiB)", _num(p.get("peak_memory_gib"), ".2f"), _num(t.peak_memory_gib, ".2f")),
            (
                "start-up (s)",
                _num(p.get("startup_seconds"), ".1f"),
                _num(first.startup_seconds / first.world_size if first else None, ".1f"),
            ),
        ]
        if finite(st.get("mean")) and t.step:
            world = first.world_size if first else 1
            rows.append(
                (
                    f"training {t.hours_unit} for {t.step} steps",
                    f"{st['mean'] * t.step * world / 3600:,.4g}",
                    f"{t.productive_hours:,.4g}",
                )
            )
    e = run.estimate
    if e and e.get("options"):
        option = _estimate_option(e, run)
        label = f"{option.get('gpu')} ×{option.get('gpus')} {option.get('pricing')}"
        for key, what, fmt in (("gpu_hours", t.hours_unit, ",.4g"), ("cost", "cost", "money")):
            expected = (option.get(key) or {}).get("expected")
            actual = t.device_hours if key == "gpu_hours" else t.cost
            shown_f = _money(expected) if fmt == "money" else _num(expected, fmt)
            shown_a = _money(actual) if fmt == "money" else _num(actual, fmt)
            rows.append((f"{what} (estimate: {label})", shown_f, shown_a))
    return rows


def _estimate_option(estimate: dict[str, Any], run: RunData) -> dict[str, Any]:
    """The estimate's option for this run's machine (metrics.gpu, or the device the pilot
    measured), else its recommendation, else its first option."""
    options = estimate["options"]
    ours = {run.config.metrics.gpu if run.config else None, (run.pilot or {}).get("device")} - {None}
    for option in options:
        if option.get("gpu") in ours:
            return dict(option)
    index = (estimate.get("recommendation") or {}).get("index", 0)
    return dict(options[index if 0 <= index < len(options) else 0])


def render(run: RunData, images: dict[str, bytes]) -> str:
    t = totals(run)
    tone = {FINISHED: "ok", RUNNING: "live"}.get(t.status, "warn" if t.status in ("preempted", "budget") else "bad")
    sections = [
        (
            title,
            [
                {
                    "file": name,
                    "caption": plots.FIGURES[name][1],
                    "uri": "data:image/png;base64," + base64.b64encode(images[name]).decode(),
                }
                for name in names
                if name in images
            ],
        )
        for title, names in plots.SECTIONS.items()
    ]
    return _ENV.get_template("report.html.j2").render(
        source=run.source,
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        tone=tone,
        headline=headline(t),
        summary=details(t),
        cards=cards(t, price_known=t.cost is not None),
        sections=sections,
        forecast=forecast_rows(run, t),
        trained=trained.facts(
            run.config, run.trained, [(a.device, a.world_size, a.exit_reason) for a in run.attempts], run.source
        ),
        example=run.example,
        attempts=[_attempt_row(a) for a in run.attempts],
        notes=run.notes,
    )


def _attempt_row(a: Attempt) -> dict[str, str]:
    fmt = "%Y-%m-%d %H:%M:%S"
    return {
        "attempt": str(a.attempt),
        "start": datetime.fromtimestamp(a.start, tz=timezone.utc).strftime(fmt),
        "end": datetime.fromtimestamp(a.end, tz=timezone.utc).strftime(fmt),
        "exit": a.exit_reason,
        "devices": str(a.world_size),
        "device": a.device or "",
        "last_step": "" if a.last_step is None else str(a.last_step),
        "device_s": f"{a.device_seconds:,.1f}",
        "startup_s": f"{a.startup_seconds:,.1f}",
        "productive_s": f"{a.productive_seconds:,.1f}",
        "checkpoint_s": f"{a.checkpoint_seconds:,.2f}",
        "lost_s": f"{a.lost_seconds:,.1f}",
        "cost": _money(a.cost),
    }


def default_out(run_dir: str) -> Path:
    """The run directory itself when it is local (a path or file://); else ./report-<name>."""
    if "://" not in run_dir:
        return Path(run_dir)  # as the user wrote it (fsspec would make it absolute)
    fs, path = fsspec.core.url_to_fs(run_dir)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return Path(path)
    return Path.cwd() / f"report-{Path(path.rstrip('/')).name or 'run'}"


def write_report(run_dir: str | Path, out: Path | None = None) -> tuple[Path, str]:
    """Read `run_dir`, write report.html and the PNGs into `out`; returns (page, summary text)."""
    run = load_run(str(run_dir))
    out = Path(out) if out is not None else default_out(str(run_dir))
    out.mkdir(parents=True, exist_ok=True)
    images = {name: png for name, (draw, _) in plots.FIGURES.items() if (png := draw(run))}  # b"": not this run's
    for name, png in images.items():
        remove_temp_siblings(out / name)  # a report killed mid-write (SIGKILL after train) left one
        write_bytes(out / name, png)
    page = out / REPORT_FILE
    remove_temp_siblings(page)
    write_text(page, render(run, images))
    return page, summary_text(totals(run))
